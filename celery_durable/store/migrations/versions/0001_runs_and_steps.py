"""Durable runs and their step checkpoints.

Revision ID: 0001_runs_and_steps
Revises:
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001_runs_and_steps"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "durable_runs",
        sa.Column("id", sa.String(255), primary_key=True),
        sa.Column("task_name", sa.String(255), nullable=False),
        sa.Column("queue", sa.String(255), nullable=True),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("attempts", sa.Integer, nullable=False),
        sa.Column("args", sa.Text, nullable=False),
        sa.Column("kwargs", sa.Text, nullable=False),
        sa.Column("result", sa.Text, nullable=True),
        sa.Column("last_error", sa.Text, nullable=True),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
    )
    op.create_index("ix_durable_runs_state", "durable_runs", ["state"])
    op.create_table(
        "durable_steps",
        sa.Column("run_id", sa.String(255), sa.ForeignKey("durable_runs.id", ondelete="CASCADE"),
                  primary_key=True),
        sa.Column("name", sa.String(200), primary_key=True),
        sa.Column("occurrence", sa.Integer, primary_key=True),
        sa.Column("result", sa.Text, nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("durable_steps")
    op.drop_index("ix_durable_runs_state", table_name="durable_runs")
    op.drop_table("durable_runs")
