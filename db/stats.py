"""Dashboard queries over the buffer: windowed sums in SQL, rates derived in one place
(``adaflash.metrics.SpecCounters``). Windows are time ranges, never lifetime means."""

from __future__ import annotations

import time

from sqlalchemy import BigInteger, Engine, and_, case, cast, func, select

from adaflash.metrics import Bucket, SpecCounters
from db.models import RoundRow


def _counters(block: int, rounds: int, verified_slots: int, accepted: int) -> SpecCounters:
    return SpecCounters.from_totals(block, int(rounds), int(verified_slots), int(accepted))


def timeline(
    engine: Engine, window_s: float = 600, bucket_s: int = 15, now: float | None = None
) -> list[Bucket]:
    """τ, verify length and tokens/s per time bucket over the last ``window_s`` seconds."""
    now = now or time.time()
    # floor division: SQLAlchemy 2's ``/`` is true division (on SQLite it casts to REAL, and
    # every distinct timestamp became a bucket of its own: the dashboard showed 1.3 tokens/s
    # for a server making 7.9, measured). Floor division buckets alike on SQLite and Postgres
    b = cast(RoundRow.ts, BigInteger) // bucket_s
    q = (
        select(
            b.label("b"),
            func.count(),
            func.sum(RoundRow.verify_len - 1),
            func.sum(RoundRow.accepted),
            func.sum(RoundRow.emitted),
            func.max(RoundRow.block_size),
        )
        .where(RoundRow.ts >= now - window_s)
        .group_by(b)
        .order_by(b)
    )
    with engine.connect() as conn:
        rows = conn.execute(q).all()
    return [
        Bucket(
            float(r[0]) * bucket_s, _counters(r[5], r[1], r[2], r[3]), int(r[4]), float(bucket_s)
        )
        for r in rows
    ]


def slot_acceptance(
    engine: Engine, window_s: float = 600, block_size: int = 16, now: float | None = None
) -> SpecCounters:
    """Per-slot counters over the window: slot i verified when k̂ > i, accepted when i ≤ accepted."""
    now = now or time.time()
    cols = []
    for i in range(1, block_size):
        cols.append(func.sum(case((RoundRow.verify_len > i, 1), else_=0)))
        cols.append(func.sum(case((RoundRow.accepted >= i, 1), else_=0)))
    q = select(
        func.count(), func.sum(RoundRow.verify_len - 1), func.sum(RoundRow.accepted), *cols
    ).where(RoundRow.ts >= now - window_s)
    with engine.connect() as conn:
        r = conn.execute(q).one()
    c = _counters(block_size, r[0] or 0, r[1] or 0, r[2] or 0)
    c.slot_verified = [int(r[3 + 2 * i] or 0) for i in range(block_size - 1)]
    c.slot_accepted = [int(r[4 + 2 * i] or 0) for i in range(block_size - 1)]
    return c


def by_domain(
    engine: Engine, window_s: float = 600, now: float | None = None
) -> dict[str, SpecCounters]:
    now = now or time.time()
    q = (
        select(
            RoundRow.domain,
            func.count(),
            func.sum(RoundRow.verify_len - 1),
            func.sum(RoundRow.accepted),
            func.max(RoundRow.block_size),
        )
        .where(RoundRow.ts >= now - window_s)
        .group_by(RoundRow.domain)
    )
    with engine.connect() as conn:
        return {
            (r[0] or "untagged"): _counters(r[4], r[1], r[2], r[3]) for r in conn.execute(q).all()
        }


def version_starts(
    engine: Engine, window_s: float = 600, now: float | None = None
) -> list[tuple[float, str]]:
    """When each drafter version first served a round inside the window (chart markers)."""
    now = now or time.time()
    q = (
        select(func.min(RoundRow.ts), RoundRow.drafter_version)
        .where(and_(RoundRow.ts >= now - window_s))
        .group_by(RoundRow.drafter_version)
        .order_by(func.min(RoundRow.ts))
    )
    with engine.connect() as conn:
        return [(float(r[0]), str(r[1])) for r in conn.execute(q).all()]
