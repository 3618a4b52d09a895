"""Every db/ test runs against real SQLite and real PostgreSQL.

PostgreSQL: ``$ADAFLASH_TEST_PG_URL`` (default: the local server, user postgres, database test).
Each test gets its own schema, dropped afterwards. An unreachable server fails the Postgres leg
loudly; set ADAFLASH_TEST_PG=0 to skip it deliberately on a machine without one.
"""

from __future__ import annotations

import os
import uuid

import pytest
from sqlalchemy import create_engine, text

from db.session import make_engine, migrate

PG_URL = os.environ.get("ADAFLASH_TEST_PG_URL", "postgresql://postgres@127.0.0.1:5432/test")


def pg_schema_url(schema: str) -> str:
    sep = "&" if "?" in PG_URL else "?"
    return f"{PG_URL}{sep}options=-csearch_path%3D{schema}"


def _pg_url():
    if os.environ.get("ADAFLASH_TEST_PG") == "0":
        pytest.skip("ADAFLASH_TEST_PG=0: PostgreSQL leg skipped on purpose")
    schema = f"t_{uuid.uuid4().hex[:12]}"
    admin = create_engine(PG_URL.replace("postgresql://", "postgresql+psycopg://"))
    try:
        with admin.begin() as conn:
            conn.execute(text(f'CREATE SCHEMA "{schema}"'))
    except Exception as exc:
        pytest.fail(
            f"PostgreSQL at {PG_URL} is not reachable ({exc}); start it or set "
            "ADAFLASH_TEST_PG=0 to skip the Postgres leg"
        )
    yield pg_schema_url(schema)
    with admin.begin() as conn:
        conn.execute(text(f'DROP SCHEMA "{schema}" CASCADE'))
    admin.dispose()


@pytest.fixture(params=["sqlite", "postgres"])
def db_url(request, tmp_path):
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'buffer.db'}"
    else:
        yield from _pg_url()


@pytest.fixture
def pg_url():
    yield from _pg_url()


def migrated(url: str):
    engine = make_engine(url)
    migrate(engine)
    return engine


@pytest.fixture
def db(db_url):
    engine = migrated(db_url)
    yield engine
    engine.dispose()
