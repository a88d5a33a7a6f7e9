"""Run leases: the holder and expiry of the attempt executing a run, and its lost attempts.

Revision ID: 0003_run_leases
Revises: 0002_outbox
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003_run_leases"
down_revision = "0002_outbox"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # batch_alter_table: SQLite cannot ALTER a table's columns in place.
    with op.batch_alter_table("durable_runs") as batch:
        batch.add_column(sa.Column("lease_holder", sa.String(64), nullable=True))
        batch.add_column(sa.Column("lease_expires_at", sa.DateTime(timezone=True), nullable=True))
        batch.add_column(sa.Column("lost_attempts", sa.Integer, nullable=False, server_default="0"))


def downgrade() -> None:
    with op.batch_alter_table("durable_runs") as batch:
        batch.drop_column("lost_attempts")
        batch.drop_column("lease_expires_at")
        batch.drop_column("lease_holder")
