"""The trajectory buffer: one writer thread drains the engine's bounded queue into the database.

Serving never waits: the engine offers records to a ``QueueSink`` (full queue → dropped and
counted). The writer takes batches and inserts them in one transaction with "insert or ignore"
on natural keys (request id; request id + round index), so a retried batch never duplicates.
When the database is unreachable the writer keeps the failed batch and retries with backoff;
it stops draining meanwhile, so the queue fills and further records are dropped and counted —
but nothing the queue accepted is lost: it is written once the database is back.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import Engine, Select, func, select, update
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session

from adaflash.engine.records import QueueSink, Record, RequestRecord, RoundRecord
from db.models import RoundRow, TrajectoryRow

log = logging.getLogger(__name__)


def _insert_ignore(conn: Any, table: Any, rows: list[dict[str, Any]], keys: list[str]) -> None:
    if not rows:
        return
    if conn.dialect.name == "postgresql":
        from sqlalchemy.dialects.postgresql import insert
    elif conn.dialect.name == "sqlite":
        from sqlalchemy.dialects.sqlite import insert  # type: ignore[assignment]
    else:
        raise ValueError(f"unsupported database {conn.dialect.name!r}: use SQLite or PostgreSQL")
    conn.execute(insert(table).on_conflict_do_nothing(index_elements=keys), rows)


def _utc(ts: float) -> datetime:
    return datetime.fromtimestamp(ts, tz=UTC)


def trajectory_row(r: RequestRecord) -> dict[str, Any]:
    return {
        "request_id": r.request_id,
        "created_at": _utc(r.created_at),
        "finished_at": _utc(r.finished_at),
        "domain": r.domain,
        "drafter_version": r.drafter_version,
        "prompt_ids": list(r.prompt_ids),
        "response_ids": list(r.output_ids),
        "response_text": r.output_text,
        "finish_reason": r.finish_reason,
        "temperature": r.temperature,
        "rounds": r.rounds,
        "accepted": r.accepted,
    }


def round_row(r: RoundRecord) -> dict[str, Any]:
    return {
        "request_id": r.request_id,
        "round_index": r.round_index,
        "ts": r.timestamp,
        "drafter_version": r.drafter_version,
        "policy": r.policy,
        "domain": r.domain,
        "block_size": r.block_size,
        "verify_len": r.verify_len,
        "accepted": r.accepted,
        "emitted": r.emitted,
        "a_hat": r.a_hat,
        "batch_size": r.batch_size,
        "draft_ms": r.draft_ms,
        "verify_ms": r.verify_ms,
    }


def write_records(engine: Engine, records: list[Record]) -> tuple[int, int]:
    """Insert a batch in one transaction (idempotent). Returns (trajectories, rounds) offered.
    Aborted and failed requests are not trajectories: nothing to learn from."""
    trajs = [
        trajectory_row(r)
        for r in records
        if isinstance(r, RequestRecord) and r.finish_reason in ("stop", "length") and r.output_ids
    ]
    rounds = [round_row(r) for r in records if isinstance(r, RoundRecord)]
    with engine.begin() as conn:
        _insert_ignore(conn, TrajectoryRow.__table__, trajs, ["request_id"])
        _insert_ignore(conn, RoundRow.__table__, rounds, ["request_id", "round_index"])
    return len(trajs), len(rounds)


@dataclass
class WriterStats:
    written_trajectories: int = 0
    written_rounds: int = 0
    write_errors: int = 0
    pending: int = 0
    last_error: str | None = None


class BufferWriter:
    def __init__(
        self,
        engine: Engine,
        sink: QueueSink,
        batch_size: int = 512,
        idle_s: float = 0.25,
        max_backoff_s: float = 5.0,
    ) -> None:
        self.engine, self.sink = engine, sink
        self.batch_size, self.idle_s, self.max_backoff_s = batch_size, idle_s, max_backoff_s
        self.stats = WriterStats()
        self._pending: list[Record] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name="adaflash-writer", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> bool:
        """Stop after flushing what the queue holds; False if the database stayed away."""
        ok = self.flush(timeout_s)
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.max_backoff_s + 1)
            self._thread = None
        return ok

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait until every accepted record is written (or the timeout passes)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.sink.queue.empty() and not self._pending:
                return True
            if self._thread is None:
                self._step()
            time.sleep(0.02)
        return self.sink.queue.empty() and not self._pending

    def _loop(self) -> None:
        backoff = 0.1
        while not self._stop.is_set():
            ok = self._step()
            if ok:
                backoff = 0.1
            else:
                self._stop.wait(backoff)
                backoff = min(backoff * 2, self.max_backoff_s)

    def _step(self) -> bool:
        if not self._pending:
            self._pending = self.sink.drain(self.batch_size, timeout=self.idle_s)
        self.stats.pending = len(self._pending)
        if not self._pending:
            return True
        try:
            n_traj, n_rounds = write_records(self.engine, self._pending)
        except SQLAlchemyError as exc:
            self.stats.write_errors += 1
            self.stats.last_error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
            log.warning(
                "buffer write failed (%d records kept for retry): %s",
                len(self._pending),
                self.stats.last_error,
            )
            return False
        self.stats.written_trajectories += n_traj
        self.stats.written_rounds += n_rounds
        self._pending = []
        self.stats.pending = 0
        return True


# -- reading the buffer (trainer side) -----------------------------------------------------------


def count_unconsumed(engine: Engine, domain: str | None = None) -> int:
    q = select(func.count()).select_from(TrajectoryRow).where(TrajectoryRow.consumed_by.is_(None))
    if domain:
        q = q.where(TrajectoryRow.domain == domain)
    with engine.connect() as conn:
        return int(conn.execute(q).scalar_one())


def _rows(engine: Engine, q: Select[TrajectoryRow]) -> list[TrajectoryRow]:
    with Session(engine, expire_on_commit=False) as s:
        return list(s.scalars(q))


def unconsumed(engine: Engine, limit: int | None = None) -> list[TrajectoryRow]:
    """Oldest unconsumed trajectories first."""
    q = select(TrajectoryRow).where(TrajectoryRow.consumed_by.is_(None)).order_by(TrajectoryRow.seq)
    return _rows(engine, q.limit(limit) if limit else q)


def recently_consumed(engine: Engine, limit: int) -> list[TrajectoryRow]:
    """The replay window: the ``limit`` latest trajectories that earlier rounds trained on,
    oldest first."""
    if limit <= 0:
        return []
    q = select(TrajectoryRow).where(TrajectoryRow.consumed_by.is_not(None))
    return _rows(engine, q.order_by(TrajectoryRow.seq.desc()).limit(limit))[::-1]


def mark_consumed(engine: Engine, seqs: list[int], run_id: int) -> int:
    """Mark exactly these trajectories as consumed by ``run_id`` (only if still unconsumed)."""
    if not seqs:
        return 0
    with engine.begin() as conn:
        res = conn.execute(
            update(TrajectoryRow)
            .where(TrajectoryRow.seq.in_(seqs), TrajectoryRow.consumed_by.is_(None))
            .values(consumed_by=run_id)
        )
        return int(getattr(res, "rowcount", 0) or 0)
