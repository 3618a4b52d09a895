"""One online training round: buffer → fresh Lightning run → candidate version → promotion gate.

1. take the oldest unconsumed trajectories (at most ``max_samples``); hold out the most recent
   ``holdout_fraction`` for the gate (they stay unconsumed and feed a later round);
2. train the active version's drafter + head on the rest plus the replay window, the ``replay``
   latest trajectories earlier rounds trained on, plus ``retain`` trajectories drawn afresh each
   round from ``retain_from`` (the domains the drafter served before; by default the shipped
   drafter's chat and code trajectories), so that traffic that moved to one domain does not
   pull the drafter from the others (``lightning_modules.train.fit``);
3. publish the result as an immutable candidate version (atomic);
4. gate: replay candidate and active drafters against the held-out trajectories' recorded target
   tokens (simulated acceptance, no generation, the same anchors for both); promote when the
   candidate's τ is at least the active one's plus ``gate_margin`` (0: it may not measure worse;
   a version that measured worse on the traffic it would serve is never promoted), else reject
   with the reason;
5. mark exactly the trained trajectories consumed by this run.
"""

from __future__ import annotations

import logging
import random
import time
import traceback
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from sqlalchemy import Engine

from adaflash.config import DistillConfig
from adaflash.distill import simulate_acceptance
from adaflash.models.target import TargetModel
from adaflash.paths import REPO
from adaflash.pull import DEFAULT_TARGET, pulled_as
from adaflash.workloads import Trajectory, read_trajectories
from db.buffer import mark_consumed, recently_consumed, unconsumed
from db.models import TrajectoryRow
from db.registry import Registry
from db.runs import finish_run
from lightning_modules.train import fit

log = logging.getLogger(__name__)


# what the shipped drafter was trained on: the target's greedy answers to chat and code prompts
SHIPPED_DOMAINS = tuple(
    str(REPO / "assets" / "trajectories" / f"{d}_greedy.jsonl.gz") for d in ("chat", "code")
)


@dataclass(frozen=True)
class OnlineConfig:
    min_new: int = 128  # train when at least this many new trajectories exist (paper: 128)
    max_samples: int = 512
    min_samples: int = 8  # below this even an admin-triggered run refuses
    holdout_fraction: float = 0.125
    gate_margin: float = 0.0  # τ points the candidate must gain over the active version (≥)
    replay: int = 0  # trajectories of earlier rounds trained on again with the new ones
    # trajectories of ``retain_from`` trained on with each round's new ones: as many as a round
    # needs new (README "Keeping the old domains": no forgetting at 96 beside 84 new)
    retain: int = 128
    retain_from: tuple[str, ...] = SHIPPED_DOMAINS  # trajectory files (JSONL, or .jsonl.gz)
    gate_anchors: int = 32
    distill: DistillConfig = field(default_factory=DistillConfig)

    def __post_init__(self) -> None:
        if self.min_new < 1 or self.min_samples < 2:
            raise ValueError("min_new must be ≥ 1 and min_samples ≥ 2")
        if self.replay < 0 or self.retain < 0:
            raise ValueError("replay and retain must be ≥ 0")
        object.__setattr__(self, "retain_from", tuple(self.retain_from))  # a list, from JSON
        if self.retain and not self.retain_from:
            raise ValueError("retain needs trajectory files to draw from (retain_from)")
        if not 0.0 < self.holdout_fraction < 1.0:
            raise ValueError("holdout_fraction must be in (0, 1)")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> OnlineConfig:
        """The inverse of ``to_dict`` (how ``serve`` hands its settings to the trainer process)."""
        raw = dict(raw)
        distill = raw.pop("distill", {})
        return cls(distill=DistillConfig(**distill), **raw)


@dataclass
class RoundOutcome:
    run_id: int
    status: str  # succeeded / failed / skipped
    version_id: str | None = None
    promoted: bool = False
    reason: str = ""
    metrics: dict[str, Any] = field(default_factory=dict)


def as_trajectory(row: TrajectoryRow) -> Trajectory:
    return Trajectory(
        row.request_id,
        row.domain or "",
        list(row.prompt_ids),
        list(row.response_ids),
        row.response_text or "",
        row.finish_reason,
    )


def retained(cfg: OnlineConfig, run_id: int) -> list[Trajectory]:
    """``cfg.retain`` trajectories of ``cfg.retain_from``, a fresh draw each round (seeded by
    the run): they keep the drafter fitted to the domains its traffic moved away from."""
    if not cfg.retain:
        return []
    pool = read_trajectories([Path(p) for p in cfg.retain_from])
    return random.Random(run_id).sample(pool, min(cfg.retain, len(pool)))


