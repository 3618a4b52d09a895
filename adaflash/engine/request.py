"""A request's state inside the engine."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from adaflash.config import SamplingParams
from adaflash.engine.records import RequestRecord
from adaflash.engine.suffix import SuffixIndex
from adaflash.models.kv_cache import Rows

ONE_COPY_MIN = 6  # FeatureStore: one step's rows of fewer slots are written one slot at a time
# FeatureStore.append_many holds steps' rows back until this many are waiting, or until they are
# read, and writes them all in one copy (one copy a step of 16 rows took ~0.45 ms, under
# cProfile, of a ~35 ms compiled batch-16 step on a Zen 4 EPYC where nobody drafted and read them)
DEFER_ROWS = 512
# FeatureStore.reserve: address space a feature pool may take up front; it is never cleared, so
# only the pages written are ever backed. (Doubling from 256 positions took 0.8% of a 128-token
# run at 16 requests, Zen 5, ``bench/profile_study.py``, mostly faulting in fresh pages, which
# the first writes into a reserved pool still do: what it saves is the copy, ~0.1–0.3%.)
RESERVE_BYTES = 1 << 30


class FeatureStore:
    """The target features of every request's committed positions (the drafter context), in one
    pool (rows, capacity, K·H) that grows by doubling and is never freed per request (see
    ``models/kv_cache.py`` for why). Kept raw, before the drafter's ``fc``, so the drafter
    context can be rebuilt after a hot swap. ``length`` counts the rows appended; those of
    ``append_many`` are written when read (``view``), when a slot is freed, or once
    ``DEFER_ROWS`` are waiting (``flush``)."""

    @classmethod
    def reserve(cls, width: int, dtype: torch.dtype, rows: int, positions: int) -> FeatureStore:
        """A pool with room for ``positions`` per row from the start (``RESERVE_BYTES`` at
        most; beyond that it grows as before): a request never waits for a copy of the pool."""
        per_position = rows * width * dtype.itemsize
        capacity = max(min(positions, RESERVE_BYTES // per_position), 256)
        return cls(width, dtype, capacity=capacity, rows=rows)

    def __init__(self, width: int, dtype: torch.dtype, capacity: int = 256, rows: int = 4) -> None:
        # never read past a slot's length, so never cleared: a cleared pool touched every page
        # of it as it grew (16 requests' growth to 512 positions: ~40 ms of a 4.4 s run)
        self.data = torch.empty(rows, capacity, width, dtype=dtype)
        self.rows = Rows()
        self.length: dict[int, int] = {}
        # steps' rows not yet written: (the step's rows, [(slot, position, first row, n)])
        self.deferred: list[tuple[torch.Tensor, list[tuple[int, int, int, int]]]] = []
        self.deferred_rows = 0

    @torch.inference_mode()
    def allocate(self) -> int:
        if len(self.rows) == self.data.shape[0]:
            self._resize(2 * len(self.rows), self.data.shape[1])
        slot, _ = self.rows.add()
        self.length[slot] = 0
        return slot

    @torch.inference_mode()
    def free(self, slot: int) -> None:
        if slot not in self.rows.row:
            return
        self.flush()  # rows move below: what is waiting is written where it belongs first
        moved = self.rows.remove(slot)
        self.length.pop(slot)
        if moved is not None:
            other, src, dst = moved
            n = self.length[other]
            self.data[dst, :n] = self.data[src, :n]

    @torch.inference_mode()
    def append(self, slot: int, rows: torch.Tensor) -> None:
        """rows (n, K·H) after the slot's committed features, written now."""
        start, n = self.length[slot], rows.shape[0]
        self._fit(start + n)
        self.data[self.rows.row[slot], start : start + n] = rows
        self.length[slot] = start + n

    def append_many(self, parts: list[tuple[int, int, int]], src: torch.Tensor) -> None:
        """Several slots' rows of one step: ``parts`` (slot, first row of ``src``, n), each
        slot once; held back with the steps before (``flush``). Raises before recording any
        of them (an unknown slot, a failed copy of those waiting): the caller may append
        them one at a time instead."""
        n_rows = sum(n for *_, n in parts)
        if self.deferred_rows + n_rows >= DEFER_ROWS:
            self.flush()
        placed = [(slot, self.length[slot], first, n) for slot, first, n in parts]
        for slot, _, _, n in placed:
            self.length[slot] += n
        self.deferred.append((src, placed))
        self.deferred_rows += n_rows

    @torch.inference_mode()
    def flush(self) -> None:
        """Write the rows ``append_many`` held back, in one copy (slot by slot where one step
        of fewer than ``ONE_COPY_MIN`` slots waits: a /tmp micro-benchmark, one thread beside a
        test run, took 193–222 µs for 16 one-row appends one at a time and 118–134 µs in one
        copy, but 59–60 against 69 µs for 4). Should it fail, they keep waiting."""
        if not self.deferred:
            return
        self._fit(max(pos + n for _, placed in self.deferred for _, pos, _, n in placed))
        if len(self.deferred) == 1 and len(self.deferred[0][1]) < ONE_COPY_MIN:
            src, placed = self.deferred[0]
            for slot, pos, first, n in placed:
                self.data[self.rows.row[slot], pos : pos + n] = src[first : first + n]
        else:
            rows: list[int] = []
            positions: list[int] = []
            take: list[int] = []
            offset = 0
            for src, placed in self.deferred:
                for slot, pos, first, n in placed:
                    rows += [self.rows.row[slot]] * n
                    positions += range(pos, pos + n)
                    take += range(offset + first, offset + first + n)
                offset += src.shape[0]
            srcs = [src for src, _ in self.deferred]
            joined = torch.cat(srcs) if len(srcs) > 1 else srcs[0]
            self.data[torch.tensor(rows), torch.tensor(positions)] = joined[torch.tensor(take)]
        self.deferred, self.deferred_rows = [], 0

    def view(self, slot: int, start: int = 0) -> torch.Tensor:
        """(n, K·H) features of positions start … committed − 1."""
        self.flush()
        return self.data[self.rows.row[slot], start : self.length[slot]]

    def _fit(self, positions: int) -> None:
        """Room for ``positions`` per row: the capacity doubles (at least) when it is short."""
        if positions > self.data.shape[1]:
            self._resize(self.data.shape[0], max(positions, 2 * self.data.shape[1]))

    @torch.inference_mode()
    def _resize(self, rows: int, capacity: int) -> None:
        grown = torch.empty(rows, capacity, self.data.shape[2], dtype=self.data.dtype)
        used = len(self.rows)
        # rows still held back may reach past the old capacity: they are written after this
        longest = min(max(self.length.values(), default=0), self.data.shape[1])
        grown[:used, :longest] = self.data[:used, :longest]
        self.data = grown


