"""Durable beat: the leader lease of each beat, each entry's watermark, and every tick fired; and an
index on when runs finished, for run retention.

Revision ID: 0006_durable_beat
Revises: 0005_limit_fast_path
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006_durable_beat"
down_revision = "0005_limit_fast_path"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "durable_beat_leader",
        sa.Column("beat", sa.String(200), primary_key=True),
        sa.Column("holder", sa.String(64), nullable=False),
        sa.Column("term", sa.BigInteger, nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_table(
        "durable_beat_entries",
        sa.Column("beat", sa.String(200), primary_key=True),
        sa.Column("entry", sa.String(200), primary_key=True),
        sa.Column("watermark", sa.DateTime(timezone=True), nullable=False),
        sa.Column("paused", sa.Boolean, nullable=False, server_default=sa.false()),
        sa.Column("last_fire_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("last_tick", sa.DateTime(timezone=True), nullable=True),
    )
    op.create_table(
        "durable_beat_fires",
        sa.Column("beat", sa.String(200), primary_key=True),
        sa.Column("entry", sa.String(200), primary_key=True),
        sa.Column("tick", sa.DateTime(timezone=True), primary_key=True),
        sa.Column("task_id", sa.String(255), nullable=False),
        sa.Column("term", sa.BigInteger, nullable=False),
        sa.Column("fired_at", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_index("ix_durable_beat_fires_fired_at", "durable_beat_fires", ["fired_at"])
    op.create_index("ix_durable_runs_finished_at", "durable_runs", ["finished_at"])


def downgrade() -> None:
    op.drop_index("ix_durable_runs_finished_at", "durable_runs")
    op.drop_index("ix_durable_beat_fires_fired_at", "durable_beat_fires")
    op.drop_table("durable_beat_fires")
    op.drop_table("durable_beat_entries")
    op.drop_table("durable_beat_leader")
