"""SQLAlchemy 2 typed models. Migrations in db/migrations mirror these tables."""

from __future__ import annotations

from datetime import datetime
from typing import Any, ClassVar

from sqlalchemy import JSON, DateTime, Float, ForeignKey, Integer, String, Text, UniqueConstraint
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column


class Base(DeclarativeBase):
    type_annotation_map: ClassVar[dict[Any, Any]] = {
        dict[str, Any]: JSON,
        list[int]: JSON,
        list[dict[str, Any]]: JSON,
    }


class TrajectoryRow(Base):
    """A finished request: prompt and response, the on-policy data the trainer consumes."""

    __tablename__ = "trajectories"

    seq: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    request_id: Mapped[str] = mapped_column(String(96), unique=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    finished_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), index=True)
    domain: Mapped[str | None] = mapped_column(String(32), index=True)
    drafter_version: Mapped[str] = mapped_column(String(64))
    prompt_ids: Mapped[list[int]]
    response_ids: Mapped[list[int]]
    response_text: Mapped[str | None] = mapped_column(Text)
    finish_reason: Mapped[str] = mapped_column(String(16))
    temperature: Mapped[float] = mapped_column(Float)
    rounds: Mapped[int] = mapped_column(Integer)
    accepted: Mapped[int] = mapped_column(Integer)
    consumed_by: Mapped[int | None] = mapped_column(
        ForeignKey("training_runs.id", ondelete="SET NULL"), index=True
    )


class RoundRow(Base):
    """One speculative round of one request (enough to chart τ, verify length, per-slot
    acceptance and throughput by version and domain)."""

    __tablename__ = "round_stats"
    __table_args__ = (UniqueConstraint("request_id", "round_index", name="uq_round"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    request_id: Mapped[str] = mapped_column(String(96))
    round_index: Mapped[int] = mapped_column(Integer)
    ts: Mapped[float] = mapped_column(Float, index=True)  # unix seconds
    drafter_version: Mapped[str] = mapped_column(String(64), index=True)
    policy: Mapped[str] = mapped_column(String(8))
    domain: Mapped[str | None] = mapped_column(String(32))
    block_size: Mapped[int] = mapped_column(Integer)
    verify_len: Mapped[int] = mapped_column(Integer)
    accepted: Mapped[int] = mapped_column(Integer)
    emitted: Mapped[int] = mapped_column(Integer)
    a_hat: Mapped[float | None] = mapped_column(Float)
    batch_size: Mapped[int] = mapped_column(Integer)
    draft_ms: Mapped[float] = mapped_column(Float)
    verify_ms: Mapped[float] = mapped_column(Float)


class WeightVersionRow(Base):
    """An immutable drafter + head version on disk, and what became of it."""

    __tablename__ = "weight_versions"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    parent: Mapped[str | None] = mapped_column(String(64))
    path: Mapped[str] = mapped_column(Text)
    sha256: Mapped[str] = mapped_column(String(64))
    status: Mapped[str] = mapped_column(String(16), index=True)  # candidate/active/retired/rejected
    loss: Mapped[str | None] = mapped_column(String(8))
    data_from: Mapped[int | None] = mapped_column(Integer)  # trajectory seq range trained on
    data_to: Mapped[int | None] = mapped_column(Integer)
    samples: Mapped[int] = mapped_column(Integer, default=0)
    metrics: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    reason: Mapped[str | None] = mapped_column(Text)
    promoted_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))


class TrainingRunRow(Base):
    """One training job: requested (by an admin), running, succeeded or failed."""

    __tablename__ = "training_runs"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    trigger: Mapped[str] = mapped_column(String(16))  # threshold / interval / admin / manual
    status: Mapped[str] = mapped_column(String(16), index=True)
    requested_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    started_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    loss: Mapped[str | None] = mapped_column(String(8))
    samples: Mapped[int] = mapped_column(Integer, default=0)
    steps: Mapped[int] = mapped_column(Integer, default=0)
    seconds: Mapped[float | None] = mapped_column(Float)
    history: Mapped[list[dict[str, Any]]] = mapped_column(JSON, default=list)
    version_id: Mapped[str | None] = mapped_column(String(64))
    error: Mapped[str | None] = mapped_column(Text)
