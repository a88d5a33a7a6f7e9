"""The broker's bindings other processes route by: fan-out, topic, and direct keys that are not a queue's name.

kombu's virtual transports keep exchange bindings in each process's memory, which is enough for a
producer that declared the queue it sends to, and not for broadcasts: ``celery inspect`` publishes to
the ``celery.pidbox`` fan-out exchange that only the workers bound, a worker replies on a direct key
only the asking client bound, task events go to whichever monitors bound ``celeryev``. Those bindings
are rows here. ``seen_at`` (seconds since the epoch, the database's clock) is refreshed by the
connection consuming the queue; a binding whose queue declared ``x-expires`` and went unseen that long
is gone, as RabbitMQ deletes such a queue.

Revision ID: 0012_broker_bindings
Revises: 0011_one_queue_pass
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0012_broker_bindings"
down_revision = "0011_one_queue_pass"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "durable_broker_bindings",
        sa.Column("exchange", sa.String(255), primary_key=True),
        sa.Column("routing_key", sa.String(255), primary_key=True),
        sa.Column("queue", sa.String(255), primary_key=True),
        sa.Column("pattern", sa.Text, nullable=True),
        sa.Column("expires_after", sa.Float, nullable=True),
        sa.Column("seen_at", sa.Float, nullable=False),
    )
    op.create_index("ix_durable_broker_bindings_queue", "durable_broker_bindings", ["queue"])


def downgrade() -> None:
    op.drop_index("ix_durable_broker_bindings_queue", table_name="durable_broker_bindings")
    op.drop_table("durable_broker_bindings")
