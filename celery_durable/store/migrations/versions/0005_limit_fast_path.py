"""Fleet limits in one round trip on PostgreSQL: give back the leases of runs that ended, take free ones.

One function for the common case of limited runs (``store.limits.exchange``):
anything else — a busy scope, waiters to serve first, a copy of a run already
known, a rate turn — answers "not here" and the caller runs the general
transaction. SQLite has no functions and no round trips to
save: the general transaction serves it.

Each statement inside a PL/pgSQL function sees what committed before it ran,
so the scope's advisory locks (taken first, in the caller's sorted order, as
the general transaction takes them) serialise these with it.

Revision ID: 0005_limit_fast_path
Revises: 0004_fleet_limits
"""

from __future__ import annotations

from alembic import op

revision = "0005_limit_fast_path"
down_revision = "0004_fleet_limits"
branch_labels = None
depends_on = None

# One call of a worker: the leases of runs that ended go back (``p_ret_*``, one
# row per (run, scope)), then a claim pass's runs take theirs (``p_*``, one row
# per (run, scope)) if every scope has room for them all and nobody waits
# there. ``taken``: the runs' leases are taken (false: none are, and the
# general transaction decides; true when there were none to take). ``waiters``:
# a scope a lease went back to has messages waiting (the general release makes
# them ready). Expired leases of the scopes asked for may be deleted either way.
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
    if op.get_bind().dialect.name != "postgresql":
        return
    op.execute(EXCHANGE)


def downgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    op.execute("DROP FUNCTION IF EXISTS durable_limit_exchange(text, text[], text[], text[], text[], text[], text[], "
               "text[], text[], text[], integer[], timestamptz, timestamptz)")
