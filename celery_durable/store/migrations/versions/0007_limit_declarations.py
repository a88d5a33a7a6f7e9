"""Fleet limits: every worker's declared limits, so the strictest one applies fleet-wide.

During a rolling deploy that changes a limit, workers declare different ones
for the same task; each used to check its own, so the loosest applied. A
worker writes its declarations at boot (renewed by its heartbeat, like its
leases) and every check of a scope, the general transaction's and the fast
path's function alike, uses the lowest live declaration of its (task, kind).

Revision ID: 0007_limit_declarations
Revises: 0006_durable_beat
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007_limit_declarations"
down_revision = "0006_durable_beat"
branch_labels = None
depends_on = None

# durable_limit_exchange as 0005 wrote it, but the scope's limit is the lowest live declaration.
EXCHANGE = """
CREATE OR REPLACE FUNCTION durable_limit_exchange(
    p_holder text, p_locks text[],
    p_ret_ids text[], p_ret_tasks text[], p_ret_kinds text[], p_ret_keys text[],
    p_task_ids text[], p_tasks text[], p_kinds text[], p_keys text[], p_limits integer[],
    p_now timestamptz, p_expires timestamptz,
    OUT taken boolean, OUT waiters boolean)
LANGUAGE plpgsql AS $fn$
DECLARE
    lock_name text;
    scope record;
    live integer;
    expired integer;
    mine integer;
    lowest integer;
BEGIN
    FOREACH lock_name IN ARRAY p_locks LOOP
        PERFORM pg_advisory_xact_lock(hashtextextended(lock_name, 0));
    END LOOP;
    DELETE FROM durable_limit_leases AS l
     USING unnest(p_ret_ids, p_ret_tasks, p_ret_kinds, p_ret_keys) AS r(id, t, k, ky)
     WHERE l.task_name = r.t AND l.kind = r.k AND l.key = r.ky AND l.task_id = r.id AND l.holder = p_holder;
    waiters := EXISTS (
        SELECT 1 FROM durable_limit_waiting AS w, unnest(p_ret_tasks, p_ret_kinds, p_ret_keys) AS r(t, k, ky)
         WHERE w.task_name = r.t AND w.kind = r.k AND w.key = r.ky AND w.publish_at IS NULL);
    taken := false;
    -- Parked already, or made ready and on its way: the general path knows what that copy does.
    IF EXISTS (SELECT 1 FROM durable_limit_waiting WHERE task_id = ANY (p_task_ids)) THEN
        RETURN;
    END IF;
    FOR scope IN
        SELECT t, k, ky, max(lim) AS lim, count(*) AS wanted
          FROM unnest(p_tasks, p_kinds, p_keys, p_limits) AS s(t, k, ky, lim) GROUP BY t, k, ky
    LOOP
        -- The strictest limit any live worker declares for the scope's (task, kind) applies,
        -- whatever this worker declares (a rolling deploy changing a limit).
        SELECT min(limit_value) INTO lowest FROM durable_limit_declarations
         WHERE task_name = scope.t AND kind = scope.k AND expires_at >= p_now;
        IF lowest IS NOT NULL AND lowest < scope.lim THEN
            scope.lim := lowest;
        END IF;
        SELECT count(*) FILTER (WHERE expires_at >= p_now),
               count(*) FILTER (WHERE expires_at < p_now),
               count(*) FILTER (WHERE expires_at >= p_now AND task_id = ANY (p_task_ids))
          INTO live, expired, mine
          FROM durable_limit_leases
         WHERE task_name = scope.t AND kind = scope.k AND key = scope.ky;
        IF expired > 0 THEN
            DELETE FROM durable_limit_leases
             WHERE task_name = scope.t AND kind = scope.k AND key = scope.ky AND expires_at < p_now;
        END IF;
        -- A lease of their own here (booked for one, or a copy of one running), no room
        -- for them all, or waiters who go first: the general path decides.
        IF mine > 0 OR live + scope.wanted > scope.lim OR EXISTS (
                SELECT 1 FROM durable_limit_waiting
                 WHERE task_name = scope.t AND kind = scope.k AND key = scope.ky AND publish_at IS NULL) THEN
            RETURN;
        END IF;
    END LOOP;
    INSERT INTO durable_limit_leases (task_name, kind, key, task_id, holder, expires_at)
    SELECT t, k, ky, id, p_holder, p_expires FROM unnest(p_task_ids, p_tasks, p_kinds, p_keys) AS s(id, t, k, ky);
    taken := true;
END
$fn$
"""


def upgrade() -> None:
    op.create_table(
        "durable_limit_declarations",
        sa.Column("task_name", sa.String(255), primary_key=True),
        sa.Column("kind", sa.String(8), primary_key=True),
        sa.Column("holder", sa.String(64), primary_key=True),
        sa.Column("limit_value", sa.Integer, nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
    )
    if op.get_bind().dialect.name == "postgresql":
        op.execute(EXCHANGE)


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        import importlib

        op.execute(importlib.import_module(f"{__package__}.0005_limit_fast_path").EXCHANGE)
    op.drop_table("durable_limit_declarations")
