"""Which attempt's settle wrote a run's outcome, so the re-send of a settler that never heard its COMMIT's
reply (the store cut while it answered) can still report that outcome: count it and call ``on_settled``.

Revision ID: 0010_run_settled_by
Revises: 0009_broker_messages
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0010_run_settled_by"
down_revision = "0009_broker_messages"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("durable_runs") as batch:
        batch.add_column(sa.Column("settled_by", sa.String(64), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("durable_runs") as batch:
        batch.drop_column("settled_by")
