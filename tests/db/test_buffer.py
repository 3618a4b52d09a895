import time

from sqlalchemy import func, inspect, select

from adaflash.engine.records import QueueSink, RequestRecord, RoundRecord
from db.buffer import BufferWriter, count_unconsumed, mark_consumed, unconsumed, write_records
from db.models import RoundRow, TrajectoryRow
from db.session import make_engine, migrate


def req(i: int, reason: str = "stop", domain: str = "chat") -> RequestRecord:
    now = time.time()
    return RequestRecord(
        f"r{i}",
        (1, 2, 3),
        (4, 5, i),
        f"text {i}",
        reason,
        "v0000",
        domain,
        0.0,
        2,
        1,
        3,
        now - 1,
        now,
    )


def rnd(i: int, k: int) -> RoundRecord:
    return RoundRecord(
        f"r{i}", k, "v0000", "head", 16, 5, 2, 3, 0.3, 4, 10.0, 40.0, time.time(), "chat"
    )


def counts(engine) -> tuple[int, int]:
    with engine.connect() as c:
        return (
            c.execute(select(func.count()).select_from(TrajectoryRow)).scalar_one(),
            c.execute(select(func.count()).select_from(RoundRow)).scalar_one(),
        )


def test_migration_creates_tables_and_is_idempotent(db):
    names = set(inspect(db).get_table_names())
    assert {"trajectories", "round_stats", "weight_versions", "training_runs"} <= names
    migrate(db)  # second run: nothing to do, no error


def test_sqlite_default_runs_in_wal_mode(tmp_path):
    engine = make_engine(f"sqlite:///{tmp_path / 'x.db'}")
    with engine.connect() as c:
        assert c.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"


def test_writer_persists_and_retries_never_duplicate(db):
    records = [req(i) for i in range(5)] + [rnd(i, k) for i in range(5) for k in range(3)]
    assert write_records(db, records) == (5, 15)
    write_records(db, records)  # a retried batch
    assert counts(db) == (5, 15)


def test_aborted_or_empty_requests_are_not_trajectories(db):
    write_records(db, [req(1, "abort"), req(2, "error"), req(3, "length")])
    assert counts(db) == (1, 0)


def test_writer_thread_drains_the_queue(db):
    sink = QueueSink(maxsize=1000)
    writer = BufferWriter(db, sink, batch_size=7)
    writer.start()
    for i in range(20):
        assert sink.offer(req(i))
        sink.offer(rnd(i, 0))
    assert writer.stop(timeout_s=20)
    assert counts(db) == (20, 20)
    assert writer.stats.written_trajectories == 20 and writer.stats.write_errors == 0


def test_full_queue_drops_and_counts_without_blocking():
    sink = QueueSink(maxsize=3)
    t0 = time.perf_counter()
    results = [sink.offer(req(i)) for i in range(10)]
    assert time.perf_counter() - t0 < 0.5
    assert results.count(True) == 3 and sink.dropped == 7 and sink.offered == 10


def test_consumption_marks_exactly_the_given_rows(db):
    write_records(db, [req(i) for i in range(6)])
    rows = unconsumed(db)
    assert [r.request_id for r in rows] == [f"r{i}" for i in range(6)]  # oldest first
    from db.runs import claim_run

    run = claim_run(db, "manual")
    assert mark_consumed(db, [rows[0].seq, rows[2].seq], run) == 2
    assert mark_consumed(db, [rows[0].seq], run) == 0  # already consumed
    assert count_unconsumed(db) == 4
    assert [r.request_id for r in unconsumed(db, limit=2)] == ["r1", "r3"]
