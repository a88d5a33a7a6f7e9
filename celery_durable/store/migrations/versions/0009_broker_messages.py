"""The PostgreSQL broker's messages: one row per kombu message, claimed under a lease.

A claim reads ``ix_durable_broker_messages_claim`` in (queue, priority, id)
order and skips held rows; the held rows of a queue are bounded by what its
consumers hold, so the scan past them stays short. On PostgreSQL an insert
NOTIFYs ``durable_broker`` with the queue as payload (an idle consumer's wake-up).

Revision ID: 0009_broker_messages
Revises: 0008_run_recovery
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0009_broker_messages"
down_revision = "0008_run_recovery"
branch_labels = None
depends_on = None

NOTIFY_FUNCTION = """
CREATE OR REPLACE FUNCTION durable_broker_notify() RETURNS trigger AS $$
BEGIN
    PERFORM pg_notify('durable_broker', NEW.queue);
    RETURN NULL;
END;
$$ LANGUAGE plpgsql
"""


def upgrade() -> None:
    op.create_table(
        "durable_broker_messages",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer, "sqlite"), primary_key=True, autoincrement=True),
        sa.Column("queue", sa.String(255), nullable=False),
        sa.Column("priority", sa.SmallInteger, nullable=False, server_default="0"),
        sa.Column("payload", sa.Text, nullable=False),
        sa.Column("enqueued_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now()),
        sa.Column("visible_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now()),
        sa.Column("holder", sa.String(255), nullable=True),
        sa.Column("lease_expires_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("delivery_count", sa.Integer, nullable=False, server_default="0"),
    )
    op.create_index("ix_durable_broker_messages_claim", "durable_broker_messages",
                    ["queue", sa.text("priority DESC"), "id"])
    op.create_index("ix_durable_broker_messages_holder", "durable_broker_messages", ["holder"])
    if op.get_bind().dialect.name == "postgresql":
        op.execute(NOTIFY_FUNCTION)
        # FOR EACH STATEMENT cannot see the queue; per row, and a batch of one queue's
        # rows sends one notification: PostgreSQL folds identical ones within a transaction.
        op.execute("CREATE TRIGGER durable_broker_messages_notify AFTER INSERT ON durable_broker_messages "
                   "FOR EACH ROW EXECUTE FUNCTION durable_broker_notify()")


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute("DROP TRIGGER IF EXISTS durable_broker_messages_notify ON durable_broker_messages")
        op.execute("DROP FUNCTION IF EXISTS durable_broker_notify()")
    op.drop_index("ix_durable_broker_messages_holder", table_name="durable_broker_messages")
    op.drop_index("ix_durable_broker_messages_claim", table_name="durable_broker_messages")
    op.drop_table("durable_broker_messages")
