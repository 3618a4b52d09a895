"""Training-run bookkeeping: requests (admin), claims, results."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import Engine, select, update
from sqlalchemy.orm import Session

from db.models import TrainingRunRow


def _now() -> datetime:
    return datetime.now(tz=UTC)


def request_run(engine: Engine, trigger: str = "admin") -> int:
    """Queue a training run for the trainer to pick up (works across machines via the DB)."""
    with Session(engine, expire_on_commit=False) as s, s.begin():
        pending = s.scalars(
            select(TrainingRunRow).where(TrainingRunRow.status.in_(["requested", "running"]))
        ).first()
        if pending is not None:
            return pending.id  # one job at a time: an open request already covers this one
        row = TrainingRunRow(
            trigger=trigger, status="requested", requested_at=_now(), samples=0, steps=0, history=[]
        )
        s.add(row)
        s.flush()
        return row.id


def claim_run(engine: Engine, trigger: str, run_id: int | None = None) -> int | None:
    """Mark a requested run (or a new one) as running. None if another run is running."""
    with Session(engine, expire_on_commit=False) as s, s.begin():
        running = s.scalars(
            select(TrainingRunRow).where(TrainingRunRow.status == "running")
        ).first()
        if running is not None:
            return None
        if run_id is None:
            row = TrainingRunRow(
                trigger=trigger,
                status="running",
                requested_at=_now(),
                started_at=_now(),
                samples=0,
                steps=0,
                history=[],
            )
            s.add(row)
            s.flush()
            return row.id
        s.execute(
            update(TrainingRunRow)
            .where(TrainingRunRow.id == run_id)
            .values(status="running", started_at=_now())
        )
        return run_id


def pending_request(engine: Engine) -> int | None:
    with Session(engine, expire_on_commit=False) as s:
        row = s.scalars(
            select(TrainingRunRow)
            .where(TrainingRunRow.status == "requested")
            .order_by(TrainingRunRow.id)
        ).first()
        return row.id if row else None


def finish_run(engine: Engine, run_id: int, *, status: str, **fields: Any) -> None:
    with Session(engine, expire_on_commit=False) as s, s.begin():
        s.execute(
            update(TrainingRunRow)
            .where(TrainingRunRow.id == run_id)
            .values(status=status, finished_at=_now(), **fields)
        )


def fail_stale_runs(engine: Engine, reason: str = "the trainer stopped during this run") -> int:
    """A trainer that starts knows no run of its own is running: mark leftovers failed."""
    with Session(engine, expire_on_commit=False) as s, s.begin():
        res = s.execute(
            update(TrainingRunRow)
            .where(TrainingRunRow.status == "running")
            .values(status="failed", finished_at=_now(), error=reason)
        )
        return int(getattr(res, "rowcount", 0) or 0)


def list_runs(engine: Engine, limit: int = 50) -> list[TrainingRunRow]:
    with Session(engine, expire_on_commit=False) as s:
        return list(
            s.scalars(select(TrainingRunRow).order_by(TrainingRunRow.id.desc()).limit(limit))
        )
