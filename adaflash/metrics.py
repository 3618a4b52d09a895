"""Speculative-decoding metrics, defined once (SPEC §1; same names as SGLang/vLLM).

Only raw counters are stored, with one mutator (``add_round``). Every rate is derived here:

- accept_len τ       = (accepted + rounds) / rounds      tokens committed per round, bonus included
- verify_len         = (verified + rounds) / rounds      positions the target scored per round
- acceptance_rate    = accepted / verified               accepted drafts per verified draft
- slot acceptance[i] = slot_accepted[i] / slot_verified[i]   P(slot i accepted | slot i verified)

A window is the difference of two snapshots (``later - earlier``), never a lifetime mean.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field


@dataclass
class SpecCounters:
    block_size: int
    rounds: int = 0
    drafted: int = 0  # draft tokens proposed by the drafter (k − 1 per speculative round)
    verified: int = 0  # draft tokens sent to the target (k̂ − 1 per round)
    accepted: int = 0  # draft tokens accepted
    slot_verified: list[int] = field(default_factory=list)  # index i − 1 for draft slot i
    slot_accepted: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        n = self.block_size - 1
        self.slot_verified = self.slot_verified or [0] * n
        self.slot_accepted = self.slot_accepted or [0] * n
        assert len(self.slot_verified) == len(self.slot_accepted) == n

    def add_round(self, verify_len: int, accepted: int, drafted: int) -> None:
        """Count one round of one request: the target scored ``verify_len`` slots (anchor
        included) and accepted ``accepted`` drafts (slots 1 … accepted)."""
        assert 1 <= verify_len <= self.block_size and 0 <= accepted < verify_len
        self.rounds += 1
        self.drafted += drafted
        self.verified += verify_len - 1
        self.accepted += accepted
        for i in range(verify_len - 1):
            self.slot_verified[i] += 1
            self.slot_accepted[i] += int(i < accepted)

    # -- derived ---------------------------------------------------------------------------------
    @property
    def accept_len(self) -> float:
        return (self.accepted + self.rounds) / self.rounds if self.rounds else 0.0

    @property
    def verify_len(self) -> float:
        return (self.verified + self.rounds) / self.rounds if self.rounds else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.verified if self.verified else 0.0

    @property
    def slot_acceptance(self) -> list[float | None]:
        return [
            a / v if v else None
            for a, v in zip(self.slot_accepted, self.slot_verified, strict=True)
        ]

    @classmethod
    def from_totals(
        cls, block_size: int, rounds: int, verified: int, accepted: int, drafted: int = 0
    ) -> SpecCounters:
        """Counters of one request from its totals (per-slot detail left empty)."""
        return cls(block_size, rounds, drafted, verified, accepted)

    def copy(self) -> SpecCounters:
        return SpecCounters(
            self.block_size,
            self.rounds,
            self.drafted,
            self.verified,
            self.accepted,
            list(self.slot_verified),
            list(self.slot_accepted),
        )

    def __sub__(self, earlier: SpecCounters) -> SpecCounters:
        """The window between two snapshots."""
        return SpecCounters(
            self.block_size,
            self.rounds - earlier.rounds,
            self.drafted - earlier.drafted,
            self.verified - earlier.verified,
            self.accepted - earlier.accepted,
            [a - b for a, b in zip(self.slot_verified, earlier.slot_verified, strict=True)],
            [a - b for a, b in zip(self.slot_accepted, earlier.slot_accepted, strict=True)],
        )

    def __add__(self, other: SpecCounters) -> SpecCounters:
        return SpecCounters(
            self.block_size,
            self.rounds + other.rounds,
            self.drafted + other.drafted,
            self.verified + other.verified,
            self.accepted + other.accepted,
            [a + b for a, b in zip(self.slot_verified, other.slot_verified, strict=True)],
            [a + b for a, b in zip(self.slot_accepted, other.slot_accepted, strict=True)],
        )

    def summary(self) -> dict[str, float | int | list[float | None]]:
        return {
            "rounds": self.rounds,
            "accept_len": round(self.accept_len, 4),
            "verify_len": round(self.verify_len, 4),
            "acceptance_rate": round(self.acceptance_rate, 4),
            "slot_acceptance": [None if x is None else round(x, 4) for x in self.slot_acceptance],
        }


def speedup(method_tokens_per_s: float, ar_tokens_per_s: float) -> float:
    """Output tokens/s of a method ÷ that of plain AR decoding, measured in the same run."""
    return method_tokens_per_s / ar_tokens_per_s if ar_tokens_per_s else 0.0


@dataclass(frozen=True)
class Bucket:
    """One time bucket of a windowed chart: the rounds that ended in it."""

    start: float  # unix seconds
    counters: SpecCounters
    tokens: int  # tokens emitted by rounds in the bucket
    seconds: float

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


def probe_buckets(
    probes: Iterable[tuple[float, int, int]], block_size: int, bucket_s: int
) -> list[Bucket]:
    """Answered probes (unix time, draft slots compared, accepted) per time bucket, each counted
    as the round it stands for — its whole shadow block verified — so a bucket's ``accept_len``
    is the τ the drafter would have reached verifying whole blocks, drafting or not."""
    sums: dict[int, list[int]] = {}
    for ts, compared, accepted in probes:
        n = sums.setdefault(int(ts) // bucket_s, [0, 0, 0])
        n[0], n[1], n[2] = n[0] + 1, n[1] + compared, n[2] + accepted
    return [
        Bucket(float(b * bucket_s), SpecCounters.from_totals(block_size, *n), 0, float(bucket_s))
        for b, n in sorted(sums.items())
    ]
