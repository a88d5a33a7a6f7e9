"""The transactional outbox: tasks enqueued in a caller's transaction, waiting for the relay.

Revision ID: 0002_outbox
Revises: 0001_runs_and_steps
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002_outbox"
down_revision = "0001_runs_and_steps"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "durable_outbox",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer, "sqlite"), primary_key=True,
                  autoincrement=True),
        sa.Column("task_id", sa.String(255), nullable=False, unique=True),
        sa.Column("task_name", sa.String(255), nullable=False),
        sa.Column("args", sa.Text, nullable=False),
        sa.Column("kwargs", sa.Text, nullable=False),
        sa.Column("options", sa.Text, nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("available_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("published_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("attempts", sa.Integer, nullable=False, server_default="0"),
        sa.Column("last_error", sa.Text, nullable=True),
    )
    op.create_index("ix_durable_outbox_pending", "durable_outbox", ["published_at", "id"])


def downgrade() -> None:
    op.drop_index("ix_durable_outbox_pending", table_name="durable_outbox")
    op.drop_table("durable_outbox")
