"""The trainer service (``adaflash trainer``): APScheduler runs online training rounds.

Triggers: enough new trajectories (checked every ``poll_s``), an optional interval, and admin
requests (a ``requested`` row in ``training_runs``, written by the API from any machine). One job
at a time: APScheduler's ``max_instances=1`` in this process and a ``running`` row across
processes. Runs in its own process with a bounded torch thread count (and a nice level), so it
never starves serving; it shares only the database URL and the weights directory.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from apscheduler.schedulers.background import BackgroundScheduler
from sqlalchemy import Engine

from adaflash.models.target import TargetModel, load_target
from db.buffer import count_unconsumed
from db.registry import Registry
from db.runs import claim_run, fail_stale_runs, finish_run, pending_request
from lightning_modules.online import OnlineConfig, RoundOutcome, for_target, training_round

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrainerConfig:
    """How the trainer process runs (what it trains is ``OnlineConfig``)."""

    poll_s: float = 10.0
    interval_minutes: float | None = None  # also train on this period when anything is new
    threads: int = 1
    nice: int = 10
    target_dtype: str = "bfloat16"

    def __post_init__(self) -> None:
        if self.poll_s <= 0 or self.threads < 1:
            raise ValueError("poll_s must be > 0 and threads ≥ 1")
        if self.interval_minutes is not None and self.interval_minutes <= 0:
            raise ValueError("interval_minutes must be > 0 (or unset)")


class TrainerService:
    def __init__(
        self,
        db: Engine,
        registry: Registry,
        target_dir: Path,
        online: OnlineConfig,
        cfg: TrainerConfig | None = None,
    ) -> None:
        self.db, self.registry, self.target_dir = db, registry, target_dir
        self.online, self.cfg = for_target(online, target_dir), cfg or TrainerConfig()
        self._target: TargetModel | None = None
        self._lock = threading.Lock()
        self.scheduler: BackgroundScheduler | None = None
        self.outcomes: list[RoundOutcome] = []
        self.current_run: int | None = None  # the run this process is in the middle of

    @property
    def target(self) -> TargetModel:
        if self._target is None:
            self._target = load_target(self.target_dir, self.cfg.target_dtype)
        return self._target

    def prepare(self) -> None:
        """Bound our CPU use and clean up after a trainer that died mid-run."""
        torch.set_num_threads(self.cfg.threads)
        if self.cfg.nice and hasattr(os, "nice"):
            os.nice(self.cfg.nice)
        stale = fail_stale_runs(self.db)
        partial = self.registry.clean_partial()
        if stale or partial:
            log.warning(
                "recovered from an interrupted trainer: %d runs failed, %d partial "
                "version folders removed",
                stale,
                partial,
            )

    def start(self) -> None:
        self.prepare()
        self.scheduler = BackgroundScheduler()
        self.scheduler.add_job(
            self.tick,
            "interval",
            seconds=self.cfg.poll_s,
            max_instances=1,
            coalesce=True,
            id="poll",
        )
        if self.cfg.interval_minutes:
            self.scheduler.add_job(
                self.run_now,
                "interval",
                minutes=self.cfg.interval_minutes,
                kwargs={"trigger": "interval"},
                max_instances=1,
                coalesce=True,
                id="interval",
            )
        self.scheduler.start()

    def stop(self) -> bool:
        """Stop scheduling. A round in progress is not waited for: its run is recorded as
        failed now (its partial version folder is removed at the next start). Returns whether
        one was cut short."""
        interrupted = self.current_run
        if interrupted is not None:
            finish_run(
                self.db, interrupted, status="failed", error="stopped: the trainer was shut down"
            )
            log.warning("training run %d cut short by shutdown", interrupted)
        if self.scheduler is not None:
            self.scheduler.shutdown(wait=interrupted is None)
            self.scheduler = None
        return interrupted is not None

    def heartbeat(self) -> None:
        """Touch ``trainer.heartbeat`` beside the weights (the compose health check reads it)."""
        (self.registry.weights_dir.parent / "trainer.heartbeat").write_text(f"{time.time()}\n")

    def tick(self) -> RoundOutcome | None:
        """Admin requests first, then the new-data threshold."""
        self.heartbeat()
        requested = pending_request(self.db)
        if requested is not None:
            return self.run_now("admin", requested)
        if count_unconsumed(self.db) >= self.online.min_new:
            return self.run_now("threshold")
        return None

    def run_now(self, trigger: str = "manual", run_id: int | None = None) -> RoundOutcome | None:
        if not self._lock.acquire(blocking=False):
            return None  # a round is already running in this process
        try:
            if trigger == "interval" and count_unconsumed(self.db) == 0:
                return None
            claimed = claim_run(self.db, trigger, run_id)
            if claimed is None:
                return None  # another trainer process holds the running slot
            log.info("training run %d (%s) starting", claimed, trigger)
            self.current_run = claimed
            try:
                outcome = training_round(self.db, self.registry, self.target, self.online, claimed)
            finally:
                self.current_run = None
            log.info(
                "training run %d: %s %s %s",
                claimed,
                outcome.status,
                outcome.version_id,
                "promoted" if outcome.promoted else outcome.reason,
            )
            self.outcomes.append(outcome)
            return outcome
        finally:
            self._lock.release()
