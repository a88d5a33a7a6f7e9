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


# Why the planner settings (on both functions): a queue table is often empty when it is analyzed, so
# its statistics say a queue holds a row or two; the planner then reads every row of the queue by a
# bitmap scan and sorts them for the LIMIT — each claim O(queue depth) (1.1 ms at 4,000 rows). The
# claim index is in claim order: walked in order, a claim stops at its first ready rows.
PLANNER = "SET enable_bitmapscan = off SET enable_seqscan = off SET enable_sort = off"


# A whole claim pass in one statement (``SELECT * FROM durable_broker_claim_pass(...)``): the claim
# sweep of planning/claim_sweep.py run server-side, as the Redis pass script runs it. Queues are
# asked in the given (already rotated) order; an ask takes min(the queue's free slots,
# ceil(room left / queues not yet asked)); a queue that filled a share smaller than its slots is asked
# again while room is left. room -1: no process cap. The holder's acks (``p_acked``) are deleted
# first. Each ask is the one-queue claim (SKIP LOCKED, holder and lease set); only asks that took
# rows appear, numbered in the order they were made.
# A row taken while a holder is still named on it (that holder's lease lapsed: it died) counts a
# lapse; the caller settles dead a row whose lapses spend its task's budget (broker/dead_letters.py).
CLAIM_PASS_FUNCTION = """
CREATE OR REPLACE FUNCTION durable_broker_claim_pass(
    p_queues text[], p_free int[], p_room int, p_holder text, p_ttl float8, p_acked bigint[])
RETURNS TABLE (r_ask int, r_queue text, r_asked int, r_id bigint, r_priority smallint, r_payload text,
               r_delivery_count int, r_lapses int) AS $$
DECLARE
    v_order int[] := ARRAY(SELECT generate_series(1, coalesce(array_length(p_queues, 1), 0)));
    v_again int[] := '{}';
    v_free int[] := p_free;
    v_room int := p_room;
    v_pos int := 1;
    v_ask int := 0;
    v_q int;
    v_after int;
    v_count int;
    v_share int;
    v_share_bound boolean;
    v_got int;
    v_ready boolean[];
    v_present text[];
    v_complete boolean := false;
BEGIN
    -- The holder's acks since its last statement, deleted first: a pass is also the ack's round trip.
    IF coalesce(array_length(p_acked, 1), 0) > 0 THEN
        DELETE FROM durable_broker_messages WHERE id = ANY(p_acked) AND holder = p_holder;
    END IF;
    -- Which queues have a ready row at all, in one pass of index probes: the sweep then asks only
    -- those (an ask of an empty queue takes nothing and leaves the sweep as it was), so a pass over
    -- 200 queues with work on one costs one UPDATE, not 200.
    -- Many queues asked: first which queues have any row at all, by a skip scan of the claim index
    -- (one probe per queue present in the table, however many are asked), so the probes below skip
    -- the empty ones. Bounded by the number asked: a table holding more queues than that probes all.
    IF coalesce(array_length(p_queues, 1), 0) > 8 THEN
        WITH RECURSIVE present(q, n) AS (
            (SELECT m.queue::text, 1 FROM durable_broker_messages AS m ORDER BY m.queue LIMIT 1)
            UNION ALL
            SELECT (SELECT m.queue::text FROM durable_broker_messages AS m WHERE m.queue > present.q
                    ORDER BY m.queue LIMIT 1), present.n + 1
            FROM present WHERE present.q IS NOT NULL AND present.n <= array_length(p_queues, 1))
        SELECT array_agg(q) FILTER (WHERE q IS NOT NULL), bool_or(q IS NULL) OR count(*) = 0
          INTO v_present, v_complete FROM present;
    END IF;
    SELECT array_agg(CASE WHEN v_complete AND NOT (u.name = ANY(coalesce(v_present, '{}'::text[]))) THEN false
                          ELSE EXISTS (
               SELECT 1 FROM durable_broker_messages AS m
               WHERE m.queue = u.name AND m.visible_at <= now()
                 AND (m.holder IS NULL OR m.lease_expires_at < now())) END ORDER BY u.n)
      INTO v_ready
      FROM unnest(p_queues) WITH ORDINALITY AS u(name, n);
    LOOP
        EXIT WHEN v_room = 0;
        IF v_pos > coalesce(array_length(v_order, 1), 0) THEN
            EXIT WHEN coalesce(array_length(v_again, 1), 0) = 0;
            v_order := v_again;
            v_again := '{}';
            v_pos := 1;
        END IF;
        v_q := v_order[v_pos];
        v_after := array_length(v_order, 1) - v_pos;
        v_pos := v_pos + 1;
        CONTINUE WHEN v_free[v_q] <= 0 OR NOT v_ready[v_q];
        v_count := v_free[v_q];
        v_share_bound := false;
        IF v_room > 0 THEN
            v_share := ceil(v_room::numeric / (v_after + 1))::int;
            IF v_share < v_count THEN
                v_count := v_share;
                v_share_bound := true;
            END IF;
        END IF;
        v_ask := v_ask + 1;
        RETURN QUERY
            WITH ready AS (
                SELECT m.id FROM durable_broker_messages AS m
                WHERE m.queue = p_queues[v_q] AND m.visible_at <= now()
                  AND (m.holder IS NULL OR m.lease_expires_at < now())
                ORDER BY m.priority DESC, m.id LIMIT v_count FOR UPDATE SKIP LOCKED)
            UPDATE durable_broker_messages AS m SET holder = p_holder,
                lease_expires_at = now() + make_interval(secs => p_ttl), delivery_count = m.delivery_count + 1,
                lapses = m.lapses + (m.holder IS NOT NULL)::int
            FROM ready WHERE m.id = ready.id
            RETURNING v_ask, m.queue::text, v_count, m.id, m.priority, m.payload, m.delivery_count, m.lapses;
        GET DIAGNOSTICS v_got = ROW_COUNT;
        IF v_got > 0 THEN
            v_free[v_q] := v_free[v_q] - v_got;
            IF v_room > 0 THEN
                v_room := v_room - v_got;
            END IF;
            IF v_share_bound AND v_got = v_count AND v_free[v_q] > 0 THEN
                v_again := v_again || v_q;
            END IF;
        ELSE
            v_ask := v_ask - 1;
        END IF;
    END LOOP;
END;
$$ LANGUAGE plpgsql
""" + PLANNER


