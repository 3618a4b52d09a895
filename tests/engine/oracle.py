"""An engine whose drafts are the target's own greedy continuation (a logic stub, not a model).

Drafts are corrupted at a fixed pseudo-random set of slots, so rounds accept long prefixes, stop
at a corrupted slot, and exercise KV truncation and bonus tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache

import torch

from adaflash.cost_model import CostModel
from adaflash.engine.engine import Engine
from adaflash.engine.round import Propose
from adaflash.models.target import PackedBatch, TargetModel

Continuation = Callable[[tuple[int, ...], int], list[int]]


def from_references(references: dict[tuple[int, ...], list[int]]) -> Continuation:
    """Continuations read from precomputed greedy sequences (prompt → prompt + continuation)."""

    def cont(prefix: tuple[int, ...], n: int) -> list[int]:
        for prompt, seq in references.items():
            if prefix[: len(prompt)] == prompt and tuple(seq[: len(prefix)]) == prefix:
                return seq[len(prefix) : len(prefix) + n]
        return []

    return cont


def greedy_continuation(target: TargetModel) -> Continuation:
    """The target's greedy continuation of any prefix, memoised (cheap when prefixes repeat)."""

    @cache
    def cont(prefix: tuple[int, ...], n: int) -> list[int]:
        cache = target.new_cache()
        slot = cache.allocate()
        ids, out = list(prefix), []
        for _ in range(n):
            logits = target(
                PackedBatch(torch.tensor(ids), (slot,), (len(ids),)), cache, logits="last"
            ).logits
            ids = [int(logits.argmax())]
            out.append(ids[0])
        return out

    return cont


class OracleEngine(Engine):
    def __init__(
        self,
        *args,
        continuation: Continuation,
        corrupt_every: int = 7,  # type: ignore[no-untyped-def]
        **kwargs,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.continuation = continuation
        self.corrupt_every = corrupt_every

    def _propose(self) -> Propose:
        def propose(reqs, states, k_hat):  # type: ignore[no-untyped-def]
            vocab = self.target.cfg.vocab_size
            width = int(k_hat.max()) - 1
            out = []
            for r in reqs:
                p = r.anchor_pos
                cont = self.continuation(tuple(r.prompt_ids + r.output_ids), width) if width else []
                row = []
                for i in range(1, width + 1):
                    tok = cont[i - 1] if i - 1 < len(cont) else 0
                    if (p * 31 + i * 17) % self.corrupt_every == 0:
                        tok = (tok + 1) % vocab
                    row.append(tok)
                out.append(row)
            return out, k_hat

        return propose


class PinnedCost(CostModel):
    """Costs fixed by the test, not timed: which requests draft depends on their acceptance
    profiles alone, so every run makes the same choices (the tiny model's real timings would
    make drafting pay on one machine and never on another)."""

    def __init__(self) -> None:
        super().__init__()
        self.target.pin([0.040, 0.0001, 0.0])  # a step's base cost dominates
        self.drafter.pin([0.004, 0.00001, 0.0])

    def observe_target(
        self,
        tokens: int,
        requests: int,
        seconds: float,
        prefill: bool = False,
        widest: int | None = None,
    ) -> None:
        pass

    def observe_drafter(self, requests: int, seconds: float, context: int = 0) -> None:
        pass

    def observe_drafting_step(self, *args: float | None, **kwargs: float | None) -> None:
        pass

    def plain_stale(self, requests: int) -> bool:
        return False  # pinned, never timed: nothing goes stale
