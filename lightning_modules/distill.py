"""The LightningModule that distills the drafter and fits the length head (SPEC §3–4).

The algorithm lives in ``adaflash.distill`` / ``adaflash.losses``; this module only wires it to
Lightning: one step = random anchors on each cached sequence of the batch, the OPD (or OSD) loss
on the drafter's draft vocabulary, the MSE head loss on detached states. One AdamW with two
parameter groups gives the drafter and the head their own learning rates; both follow the same
warmup + cosine schedule, whose length is the run's steps or its time budget, whichever ends it.
Every ``curve_every`` blocks the drafter is replayed on held-out sequences (the learning curve).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import lightning as L
import torch

from adaflash.config import DistillConfig
from adaflash.distill import curve_taus, distill_batch, replay, sample_anchors
from adaflash.metrics import SpecCounters
from adaflash.models.draft_vocab import lookup_table
from adaflash.models.drafter import DFlashDrafter
from adaflash.models.target import TargetModel
from adaflash.teacher_cache import CachedSequence


def lr_factor(cfg: DistillConfig, progress: float) -> float:
    """Multiplier of the base learning rates at ``progress`` ∈ [0, 1] of the run."""
    if cfg.lr_schedule == "constant":
        return 1.0
    if progress < cfg.warmup_fraction:
        return max(progress / cfg.warmup_fraction, 1e-3)
    span = max(1.0 - cfg.warmup_fraction, 1e-9)
    t = min(max((progress - cfg.warmup_fraction) / span, 0.0), 1.0)
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t))


class DrafterDistillation(L.LightningModule):
    def __init__(
        self,
        drafter: DFlashDrafter,
        target: TargetModel,
        cfg: DistillConfig,
        curve_sets: Mapping[str, Sequence[CachedSequence]] | None = None,
        curve_every: int = 0,
        blocks_offset: int = 0,
        on_curve: Callable[[list[dict[str, Any]]], None] | None = None,
    ) -> None:
        super().__init__()
        self.on_curve = on_curve  # called with the curve so far after each new point
        self.drafter = drafter
        self._frozen = (target,)  # a tuple keeps the target out of parameters and checkpoints
        self.cfg = cfg
        self.generator = torch.Generator().manual_seed(cfg.seed)
        vocab = drafter.draft_vocab
        self.lookup = None if vocab is None else lookup_table(vocab, drafter.cfg.vocab_size)
        self.history: list[dict[str, float]] = []
        self.curve: list[dict[str, Any]] = []
        self.curve_sets = dict(curve_sets or {})
        self.curve_every = curve_every
        self.val_counters = SpecCounters(drafter.cfg.block_size)
        self.samples_seen = 0
        self.blocks_seen = blocks_offset
        self._next_curve = blocks_offset + curve_every
        self._t0 = time.perf_counter()

    @property
    def target(self) -> TargetModel:
        return self._frozen[0]

    def transfer_batch_to_device(self, batch: Any, device: torch.device, idx: int) -> Any:
        return batch  # cached tensors move to the target's device in the step

    def training_step(self, batch: list[CachedSequence], batch_idx: int) -> torch.Tensor:
        anchors = [
            sample_anchors(
                seq.prompt_len, seq.tokens.numel(), self.cfg.anchors_per_seq, self.generator
            )
            for seq in batch
        ]
        device = self.drafter.fc.weight.device.type
        # a GPU pays per kernel: the whole batch in one pass (the recipe's H200 run spent ~29 ms
        # a sequence one by one). A CPU pays for memory: one pass over 8 sequences measured 21%
        # slower than 8 passes (docs/results/drafter/training_throughput_batched.json).
        per_pass = len(batch) if device == "cuda" else 1
        outs = []
        with torch.autocast(device, dtype=torch.bfloat16, enabled=self.cfg.bf16_autocast):
            for i in range(0, len(batch), per_pass):
                outs += distill_batch(
                    self.drafter,
                    self.target,
                    batch[i : i + per_pass],
                    anchors[i : i + per_pass],
                    self.cfg.loss,
                    self.cfg.alpha,
                    self.cfg.delta,
                    self.lookup,
                    self.cfg.supervised_slots,
                    self.cfg.slot_decay,
                )
        loss = torch.stack([o.loss for o in outs]).mean()
        accepted = torch.cat([o.accepted for o in outs]).float()
        self.blocks_seen += int(accepted.numel())
        row = {
            "step": float(self.global_step),
            "blocks": float(self.blocks_seen),
            "lr": float(self.trainer.optimizers[0].param_groups[0]["lr"]),
            "draft_loss": float(torch.stack([o.draft_loss.detach() for o in outs]).mean()),
            "head_loss": float(torch.stack([o.head_loss.detach() for o in outs]).mean()),
            "accept_len_sim": float(accepted.mean() + 1),
            "elapsed_s": time.perf_counter() - self._t0,
        }
        self.history.append(row)
        self.samples_seen += len(batch)
        self.log_dict(
            {f"train/{k}": v for k, v in row.items() if k != "step"},
            batch_size=len(batch),
            prog_bar=True,
        )
        return loss

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.curve_every and self.blocks_seen >= self._next_curve:
            self._next_curve = self.blocks_seen + self.curve_every
            self.curve.append(self.measure_curve())
            if self.on_curve is not None:
                self.on_curve(self.curve)

    def measure_curve(self) -> dict[str, Any]:
        """Simulated τ per held-out set now (one point of the learning curve)."""
        was_training = self.drafter.training
        self.drafter.eval()
        point: dict[str, Any] = {
            "blocks": self.blocks_seen,
            "elapsed_s": round(time.perf_counter() - self._t0, 1),
            "draft_loss": round(
                sum(r["draft_loss"] for r in self.history[-50:]) / max(len(self.history[-50:]), 1),
                4,
            ),
        }
        point.update(curve_taus(self.drafter, self.target, self.curve_sets))
        self.drafter.train(was_training)
        return point

    def validation_step(self, batch: list[CachedSequence], batch_idx: int) -> None:
        self.val_counters = self.val_counters + replay(
            self.drafter, self.target, batch, self.cfg.anchors_per_seq, seed=batch_idx
        )

    def on_validation_epoch_start(self) -> None:
        self.val_counters = SpecCounters(self.drafter.cfg.block_size)

    def on_validation_epoch_end(self) -> None:
        if self.val_counters.rounds:
            self.log("val/accept_len_sim", self.val_counters.accept_len, prog_bar=True)

    def configure_optimizers(self) -> Any:
        head = list(self.drafter.length_head.parameters())
        head_ids = {id(p) for p in head}
        body = [p for p in self.drafter.parameters() if id(p) not in head_ids]
        opt = torch.optim.AdamW(
            [{"params": body, "lr": self.cfg.drafter_lr}, {"params": head, "lr": self.cfg.head_lr}],
            weight_decay=self.cfg.weight_decay,
        )
        total = max(int(self.trainer.estimated_stepping_batches), 1)
        budget = 60 * self.cfg.max_minutes if self.cfg.max_minutes else None
        t0 = time.perf_counter()

        def factor(step: int) -> float:
            progress = step / total
            if budget:
                progress = max(progress, (time.perf_counter() - t0) / budget)
            return lr_factor(self.cfg, progress)

        sched = torch.optim.lr_scheduler.LambdaLR(opt, factor)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}