@dataclass(frozen=True)
class TokenEvent:
    """Tokens committed for one request in one step (what streams to the caller)."""

    request_id: str
    token_ids: tuple[int, ...]
    kinds: tuple[str, ...]  # per token: "draft" (accepted draft) or "target" (target's own)
    finished: bool = False
    finish_reason: str | None = None
    error: str | None = None


EventCallback = Callable[[TokenEvent], None]
FinishCallback = Callable[[RequestRecord], None]


@dataclass(eq=False)
class Request:
    id: str
    prompt_ids: list[int]
    params: SamplingParams
    domain: str | None = None
    on_event: EventCallback | None = None
    on_finish: FinishCallback | None = None
    created_at: float = field(default_factory=time.time)

    # engine state
    slot: int = -1  # target KV-cache slot
    draft_slot: int = -1  # drafter context KV slot
    prefilled: int = 0  # prompt tokens already in the target cache
    output_ids: list[int] = field(default_factory=list)
    features: int | None = None  # slot in the engine's FeatureStore (None: no drafter)
    ctx_version: str | None = None  # drafter version whose context KV is in draft_slot
    ctx_len: int = 0  # feature rows already projected into draft_slot
    generator: torch.Generator | None = None
    finish_reason: str | None = None
    rounds: int = 0
    accepted: int = 0
    verified: int = 0  # drafts sent to the target, Σ(k̂ − 1)
    slot_seen: list[float] = field(default_factory=list)  # decayed: slot i verified …
    slot_ok: list[float] = field(default_factory=list)  # … and accepted (its profile)
    last_drafted: int = 0  # ``rounds`` when it last had drafts verified
    probe_gap: int = 0  # rounds between probes of the cost policy (0: its default)
    # a probe's shadow draft awaiting its answer: (index in output_ids of the token its first
    # draft stands for, the drafts); see policy.shadow_progress
    shadow: tuple[int, list[int]] | None = None
    shadow_seen: int = 0  # its slots already observed (``Policy.observe_shadow``)
    # the cost policy's survival for it, as of one state of that policy's profiles:
    # (that state's number, the survival per slot, its Σ); see CostPolicy.survival
    survival: tuple[int, list[float], float] | None = None
    # suffix drafting (``engine/suffix.py``): the request's own n-gram index, and its latest
    # proposal awaiting the tokens that decide it: (index in output_ids of the token its first
    # draft stands for, the drafts, their match length, slots already counted)
    suffix: SuffixIndex | None = None
    suffix_shadow: tuple[int, tuple[int, ...], int, int] | None = None
    draft_ms: float = 0.0  # time of the drafter passes it was in (shared with its batch)
    verify_ms: float = 0.0  # time of the target passes that verified it
    drafter_version: str = ""
    stop_text: str | None = None  # decoded text when stop strings are in use

    def __post_init__(self) -> None:
        assert self.prompt_ids, "a request needs at least one prompt token"
        if self.params.seed is not None:
            self.generator = torch.Generator().manual_seed(self.params.seed)

    @property
    def prefill_done(self) -> bool:
        return self.prefilled == len(self.prompt_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def anchor(self) -> int:
        """The last committed token, whose target hidden state is not yet known."""
        return self.output_ids[-1]

    @property
    def anchor_pos(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids) - 1

    @property
    def tokens_left(self) -> int:
        return self.params.max_new_tokens - len(self.output_ids)


def check_request(
    prompt_ids: list[int],
    params: SamplingParams,
    vocab_size: int,
    max_context: int,
    can_detokenize: bool,
) -> None:
    """The checks every backend runs before a request is queued; ValueError says why."""
    if not prompt_ids:
        raise ValueError("the prompt is empty")
    if any(not 0 <= t < vocab_size for t in prompt_ids):
        raise ValueError(f"prompt token ids must be in [0, {vocab_size})")
    if len(prompt_ids) + params.max_new_tokens > max_context:
        raise ValueError(
            f"prompt ({len(prompt_ids)} tokens) + max_new_tokens ({params.max_new_tokens}) "
            f"exceeds the context window of {max_context} tokens"
        )
    if params.stop and not can_detokenize:
        raise ValueError("stop strings need a tokenizer; this engine has none")
