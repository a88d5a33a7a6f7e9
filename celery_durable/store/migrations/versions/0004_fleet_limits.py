"""Fleet limits: lease rows per scope, messages waiting for a limit, the rate limits' state.

Revision ID: 0004_fleet_limits
Revises: 0003_run_leases
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004_fleet_limits"
down_revision = "0003_run_leases"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "durable_limit_leases",
        sa.Column("task_name", sa.String(255), primary_key=True),
        sa.Column("kind", sa.String(8), primary_key=True),
        sa.Column("key", sa.String(200), primary_key=True),
        sa.Column("task_id", sa.String(255), primary_key=True),
        sa.Column("holder", sa.String(64), nullable=True),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_index("ix_durable_limit_leases_holder", "durable_limit_leases", ["holder"])
    op.create_table(
        "durable_limit_waiting",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer, "sqlite"), primary_key=True, autoincrement=True),
        sa.Column("task_name", sa.String(255), nullable=False),
        sa.Column("kind", sa.String(8), nullable=False),
        sa.Column("key", sa.String(200), nullable=False),
        sa.Column("task_id", sa.String(255), nullable=False, unique=True),
        sa.Column("queue", sa.String(255), nullable=False),
        sa.Column("exchange", sa.String(255), nullable=False),
        sa.Column("routing_key", sa.String(255), nullable=False),
        sa.Column("body", sa.LargeBinary, nullable=False),
        sa.Column("headers", sa.Text, nullable=False),
        sa.Column("properties", sa.Text, nullable=False),
        sa.Column("content_type", sa.String(128), nullable=False),
        sa.Column("content_encoding", sa.String(64), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("publish_at", sa.DateTime(timezone=True), nullable=True),
    )
    op.create_index("ix_durable_limit_waiting_scope", "durable_limit_waiting", ["task_name", "kind", "key", "id"])
    op.create_index("ix_durable_limit_waiting_publish_at", "durable_limit_waiting", ["publish_at"])
    op.create_table(
        "durable_rate_limits",
        sa.Column("task_name", sa.String(255), primary_key=True),
        sa.Column("tat", sa.DateTime(timezone=True), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("durable_rate_limits")
    op.drop_index("ix_durable_limit_waiting_publish_at", "durable_limit_waiting")
    op.drop_index("ix_durable_limit_waiting_scope", "durable_limit_waiting")
    op.drop_table("durable_limit_waiting")
    op.drop_index("ix_durable_limit_leases_holder", "durable_limit_leases")
    op.drop_table("durable_limit_leases")
