"""Runs an Engine on its own thread and streams text deltas to asyncio callers.

The engine thread is the only one that mutates engine state; callers reach it through the
engine's command queue. A caller that stops iterating (client disconnect, cancellation) aborts
its request, which frees the request's slot at the next step.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from typing import TypeVar

from adaflash.config import SamplingParams
from adaflash.engine.detokenize import TextStreamer
from adaflash.engine.engine import Engine, EngineStats
from adaflash.engine.records import RequestRecord
from adaflash.engine.request import TokenEvent
from adaflash.metrics import SpecCounters
from adaflash.models.drafter import DFlashDrafter

log = logging.getLogger(__name__)
T = TypeVar("T")


def feeder(queue: asyncio.Queue[T]) -> Callable[[T], None]:
    """A ``put`` that other threads may call: items reach ``queue`` on the calling coroutine's
    loop; once that loop is gone they are dropped (RuntimeError)."""
    loop = asyncio.get_running_loop()

    def put(item: T) -> None:
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(queue.put_nowait, item)

    return put


@dataclass(frozen=True)
class StreamDelta:
    request_id: str
    text: str  # newly released text
    token_ids: tuple[int, ...]
    kinds: tuple[str, ...]  # per token: "draft" (accepted draft) or "target" (bonus / AR)
    finished: bool
    finish_reason: str | None
    error: str | None = None
    record: RequestRecord | None = None  # on the final delta: totals of the request


class EngineRunner:
    """An Engine on its own thread: the embedded serving backend (``app.backends.Backend``)."""

    def __init__(
        self,
        engine: Engine,
        decode: Callable[[list[int]], str] | None = None,
        idle_wait_s: float = 0.05,
    ) -> None:
        self.engine = engine
        self.decode = decode or engine.detokenize
        self.idle_wait_s = idle_wait_s
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.step_errors = 0

    # -- life cycle --------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is not None:
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name="adaflash-engine", daemon=True)
        self._thread.start()

    def stop(self, drain_timeout_s: float = 0.0) -> None:
        """Stop the engine thread: let running requests finish for up to ``drain_timeout_s``,
        then abort what is left (every open stream ends with finish_reason "abort")."""
        if self._thread is None:
            return
        deadline = time.monotonic() + drain_timeout_s
        while self.engine.has_work and time.monotonic() < deadline:
            time.sleep(0.05)
        self.engine.abort_all()
        self._wake.set()
        deadline = time.monotonic() + 10.0
        while self.engine.has_work and self._thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.02)
        self._stop.set()
        self._wake.set()
        self._thread.join()
        self._thread = None

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def notify(self) -> None:
        """Wake the engine thread (after queueing a command)."""
        self._wake.set()

    # -- the engine's state, read from any thread ---------------------------------------------
    @property
    def version(self) -> str:
        return self.engine.version

    @property
    def policy(self) -> str:
        return self.engine.policy

    @property
    def gamma(self) -> float:
        return self.engine.gamma

    @property
    def block_size(self) -> int:
        return self.engine.block_size

    @property
    def max_context(self) -> int:
        return self.engine.max_context

    @property
    def counters(self) -> SpecCounters:
        return self.engine.counters

    @property
    def source_counters(self) -> dict[str, SpecCounters]:
        return self.engine.source_counters

    @property
    def stats(self) -> EngineStats:
        return self.engine.stats

    @property
    def speculative(self) -> bool:
        return self.engine.drafter is not None

    @property
    def running_count(self) -> int:
        return len(self.engine.running)

    @property
    def waiting_count(self) -> int:
        return len(self.engine.waiting)

    def cost_snapshot(self) -> dict[str, float] | None:
        return self.engine.cost.snapshot()

    def policy_check(self) -> dict[str, float] | None:
        st = self.engine.stats
        return {
            "drafting_steps_predicted_s": st.predicted_drafting_s,
            "drafting_steps_measured_s": st.measured_drafting_s,
            "plain_steps_predicted_s": st.predicted_plain_s,
            "plain_steps_measured_s": st.measured_plain_s,
            "drafting_tokens_expected": st.expected_drafting_tokens,
            "drafting_tokens_realised": st.realised_drafting_tokens,
            "probes": st.probes,
            "probe_slots_compared": st.probe_slots,
            "probe_slots_accepted": st.probe_accepted,
            "whole_steps": st.whole_steps,
            "whole_drafts_planned": st.whole_planned,
            "whole_drafts_gained": st.whole_gained,
            "queue_steps": st.queue_steps,
            "queue_drafts_planned": st.queue_planned,
            "queue_steps_gained": st.queue_gained,
        }

    def probes(self, since: float) -> list[tuple[float, int, int]]:
        log = list(self.engine.probe_log)  # one copy (a C-level call): the loop appends to it
        return [p for p in log if p[0] >= since]

    def compiled_decode(self) -> tuple[str, int]:
        graph = self.engine.target.decode_graph
        return (graph.status(), graph.steps) if graph is not None else ("off", 0)

    # -- commands (applied between two steps) ---------------------------------------------------
    def swap_drafter(self, drafter: DFlashDrafter, version: str) -> None:
        self.engine.swap_drafter(drafter, version)
        self.notify()

    def set_policy(self, policy: str | None = None, gamma: float | None = None) -> None:
        self.engine.set_policy(policy, gamma)
        self.notify()

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                worked = self.engine.step()
            except Exception as exc:  # a bug in a step must not kill serving
                log.exception("engine step failed; failing the requests in flight")
                self.step_errors += 1
                self.engine.fail_all(f"internal error: {exc}")
                worked = False
            if not worked:
                self._wake.wait(self.idle_wait_s)
                self._wake.clear()

    # -- streaming ---------------------------------------------------------------------------
    async def stream(
        self,
        prompt_ids: list[int],
        params: SamplingParams | None = None,
        *,
        domain: str | None = None,
        request_id: str | None = None,
    ) -> AsyncGenerator[StreamDelta, None]:
        """Yield text deltas as rounds commit tokens. Raises ValueError for invalid requests."""
        params = params or SamplingParams()
        events: asyncio.Queue[TokenEvent | RequestRecord] = asyncio.Queue()
        put = feeder(events)  # the request gets aborted below if the caller goes away
        rid = self.engine.add_request(
            prompt_ids, params, request_id=request_id, domain=domain, on_event=put, on_finish=put
        )
        self.notify()
        streamer = TextStreamer(self.decode, params.stop) if self.decode else None
        finished = False
        try:
            while not finished:
                ev = await events.get()
                if isinstance(ev, RequestRecord):
                    continue  # arrives after the final event, which waits for it below
                text = streamer.push(ev.token_ids, final=ev.finished) if streamer else ""
                record = None
                if ev.finished:
                    record = await self._record(events)
                    finished = True
                yield StreamDelta(
                    rid,
                    text,
                    ev.token_ids,
                    ev.kinds,
                    ev.finished,
                    ev.finish_reason,
                    ev.error,
                    record,
                )
        finally:
            if not finished:
                self.engine.abort(rid)
                self.notify()

    @staticmethod
    async def _record(events: asyncio.Queue[TokenEvent | RequestRecord]) -> RequestRecord | None:
        """The finished request's record (the engine sends it right after the final event)."""
        try:
            while True:
                item = await asyncio.wait_for(events.get(), timeout=5.0)
                if isinstance(item, RequestRecord):
                    return item
        except TimeoutError:
            return None
