"""Initial tables: trajectories, round_stats, weight_versions, training_runs.

Revision ID: 0001
Revises:
"""

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "training_runs",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("trigger", sa.String(16), nullable=False),
        sa.Column("status", sa.String(16), nullable=False, index=True),
        sa.Column("requested_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True)),
        sa.Column("finished_at", sa.DateTime(timezone=True)),
        sa.Column("loss", sa.String(8)),
        sa.Column("samples", sa.Integer, nullable=False),
        sa.Column("steps", sa.Integer, nullable=False),
        sa.Column("seconds", sa.Float),
        sa.Column("history", sa.JSON, nullable=False),
        sa.Column("version_id", sa.String(64)),
        sa.Column("error", sa.Text),
    )
    op.create_table(
        "trajectories",
        sa.Column("seq", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("request_id", sa.String(96), nullable=False, unique=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=False, index=True),
        sa.Column("domain", sa.String(32), index=True),
        sa.Column("drafter_version", sa.String(64), nullable=False),
        sa.Column("prompt_ids", sa.JSON, nullable=False),
        sa.Column("response_ids", sa.JSON, nullable=False),
        sa.Column("response_text", sa.Text),
        sa.Column("finish_reason", sa.String(16), nullable=False),
        sa.Column("temperature", sa.Float, nullable=False),
        sa.Column("rounds", sa.Integer, nullable=False),
        sa.Column("accepted", sa.Integer, nullable=False),
        sa.Column(
            "consumed_by",
            sa.Integer,
            sa.ForeignKey("training_runs.id", ondelete="SET NULL"),
            index=True,
        ),
    )
    op.create_table(
        "round_stats",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("request_id", sa.String(96), nullable=False),
        sa.Column("round_index", sa.Integer, nullable=False),
        sa.Column("ts", sa.Float, nullable=False, index=True),
        sa.Column("drafter_version", sa.String(64), nullable=False, index=True),
        sa.Column("policy", sa.String(8), nullable=False),
        sa.Column("domain", sa.String(32)),
        sa.Column("block_size", sa.Integer, nullable=False),
        sa.Column("verify_len", sa.Integer, nullable=False),
        sa.Column("accepted", sa.Integer, nullable=False),
        sa.Column("emitted", sa.Integer, nullable=False),
        sa.Column("a_hat", sa.Float),
        sa.Column("batch_size", sa.Integer, nullable=False),
        sa.Column("draft_ms", sa.Float, nullable=False),
        sa.Column("verify_ms", sa.Float, nullable=False),
        sa.UniqueConstraint("request_id", "round_index", name="uq_round"),
    )
    op.create_table(
        "weight_versions",
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("parent", sa.String(64)),
        sa.Column("path", sa.Text, nullable=False),
        sa.Column("sha256", sa.String(64), nullable=False),
        sa.Column("status", sa.String(16), nullable=False, index=True),
        sa.Column("loss", sa.String(8)),
        sa.Column("data_from", sa.Integer),
        sa.Column("data_to", sa.Integer),
        sa.Column("samples", sa.Integer, nullable=False),
        sa.Column("metrics", sa.JSON, nullable=False),
        sa.Column("reason", sa.Text),
        sa.Column("promoted_at", sa.DateTime(timezone=True)),
    )


def downgrade() -> None:
    op.drop_table("weight_versions")
    op.drop_table("round_stats")
    op.drop_table("trajectories")
    op.drop_table("training_runs")
