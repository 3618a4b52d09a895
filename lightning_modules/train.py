"""Training runs: build or load a drafter, fit it with a fresh Lightning Trainer, save it."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import lightning as L
import torch

from adaflash.config import DEFAULT_BLOCK_SIZE, DistillConfig, DrafterConfig
from adaflash.hardware import native_bf16
from adaflash.models.drafter import DFlashDrafter, save_drafter
from adaflash.models.target import DecoderLayer, TargetModel
from adaflash.teacher_cache import CachedSequence, teach
from adaflash.workloads import Trajectory
from lightning_modules.data import TeacherDataModule
from lightning_modules.distill import DrafterDistillation

Source = Sequence[Trajectory] | Sequence[CachedSequence]
log = logging.getLogger(__name__)


def effective(cfg: DistillConfig) -> DistillConfig:
    """The settings a run actually trains with: bf16 autocast only where it is faster — on a
    GPU, or on a CPU with native bf16. Elsewhere a bf16 matmul runs a reference kernel (a
    training step of the shipped drafter took 1.7× as long as in fp32, AMD EPYC AVX2, one
    thread), so the run stays in fp32 and the model card says so."""
    if cfg.bf16_autocast and not torch.cuda.is_available() and not native_bf16():
        return replace(cfg, bf16_autocast=False)
    return cfg


@dataclass
class TrainResult:
    drafter: DFlashDrafter
    steps: int
    samples: int
    seconds: float
    val_accept_len: float | None
    history: list[dict[str, float]] = field(default_factory=list)
    blocks: int = 0  # blocks seen, counting those of the runs this one continues
    curve: list[dict[str, Any]] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        last = self.history[-20:]
        mean = (lambda k: round(sum(r[k] for r in last) / len(last), 4)) if last else None
        return {
            "steps": self.steps,
            "samples": self.samples,
            "blocks_seen": self.blocks,
            "seconds": round(self.seconds, 1),
            "val_accept_len_sim": None
            if self.val_accept_len is None
            else round(self.val_accept_len, 4),
            "final_draft_loss": mean("draft_loss") if mean else None,
            "final_head_loss": mean("head_loss") if mean else None,
            "final_train_accept_len_sim": mean("accept_len_sim") if mean else None,
        }


def new_drafter(
    target: TargetModel,
    *,
    mask_token_id: int,
    num_layers: int = 3,
    num_features: int | None = None,
    intermediate_size: int | None = None,
    block_size: int = DEFAULT_BLOCK_SIZE,
    init_from_target: bool = True,
    fuse_identity: bool = True,
    seed: int = 0,
) -> DFlashDrafter:
    """A fresh drafter for ``target``. With ``init_from_target`` its layers start as copies of the
    target's last layers (same shapes; q/k norms start at 1) — a warm start, not a trained
    drafter; the norms and length head start fresh. ``fuse_identity`` starts the fusion ``fc``
    as the identity on the deepest captured layer (measured: τ 1.27 against 1.16 after 44K
    blocks on SmolLM2 chat, docs/results/drafter/README.md)."""
    torch.manual_seed(seed)
    cfg = DrafterConfig.for_target(
        target.cfg,
        num_layers=num_layers,
        mask_token_id=mask_token_id,
        block_size=block_size,
        num_features=num_features,
        intermediate_size=intermediate_size,
    )
    drafter = DFlashDrafter(cfg)
    if init_from_target and cfg.intermediate_size == target.cfg.intermediate_size:
        src_layers = list(target.layers)[-num_layers:]
        with torch.no_grad():
            for dst, src in zip(drafter.layers, src_layers, strict=True):
                own = dst.state_dict()
                for name, t in src.state_dict().items():
                    if name in own and own[name].shape == t.shape:
                        own[name].copy_(t.float())
            if fuse_identity:
                # c_t starts as the deepest captured hidden state, normed like the first copied
                # layer's input: its context keys/values are then the target's own
                h = cfg.hidden_size
                drafter.fc.weight.zero_()
                drafter.fc.weight[:, -h:].copy_(torch.eye(h))
                first = src_layers[0]
                assert isinstance(first, DecoderLayer)
                drafter.hidden_norm.weight.copy_(first.input_layernorm.weight.float())
    return drafter


def cached(target: TargetModel, items: Source, drafter: DFlashDrafter, top_k: int) -> Source:
    """Trajectories → their cached teacher (the target runs once each); cached stays as is."""
    if items and isinstance(items[0], Trajectory):
        return teach(target, list(items), drafter.cfg.target_layer_ids, top_k)  # type: ignore[arg-type]
    return items


def fit(
    drafter: DFlashDrafter,
    target: TargetModel,
    train: Source,
    val: Source | None,
    cfg: DistillConfig,
    log_dir: Path | None = None,
    progress: bool = True,
    curve_sets: Mapping[str, Sequence[CachedSequence]] | None = None,
    curve_every: int = 0,
    blocks_offset: int = 0,
    on_curve: Callable[[list[dict[str, Any]]], None] | None = None,
) -> TrainResult:
    """One training run with a fresh Trainer on trajectories (taught in memory first) or cached
    sequences. The drafter trains in fp32 (bf16 autocast when configured); the target stays
    frozen in its own dtype. ``curve_sets`` are replayed every ``curve_every`` blocks."""
    ran = effective(cfg)
    if ran != cfg:
        log.warning("bf16 autocast off: this CPU lacks native bf16, fp32 trains faster here")
    cfg = ran
    drafter.float().train().requires_grad_(True)
    train_seqs = cached(target, train, drafter, cfg.top_k)
    val_seqs = cached(target, val or [], drafter, cfg.top_k)
    module = DrafterDistillation(
        drafter, target, cfg, curve_sets, curve_every, blocks_offset, on_curve
    )
    data = TeacherDataModule(train_seqs, val_seqs, batch_size=cfg.batch_size, seed=cfg.seed)  # type: ignore[arg-type]
    trainer = L.Trainer(
        accelerator="cpu" if not torch.cuda.is_available() else "auto",
        devices=cfg.devices if torch.cuda.is_available() else 1,
        strategy=cfg.strategy,
        num_nodes=cfg.num_nodes,
        max_epochs=cfg.epochs,
        max_steps=cfg.max_steps,
        max_time={"seconds": int(cfg.max_minutes * 60)} if cfg.max_minutes else None,
        gradient_clip_val=cfg.grad_clip,
        accumulate_grad_batches=cfg.accumulate,
        logger=L.pytorch.loggers.CSVLogger(str(log_dir)) if log_dir else False,
        enable_checkpointing=False,
        enable_progress_bar=progress,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=1.0 if val_seqs else 0,
        log_every_n_steps=10,
    )
    t0 = time.perf_counter()
    trainer.fit(module, datamodule=data)
    seconds = time.perf_counter() - t0
    val_tau = None
    if val_seqs:
        trainer.validate(module, datamodule=data, verbose=False)
        val_tau = module.val_counters.accept_len if module.val_counters.rounds else None
    if curve_every and curve_sets:
        module.curve.append(module.measure_curve())  # the run's end is always a point
        if on_curve is not None:
            on_curve(module.curve)
    drafter.eval().requires_grad_(False)
    return TrainResult(
        drafter,
        trainer.global_step,
        module.samples_seen,
        seconds,
        val_tau,
        module.history,
        module.blocks_seen,
        module.curve,
    )


def write_model_card(
    folder: Path,
    *,
    title: str,
    data: dict[str, Any],
    cfg: DistillConfig,
    result: TrainResult,
    extra: dict[str, Any] | None = None,
) -> None:
    """README.md (human) + training.json (machine) next to the weights (the settings the run
    trained with)."""
    cfg = effective(cfg)
    d = result.drafter.cfg
    info = {
        "title": title,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "architecture": {
            "layers": d.num_layers,
            "hidden": d.hidden_size,
            "intermediate": d.intermediate_size,
            "heads": d.num_heads,
            "kv_heads": d.num_kv_heads,
            "block_size": d.block_size,
            "target_layer_ids": list(d.target_layer_ids),
            "mask_token_id": d.mask_token_id,
            "length_head_hidden": d.length_head_hidden,
            "parameters": sum(p.numel() for p in result.drafter.parameters()),
        },
        "data": data,
        "settings": asdict(cfg),
        "result": result.summary(),
        **(extra or {}),
    }
    (folder / "training.json").write_text(json.dumps(info, indent=2) + "\n")
    lines = [
        f"# {title}",
        "",
        "A DFlash-format diffusion drafter with an AdaFlash length head (`length_head.*`).",
        "",
        "## Data",
        *[f"- {k}: {v}" for k, v in data.items()],
        "",
        "## Settings",
        *[f"- {k}: {v}" for k, v in asdict(cfg).items()],
        "",
        "## Result",
        *[f"- {k}: {v}" for k, v in result.summary().items()],
        *[f"- {k}: {v}" for k, v in (extra or {}).items()],
        "",
        "`accept_len_sim` replays the drafter against the recorded target tokens with the whole",
        "block verified (no generation); serving τ is measured by `bench/eval_drafter.py`.",
        "",
    ]
    (folder / "README.md").write_text("\n".join(lines))


def save_run(
    result: TrainResult,
    folder: Path,
    *,
    title: str,
    data: dict[str, Any],
    cfg: DistillConfig,
    metadata: dict[str, str] | None = None,
    dtype: str = "bfloat16",
    extra: dict[str, Any] | None = None,
) -> Path:
    save_drafter(result.drafter, folder, metadata=metadata, dtype=dtype)
    write_model_card(folder, title=title, data=data, cfg=cfg, result=result, extra=extra)
    return folder
