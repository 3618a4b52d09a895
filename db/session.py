"""Connecting to the buffer database and migrating it to the current schema."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from alembic import command
from alembic.config import Config
from sqlalchemy import Engine, create_engine, event

MIGRATIONS = Path(__file__).resolve().parent / "migrations"


def data_dir() -> Path:
    """Where the default SQLite file and the weight versions live (``$ADAFLASH_DATA``, else
    ``./data``)."""
    return Path(os.environ.get("ADAFLASH_DATA", "data")).resolve()


def default_url() -> str:
    return f"sqlite:///{data_dir() / 'adaflash.db'}"


def make_engine(url: str | None = None, sqlite_busy_timeout_s: float = 30.0) -> Engine:
    """A SQLAlchemy engine; SQLite gets WAL, a busy timeout and foreign keys."""
    url = url or default_url()
    if url.startswith("sqlite:///"):
        Path(url.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
        engine = create_engine(url, connect_args={"timeout": sqlite_busy_timeout_s})

        @event.listens_for(engine, "connect")
        def _pragmas(dbapi_conn: Any, _record: Any) -> None:
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA synchronous=NORMAL")
            cur.execute("PRAGMA foreign_keys=ON")
            cur.close()

        return engine
    if url.startswith("postgresql://"):
        url = "postgresql+psycopg://" + url.removeprefix("postgresql://")
    return create_engine(url, pool_pre_ping=True, pool_size=5, max_overflow=5)


def migrate(engine: Engine) -> None:
    """Bring the schema to the newest revision (idempotent)."""
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    with engine.begin() as conn:
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, "head")
