"""Run recovery: each run's retry count and a sleeping run's wake-up time, so the fleet can send a
stranded run again (its message gone: a purged queue, a broker restarted without persistence).

Revision ID: 0008_run_recovery
Revises: 0007_limit_declarations
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0008_run_recovery"
down_revision = "0007_limit_declarations"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("durable_runs") as batch:
        batch.add_column(sa.Column("retries", sa.Integer, nullable=False, server_default="0"))
        batch.add_column(sa.Column("wake_at", sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("durable_runs") as batch:
        batch.drop_column("wake_at")
        batch.drop_column("retries")
