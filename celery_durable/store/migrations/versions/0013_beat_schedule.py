"""Durable beat: entries added, edited and removed at run time (``celery durable schedule add``).

One row per (beat, entry): the task, the schedule as written (seconds in ``every`` or a crontab
line in ``crontab``, exactly one of them), and args, kwargs and options as JSON text. The app's
``beat_schedule`` stays in code; these rows sit beside it and the leader reads them each round.

Revision ID: 0013_beat_schedule
Revises: 0012_broker_bindings
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0013_beat_schedule"
down_revision = "0012_broker_bindings"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "durable_beat_schedule",
        sa.Column("beat", sa.String(200), primary_key=True),
        sa.Column("entry", sa.String(200), primary_key=True),
        sa.Column("task", sa.String(255), nullable=False),
        sa.Column("every", sa.Float, nullable=True),
        sa.Column("crontab", sa.String(200), nullable=True),
        sa.Column("args", sa.Text, nullable=False),
        sa.Column("kwargs", sa.Text, nullable=False),
        sa.Column("options", sa.Text, nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("durable_beat_schedule")
