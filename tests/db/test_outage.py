"""The database going away and coming back loses no acknowledged record and duplicates none."""

import sqlite3
import time

from sqlalchemy import func, select

from adaflash.engine.records import QueueSink
from db.buffer import BufferWriter
from db.models import RoundRow, TrajectoryRow
from db.session import make_engine
from tests.db.conftest import PG_URL, migrated
from tests.db.proxy import Proxy
from tests.db.test_buffer import req, rnd


def stored(engine) -> tuple[set[str], int]:
    with engine.connect() as c:
        ids = set(c.execute(select(TrajectoryRow.request_id)).scalars())
        return ids, c.execute(select(func.count()).select_from(RoundRow)).scalar_one()


def run_outage(writer_engine, check_engine, go_down, come_back) -> None:
    sink = QueueSink(maxsize=50)
    writer = BufferWriter(writer_engine, sink, batch_size=8, idle_s=0.05, max_backoff_s=0.5)
    writer.start()
    acked = {f"r{i}" for i in range(5) if sink.offer(req(i))}
    assert writer.flush(10)
    go_down()
    for i in range(5, 40):  # served while the database is away
        if sink.offer(req(i)):
            acked.add(f"r{i}")
        sink.offer(rnd(i, 0))
    time.sleep(1.5)
    assert writer.stats.write_errors > 0 and writer.stats.last_error
    come_back()
    assert writer.stop(timeout_s=30)
    ids, n_rounds = stored(check_engine)
    assert acked <= ids and len(ids) == len(acked)  # nothing acknowledged lost, nothing extra
    assert sink.dropped + len(acked) + n_rounds == sink.offered  # every offer accounted for


def test_postgres_outage_through_a_cut_connection(pg_url):
    db = migrated(pg_url)
    host_port = PG_URL.split("@")[1].split("/")[0]
    host, port = host_port.split(":")
    proxy = Proxy((host, int(port)))
    proxy.start()
    writer_engine = make_engine(pg_url.replace(host_port, f"127.0.0.1:{proxy.port}"))
    run_outage(writer_engine, db, proxy.stop, proxy.start)
    writer_engine.dispose()
    proxy.stop()
    db.dispose()


def test_sqlite_outage_through_a_held_lock(tmp_path):
    url = f"sqlite:///{tmp_path / 'buffer.db'}"
    db = migrated(url)
    path = url.removeprefix("sqlite:///")
    writer_engine = make_engine(url, sqlite_busy_timeout_s=0.1)
    blocker = sqlite3.connect(path, isolation_level=None, timeout=0.1)

    def go_down() -> None:
        blocker.execute("BEGIN EXCLUSIVE")  # every other writer now gets "database is locked"

    def come_back() -> None:
        blocker.execute("COMMIT")

    run_outage(writer_engine, db, go_down, come_back)
    blocker.close()
    writer_engine.dispose()
    db.dispose()
