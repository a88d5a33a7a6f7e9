"""The queue gauges on the broker that claims rows, PostgreSQL and SQLite: depth and the oldest ready row's age
read from the rows themselves (no probe of a message, no send-time header)."""

from __future__ import annotations

from datetime import datetime, timedelta

import sqlalchemy as sa
from kombu import Connection, Exchange, Queue

from celery_durable.compat.queue_probe import probe
from celery_durable.compat.virtual_rows import DELAY_HEADER
from celery_durable.store.engine import ensure_schema

QUEUE = Queue("q", Exchange("q"), "q")


def _age_rows_by(broker_db: str, seconds: float) -> None:
    """Move every row's times ``seconds`` into the past, as if it had waited that long."""
    engine = ensure_schema(broker_db)
    with engine.begin() as conn:
        if engine.dialect.name == "postgresql":
            conn.execute(sa.text("UPDATE durable_broker_messages SET enqueued_at = enqueued_at - make_interval("
                                 "secs => :s), visible_at = visible_at - make_interval(secs => :s)"), {"s": seconds})
        else:
            for row_id, enqueued, visible in conn.exec_driver_sql(
                    "SELECT id, enqueued_at, visible_at FROM durable_broker_messages").all():
                def back(text: str) -> str:
                    at = datetime.strptime(text, "%Y-%m-%d %H:%M:%S.%f") - timedelta(seconds=seconds)
                    return at.strftime("%Y-%m-%d %H:%M:%S.%f")
                conn.exec_driver_sql("UPDATE durable_broker_messages SET enqueued_at = ?, visible_at = ? WHERE id = ?",
                                     (back(enqueued), back(visible), row_id))


def test_depth_counts_ready_rows_and_the_age_is_the_oldest_ready_ones_wait(broker_db: str) -> None:
    with Connection(f"durable+{broker_db}") as conn:
        producer = conn.Producer()
        for n in range(3):
            producer.publish({"n": n}, exchange=QUEUE.exchange, routing_key="q", declare=[QUEUE])
        _age_rows_by(broker_db, 30.0)
        # Sent now, due in a minute: not ready, counted nowhere.
        producer.publish({"n": "later"}, exchange=QUEUE.exchange, routing_key="q", headers={DELAY_HEADER: 60_000})
        held = QUEUE(conn.default_channel).get()  # held by this connection: not ready either
        assert held is not None and held.payload == {"n": 0}

        probed = probe(conn.default_channel, QUEUE)
        assert probed is not None
        assert probed.depth == 2
        assert probed.ready_for is not None and 29.0 <= probed.ready_for < 45.0, probed

        held.ack()
        for _ in range(2):
            message = QUEUE(conn.default_channel).get()
            assert message is not None
            message.ack()
        emptied = probe(conn.default_channel, QUEUE)
        assert emptied is not None and (emptied.depth, emptied.ready_for) == (0, None)
