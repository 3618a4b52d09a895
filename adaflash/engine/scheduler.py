"""Scheduling: who runs in a step, and admission under a verification-token budget with an
EMA of the batch size (SPEC §5).

After each step N̂ ← (1−β)·N̂ + β·N, where N is the number of requests whose verification fit in
the packed pass. The next step drafts for ⌊N̂⌋ + 1 requests (one probe above the estimate so N̂ can
grow); requests whose k̂ tokens no longer fit are returned to the front of the queue. N̂ is only
updated when the budget was the limit (something was deferred) or the estimate was exceeded —
a step with fewer ready requests than N̂ says nothing about capacity.
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from adaflash.engine.request import Request


@dataclass
class Admission:
    budget: int  # verification tokens per packed pass
    beta: float
    n_hat: float

    def how_many(self, ready: int) -> int:
        """How many ready requests to draft for this step."""
        return min(ready, int(self.n_hat) + 1)

    def pack(self, verify_lens: list[int]) -> int:
        """How many of ``verify_lens`` (in order) fit under the budget; at least one."""
        used, n = 0, 0
        for k in verify_lens:
            if n and used + k > self.budget:
                break
            used += k
            n += 1
        return n

    def update(self, processed: int, deferred: int) -> None:
        if deferred > 0 or processed > self.n_hat:
            self.n_hat = (1 - self.beta) * self.n_hat + self.beta * processed


@dataclass
class Prefill:
    req: Request
    n: int  # prompt tokens in this chunk


class Scheduler:
    """Who runs in a step: admission from the waiting queue (up to ``max_running`` requests
    hold KV slots), prompt chunks under the prefill budget, and the round-robin order in which
    ready requests are drafted for (served requests go to the back)."""

    def __init__(self, max_running: int, admission: Admission) -> None:
        self.max_running, self.admission = max_running, admission
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    def admit(self, on_admit: Callable[[Request], None]) -> None:
        """Move waiting requests in while slots are free; ``on_admit`` gives them their slots."""
        while self.waiting and len(self.running) < self.max_running:
            r = self.waiting.popleft()
            on_admit(r)
            self.running.append(r)

    def prefills(self, budget: int) -> list[Prefill]:
        """The next prompt chunk of every request still prefilling, up to ``budget`` tokens."""
        out = []
        for r in self.running:
            if r.prefill_done or budget == 0:
                continue
            n = min(len(r.prompt_ids) - r.prefilled, budget)
            out.append(Prefill(r, n))
            budget -= n
        return out

    def front(self) -> list[Request]:
        """The ready requests to draft for this step: ⌊N̂⌋ + 1 from the front."""
        ready = [r for r in self.running if r.prefill_done]
        return ready[: self.admission.how_many(len(ready))]

    def rotate(self, served: list[Request]) -> None:
        """Served requests that go on move to the back; finished ones leave."""
        done = {id(r) for r in served}
        self.running = [r for r in self.running if id(r) not in done and not r.finished] + [
            r for r in served if not r.finished
        ]

    def remove(self, r: Request) -> None:
        self.running = [x for x in self.running if x is not r]
        with contextlib.suppress(ValueError):
            self.waiting.remove(r)
