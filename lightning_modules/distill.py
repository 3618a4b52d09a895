"""The LightningModule that distills the drafter and fits the length head (SPEC §3–4).

The algorithm lives in ``adaflash.distill`` / ``adaflash.losses``; this module only wires it to
Lightning: one step = the target re-run on each trajectory of the batch (no gradient), random
anchors, the OPD (or OSD) loss on the drafter, the MSE head loss on detached states. One AdamW
with two parameter groups gives the drafter and the head their own learning rates.
"""

from __future__ import annotations

import time
from typing import Any

import lightning as L
import torch

from adaflash.config import DistillConfig
from adaflash.distill import distill_sequence, run_teacher, sample_anchors, simulate_acceptance
from adaflash.metrics import SpecCounters
from adaflash.models.drafter import DFlashDrafter
from adaflash.models.target import TargetModel
from adaflash.workloads import Trajectory


class DrafterDistillation(L.LightningModule):
    def __init__(self, drafter: DFlashDrafter, target: TargetModel, cfg: DistillConfig) -> None:
        super().__init__()
        self.drafter = drafter
        self._frozen = (target,)  # a tuple keeps the target out of parameters and checkpoints
        self.cfg = cfg
        self.generator = torch.Generator().manual_seed(cfg.seed)
        self.history: list[dict[str, float]] = []
        self.val_counters = SpecCounters(drafter.cfg.block_size)
        self.samples_seen = 0
        self._t0 = time.perf_counter()

    @property
    def target(self) -> TargetModel:
        return self._frozen[0]

    def transfer_batch_to_device(self, batch: Any, device: torch.device, idx: int) -> Any:
        return batch  # token lists; tensors are built on the target's device in the step

    def training_step(self, batch: list[Trajectory], batch_idx: int) -> torch.Tensor:
        outs = []
        for traj in batch:
            tokens = traj.prompt_ids + traj.response_ids
            teacher = run_teacher(
                self.target, tokens, len(traj.prompt_ids), self.drafter.cfg.target_layer_ids
            )
            anchors = sample_anchors(
                len(traj.prompt_ids), len(tokens), self.cfg.anchors_per_seq, self.generator
            )
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.cfg.bf16_autocast):
                outs.append(
                    distill_sequence(
                        self.drafter,
                        self.target,
                        teacher,
                        anchors,
                        self.cfg.loss,
                        self.cfg.alpha,
                        self.cfg.delta,
                    )
                )
        loss = torch.stack([o.loss for o in outs]).mean()
        accepted = torch.cat([o.accepted for o in outs]).float()
        row = {
            "step": float(self.global_step),
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

    def validation_step(self, batch: list[Trajectory], batch_idx: int) -> None:
        seqs = [(t.prompt_ids + t.response_ids, len(t.prompt_ids)) for t in batch]
        self.val_counters = self.val_counters + simulate_acceptance(
            self.drafter, self.target, seqs, self.cfg.anchors_per_seq, seed=batch_idx
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
        return torch.optim.AdamW(
            [{"params": body, "lr": self.cfg.drafter_lr}, {"params": head, "lr": self.cfg.head_lr}],
            weight_decay=self.cfg.weight_decay,
        )
