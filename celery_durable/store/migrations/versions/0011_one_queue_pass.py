"""The claim pass visits only the queues it can ask, and makes no ready probe when one queue is asked.

Measured (``benchmarks/PG_BROKER_RESULTS.md``, run G): 0009's pass walked every position of its
order in PL/pgSQL — six expressions per queue, most of a 200-queue pass (~1.2 ms) spent skipping
queues with no ready row or no free slot. The queues worth asking in the first round are known
before the loop (free slots and the ready probe do not change for a queue not yet asked), so the
loop now visits only those; each ask's share still counts every queue after it in the order, as the
pure sweep (planning/claim_sweep.py) does, so the planner's replay agrees ask for ask. Over one
queue the ready probe walked the same index entries as the claim after it and answered nothing the
claim does not (a one-queue pass in isolation, 4,000 rows queued: 460–490 → 295 µs).

Revision ID: 0011_one_queue_pass
Revises: 0010_run_settled_by
"""

from __future__ import annotations

import importlib

from alembic import op

revision = "0011_one_queue_pass"
down_revision = "0010_run_settled_by"
branch_labels = None
depends_on = None

_0009 = importlib.import_module("celery_durable.store.migrations.versions.0009_broker_messages")

# The same arguments, result and rules as 0009's function (see its comment); only the walk changed.
CLAIM_PASS_FUNCTION = """
CREATE OR REPLACE FUNCTION durable_broker_claim_pass(
    p_queues text[], p_free int[], p_room int, p_holder text, p_ttl float8, p_acked bigint[])
RETURNS TABLE (r_ask int, r_queue text, r_asked int, r_id bigint, r_priority smallint, r_payload text,
               r_delivery_count int, r_lapses int) AS $$
DECLARE
    v_queues int := coalesce(array_length(p_queues, 1), 0);
    -- The order this round walks (queue numbers), its length, and the places in it worth an ask.
    v_order int[];
    v_length int;
    v_visit int[];
    v_again int[] := '{}';
    v_free int[] := p_free;
    v_room int := p_room;
    v_i int := 1;
    v_pos int;
    v_ask int := 0;
    v_q int;
    v_count int;
    v_share int;
    v_share_bound boolean;
    v_got int;
    v_present text[];
    v_complete boolean := false;
BEGIN
    -- The holder's acks since its last statement, deleted first: a pass is also the ack's round trip.
    IF coalesce(array_length(p_acked, 1), 0) > 0 THEN
        DELETE FROM durable_broker_messages WHERE id = ANY(p_acked) AND holder = p_holder;
    END IF;
    IF v_queues = 1 THEN
        -- One queue: its claim finds out whether it has work; a probe first would walk the same entries.
        v_order := '{1}';
        v_visit := CASE WHEN p_free[1] > 0 THEN '{1}'::int[] ELSE '{}'::int[] END;
    ELSE
        -- Many queues asked: first which queues have any row at all, by a skip scan of the claim index
        -- (one probe per queue present in the table, however many are asked), so the probes below skip
        -- the empty ones. Bounded by the number asked: a table holding more queues than that probes all.
        IF v_queues > 8 THEN
            WITH RECURSIVE present(q, n) AS (
                (SELECT m.queue::text, 1 FROM durable_broker_messages AS m ORDER BY m.queue LIMIT 1)
                UNION ALL
                SELECT (SELECT m.queue::text FROM durable_broker_messages AS m WHERE m.queue > present.q
                        ORDER BY m.queue LIMIT 1), present.n + 1
                FROM present WHERE present.q IS NOT NULL AND present.n <= v_queues)
            SELECT array_agg(q) FILTER (WHERE q IS NOT NULL), bool_or(q IS NULL) OR count(*) = 0
              INTO v_present, v_complete FROM present;
        END IF;
        v_order := ARRAY(SELECT generate_series(1, v_queues));
        -- The places worth an ask in the first round: a free slot and a ready row (an index probe
        -- each, only for queues present). Neither changes for a queue before its own ask.
        v_visit := ARRAY(
            SELECT u.n FROM unnest(p_queues, p_free) WITH ORDINALITY AS u(name, free, n)
            WHERE u.free > 0
              AND NOT (v_complete AND NOT (u.name = ANY(coalesce(v_present, '{}'::text[]))))
              AND EXISTS (
                  SELECT 1 FROM durable_broker_messages AS m
                  WHERE m.queue = u.name AND m.visible_at <= now()
                    AND (m.holder IS NULL OR m.lease_expires_at < now()))
            ORDER BY u.n);
    END IF;
    v_length := v_queues;
    LOOP
        EXIT WHEN v_room = 0;
        IF v_i > coalesce(array_length(v_visit, 1), 0) THEN
            -- The next round: the queues that filled their share, each worth an ask.
            EXIT WHEN coalesce(array_length(v_again, 1), 0) = 0;
            v_order := v_again;
            v_length := array_length(v_order, 1);
            v_visit := ARRAY(SELECT generate_series(1, v_length));
            v_again := '{}';
            v_i := 1;
        END IF;
        v_pos := v_visit[v_i];
        v_i := v_i + 1;
        v_q := v_order[v_pos];
        CONTINUE WHEN v_free[v_q] <= 0;
        v_count := v_free[v_q];
        v_share_bound := false;
        IF v_room > 0 THEN
            -- The share counts every queue after this one in the order, asked or not (the pure sweep's rule).
            v_share := ceil(v_room::numeric / (v_length - v_pos + 1))::int;
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
""" + _0009.PLANNER


def upgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute(CLAIM_PASS_FUNCTION)


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute(_0009.CLAIM_PASS_FUNCTION)