# One queue's claim (a stock worker's consumer, kombu's basic_get), the holder's acks since its last
# statement deleted in the same call.
CLAIM_FUNCTION = """
CREATE OR REPLACE FUNCTION durable_broker_claim(
    p_queue text, p_limit int, p_holder text, p_ttl float8, p_acked bigint[])
RETURNS TABLE (r_id bigint, r_queue text, r_priority smallint, r_payload text, r_delivery_count int,
               r_lapses int) AS $$
BEGIN
    IF coalesce(array_length(p_acked, 1), 0) > 0 THEN
        DELETE FROM durable_broker_messages WHERE id = ANY(p_acked) AND holder = p_holder;
    END IF;
    RETURN QUERY
        WITH ready AS (
            SELECT m.id FROM durable_broker_messages AS m
            WHERE m.queue = p_queue AND m.visible_at <= now()
              AND (m.holder IS NULL OR m.lease_expires_at < now())
            ORDER BY m.priority DESC, m.id LIMIT p_limit FOR UPDATE SKIP LOCKED)
        UPDATE durable_broker_messages AS m SET holder = p_holder,
            lease_expires_at = now() + make_interval(secs => p_ttl), delivery_count = m.delivery_count + 1,
            lapses = m.lapses + (m.holder IS NOT NULL)::int
        FROM ready WHERE m.id = ready.id
        RETURNING m.id, m.queue::text, m.priority, m.payload, m.delivery_count, m.lapses;
END;
$$ LANGUAGE plpgsql
""" + PLANNER


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
        sa.Column("lapses", sa.Integer, nullable=False, server_default="0"),
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
        op.execute(CLAIM_PASS_FUNCTION)
        op.execute(CLAIM_FUNCTION)


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute("DROP TRIGGER IF EXISTS durable_broker_messages_notify ON durable_broker_messages")
        op.execute("DROP FUNCTION IF EXISTS durable_broker_notify()")
        op.execute("DROP FUNCTION IF EXISTS durable_broker_claim_pass(text[], int[], int, text, float8, bigint[])")
        op.execute("DROP FUNCTION IF EXISTS durable_broker_claim(text, int, text, float8, bigint[])")
    op.drop_index("ix_durable_broker_messages_holder", table_name="durable_broker_messages")
    op.drop_index("ix_durable_broker_messages_claim", table_name="durable_broker_messages")
    op.drop_table("durable_broker_messages")
