"""What the engine hands to the outside world: per-round records, finished-request trajectories,
and the non-blocking sinks that receive them (STYLE §6: the hot path never waits on I/O)."""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass, field
from typing import Protocol


@dataclass(frozen=True)
class RoundRecord:
    """One speculative round of one request."""

    request_id: str
    round_index: int  # 0, 1, … per request
    drafter_version: str
    policy: str
    block_size: int
    verify_len: int  # k̂: slots the target scored, anchor included
    accepted: int  # drafts accepted (slots 1 … accepted)
    emitted: int  # tokens released to the user (≤ accepted + 1 after stop truncation)
    a_hat: float | None  # length-head prediction, when the head ran
    batch_size: int  # requests verified in the same packed pass
    draft_ms: float  # the step's drafter time (shared by its batch)
    verify_ms: float  # the step's target time (shared by its batch)
    timestamp: float
    domain: str | None = None

    @property
    def accept_len(self) -> int:
        return self.accepted + 1

    @property
    def slot_outcomes(self) -> tuple[bool, ...]:
        """Per verified draft slot 1 … k̂−1: accepted or not."""
        return tuple(i < self.accepted for i in range(self.verify_len - 1))


@dataclass(frozen=True)
class RequestRecord:
    """A finished request: the on-policy trajectory the trainer learns from."""

    request_id: str
    prompt_ids: tuple[int, ...]
    output_ids: tuple[int, ...]
    output_text: str | None
    finish_reason: str
    drafter_version: str
    domain: str | None
    temperature: float
    rounds: int
    accepted: int
    verified: int
    created_at: float
    finished_at: float
    meta: dict[str, str] = field(default_factory=dict)
    # wall time of the drafter / target passes this request took part in (None: not reported)
    draft_ms: float | None = 0.0
    verify_ms: float | None = 0.0


Record = RoundRecord | RequestRecord


class RecordSink(Protocol):
    def offer(self, record: Record) -> bool:
        """Take a record without blocking; False when it was dropped."""
        ...


class NullSink:
    def offer(self, record: Record) -> bool:
        return True


class MemorySink:
    """Keeps everything in a list (tests and benchmarks)."""

    def __init__(self) -> None:
        self.records: list[Record] = []
        self._lock = threading.Lock()

    def offer(self, record: Record) -> bool:
        with self._lock:
            self.records.append(record)
        return True

    def rounds(self) -> list[RoundRecord]:
        with self._lock:
            return [r for r in self.records if isinstance(r, RoundRecord)]

    def requests(self) -> list[RequestRecord]:
        with self._lock:
            return [r for r in self.records if isinstance(r, RequestRecord)]


class QueueSink:
    """A bounded queue drained by one writer; a full queue drops and counts, never blocks."""

    def __init__(self, maxsize: int = 10_000) -> None:
        self.queue: queue.Queue[Record] = queue.Queue(maxsize)
        self.dropped = 0
        self.offered = 0

    def offer(self, record: Record) -> bool:
        self.offered += 1
        try:
            self.queue.put_nowait(record)
        except queue.Full:
            self.dropped += 1
            return False
        return True

    def drain(self, max_items: int, timeout: float = 0.0) -> list[Record]:
        """Up to ``max_items`` records; waits at most ``timeout`` s for the first one."""
        out: list[Record] = []
        try:
            out.append(self.queue.get(timeout=timeout) if timeout > 0 else self.queue.get_nowait())
        except queue.Empty:
            return out
        while len(out) < max_items:
            try:
                out.append(self.queue.get_nowait())
            except queue.Empty:
                break
        return out
