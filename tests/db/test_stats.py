"""Dashboard queries on a real database (SQLite and PostgreSQL)."""

from __future__ import annotations

from adaflash.engine.records import RoundRecord
from db import stats
from db.buffer import write_records


def round_at(i: int, ts: float, accepted: int, emitted: int) -> RoundRecord:
    return RoundRecord(
        f"r{i}", i, "v0000", "head", 16, accepted + 2, accepted, emitted, 0.3, 1, 1.0, 2.0, ts
    )


def test_timeline_groups_rounds_into_whole_buckets(db):
    now = 1_800_000_000.0 - 1.0  # the last second of a 15 s bucket
    start = now - 29  # two whole buckets: [now − 29, now − 15] and [now − 14, now]
    rows = [round_at(i, start + i, accepted=i % 3, emitted=i % 3 + 1) for i in range(30)]
    write_records(db, rows)
    buckets = stats.timeline(db, window_s=60, bucket_s=15, now=now)
    assert [b.start for b in buckets] == [now - 29, now - 14]
    assert [b.counters.rounds for b in buckets] == [15, 15]
    assert sum(b.tokens for b in buckets) == sum(r.emitted for r in rows)
    # tokens per wall-second of the buckets: 60 tokens over 30 s
    assert sum(b.tokens for b in buckets) / sum(b.seconds for b in buckets) == 2.0
    first = buckets[0].counters
    assert first.accept_len == (sum(i % 3 for i in range(15)) + 15) / 15
