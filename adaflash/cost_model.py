"""What a step costs on this machine, now: online estimates the cost-aware policy plans with.

    target pass   t ≈ a + b·tokens + c·requests    (verified + prefilled tokens; sequences in it)
    drafter pass  t ≈ d + e·requests + f·context   (context: target positions committed since a
                                                    request last drafted, projected in this pass)

Each is a linear model fitted by recursive least squares with exponential forgetting (λ), fed by
every real step, so it follows the machine as it is: another process sharing the cores, a
different thread count, a longer context. Nothing is hard-coded beyond a weak starting guess that
the first steps overwrite.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


class RecursiveLeastSquares:
    """y ≈ θ·x, updated one observation at a time; old observations fade with λ per update."""

    def __init__(self, prior: list[float], forget: float = 0.97, confidence: float = 10.0) -> None:
        self.theta = torch.tensor(prior, dtype=torch.float64)
        self.p = torch.eye(len(prior), dtype=torch.float64) * confidence
        self.forget = forget
        self.seen = 0

    def predict(self, x: list[float]) -> float:
        return float(self.theta @ torch.tensor(x, dtype=torch.float64))

    def update(self, x: list[float], y: float) -> None:
        xv = torch.tensor(x, dtype=torch.float64)
        px = self.p @ xv
        gain = px / (self.forget + xv @ px)
        self.theta = self.theta + gain * (y - self.theta @ xv)
        self.p = (self.p - torch.outer(gain, px)) / self.forget
        self.seen += 1


@dataclass
class CostModel:
    """Seconds per target pass and per drafter pass, learned from the engine's own steps."""

    # starting guesses (seconds): replaced within a few steps by what this machine measures
    target: RecursiveLeastSquares = field(
        default_factory=lambda: RecursiveLeastSquares([0.05, 0.002, 0.002])
    )
    drafter: RecursiveLeastSquares = field(
        default_factory=lambda: RecursiveLeastSquares([0.01, 0.002, 0.0001])
    )

    def observe_target(self, tokens: int, requests: int, seconds: float) -> None:
        self.target.update([1.0, float(tokens), float(requests)], seconds)

    def observe_drafter(self, requests: int, seconds: float, context: int = 0) -> None:
        self.drafter.update([1.0, float(requests), float(context)], seconds)

    def target_s(self, tokens: int, requests: int) -> float:
        """Predicted seconds of a target pass (never below a microsecond)."""
        return max(self.target.predict([1.0, float(tokens), float(requests)]), 1e-6)

    def drafter_s(self, requests: int, context: int = 0) -> float:
        """Predicted seconds of a drafter pass for ``requests`` that bring ``context`` new
        context positions to project (0 requests: no pass, no cost)."""
        if requests == 0:
            return 0.0
        return max(self.drafter.predict([1.0, float(requests), float(context)]), 1e-6)

    def snapshot(self) -> dict[str, float]:
        """The current estimates, for /metrics and the dashboard."""
        a, b, c = self.target.theta.tolist()
        d, e, f = self.drafter.theta.tolist()
        return {
            "target_base_ms": 1e3 * a,
            "target_per_token_ms": 1e3 * b,
            "target_per_request_ms": 1e3 * c,
            "drafter_base_ms": 1e3 * d,
            "drafter_per_request_ms": 1e3 * e,
            "drafter_per_context_token_ms": 1e3 * f,
            "target_steps_seen": float(self.target.seen),
            "drafter_steps_seen": float(self.drafter.seen),
        }