def for_target(cfg: OnlineConfig, target_dir: Path) -> OnlineConfig:
    """``cfg`` as a trainer of the target in ``target_dir`` applies it. The shipped
    trajectories are the default target's tokens and answers: with any other target, training on
    them would teach the drafter another model's text, so ``retain`` drawing on them is off there
    (``retain_from`` files of that target's own answers keep it on)."""
    if (
        not cfg.retain
        or cfg.retain_from != SHIPPED_DOMAINS
        or pulled_as(target_dir) == DEFAULT_TARGET
    ):
        return cfg
    log.warning(
        "retain is off: the shipped chat and code trajectories are %s's answers, not %s's; "
        "give --retain-from files of its own answers to keep its other domains",
        DEFAULT_TARGET,
        target_dir,
    )
    return replace(cfg, retain=0)


def training_round(
    db: Engine, registry: Registry, target: TargetModel, cfg: OnlineConfig, run_id: int
) -> RoundOutcome:
    """Run one round for the already-claimed ``run_id``; records the result on the run row."""
    t0 = time.perf_counter()
    try:
        outcome = _round(db, registry, target, cfg, run_id)
    except Exception as exc:
        log.exception("training run %d failed", run_id)
        finish_run(
            db,
            run_id,
            status="failed",
            error=f"{type(exc).__name__}: {exc}\n" + traceback.format_exc(limit=3),
            seconds=time.perf_counter() - t0,
        )
        return RoundOutcome(run_id, "failed", reason=str(exc))
    finish_run(
        db,
        run_id,
        status=outcome.status,
        version_id=outcome.version_id,
        samples=outcome.metrics.get("samples", 0),
        steps=outcome.metrics.get("steps", 0),
        seconds=time.perf_counter() - t0,
        history=outcome.metrics.get("history", []),
        loss=cfg.distill.loss,
        error=outcome.reason if outcome.status != "succeeded" else None,
    )
    return outcome


def _round(
    db: Engine, registry: Registry, target: TargetModel, cfg: OnlineConfig, run_id: int
) -> RoundOutcome:
    rows = unconsumed(db, cfg.max_samples)
    if len(rows) < cfg.min_samples:
        return RoundOutcome(
            run_id, "skipped", reason=f"only {len(rows)} new trajectories (need {cfg.min_samples})"
        )
    n_hold = max(2, round(len(rows) * cfg.holdout_fraction))
    train_rows, hold_rows = rows[:-n_hold], rows[-n_hold:]
    parent = registry.active()
    if parent is None:
        raise RuntimeError("no active drafter version to train from")
    replayed = recently_consumed(db, cfg.replay)  # consumed rows: never the held-out ones
    kept = retained(cfg, run_id)
    drafter = registry.load(parent.id, "float32")
    data = kept + [as_trajectory(r) for r in replayed + train_rows]
    result = fit(drafter, target, data, None, cfg.distill, progress=False)
    summary = result.summary()
    candidate = registry.publish(
        result.drafter,
        parent=parent.id,
        loss=cfg.distill.loss,
        samples=len(data),
        data=(train_rows[0].seq, train_rows[-1].seq),
        metrics={
            "train": summary,
            "settings": asdict(cfg.distill),
            "replayed": len(replayed),
            "retained": len(kept),
        },
    )

    # gate: simulated acceptance of candidate vs active on held-out recent trajectories
    seqs = [(list(r.prompt_ids) + list(r.response_ids), len(r.prompt_ids)) for r in hold_rows]
    cand_c = simulate_acceptance(registry.load(candidate.id), target, seqs, cfg.gate_anchors)
    base_c = simulate_acceptance(registry.load(parent.id), target, seqs, cfg.gate_anchors)
    gate = {
        "holdout": len(hold_rows),
        "candidate_accept_len": round(cand_c.accept_len, 4),
        "active_accept_len": round(base_c.accept_len, 4),
        "margin": cfg.gate_margin,
    }
    registry.update_metrics(candidate.id, gate=gate)
    promoted = cand_c.accept_len >= base_c.accept_len + cfg.gate_margin
    if promoted:
        registry.activate(candidate.id)
        reason = ""
    else:
        reason = (
            f"simulated τ {cand_c.accept_len:.3f} is below the active version's "
            f"{base_c.accept_len:.3f} plus the margin {cfg.gate_margin}"
        )
        registry.reject(candidate.id, reason)
    consumed = mark_consumed(db, [r.seq for r in train_rows], run_id)
    metrics = {
        "samples": consumed,
        "replayed": len(replayed),
        "retained": len(kept),
        "steps": result.steps,
        "gate": gate,
        "history": [{k: round(v, 4) for k, v in h.items()} for h in result.history],
    }
    return RoundOutcome(
        run_id, "succeeded", candidate.id, promoted, reason if not promoted else "", metrics
    )
