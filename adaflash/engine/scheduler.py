"""Admission under a verification-token budget with an EMA of the batch size (SPEC §5).

After each step N̂ ← (1−β)·N̂ + β·N, where N is the number of requests whose verification fit in
the packed pass. The next step drafts for ⌊N̂⌋ + 1 requests (one probe above the estimate so N̂ can
grow); requests whose k̂ tokens no longer fit are returned to the front of the queue. N̂ is only
updated when the budget was the limit (something was deferred) or the estimate was exceeded —
a step with fewer ready requests than N̂ says nothing about capacity.
"""

from __future__ import annotations

from dataclasses import dataclass


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
