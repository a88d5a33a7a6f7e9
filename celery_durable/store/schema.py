"""The durable store's tables, as SQLAlchemy Core metadata, and the schema revision this code needs."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime, timezone
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Dialect

#: The Alembic revision the code reads and writes; a database behind it must be migrated.
HEAD_REVISION = "0015_state_index_not_succeeded"

#: The databases the store's SQL is written for (SQLAlchemy backend names; any driver of them).
SUPPORTED_BACKENDS = ("postgresql", "sqlite")

#: Alembic's bookkeeping table, named apart from an application's own ``alembic_version``.
VERSION_TABLE = "durable_alembic_version"

#: Run states. A run in SETTLED never runs its body again. A ``sleeping`` run
#: waits for the wake-up message its last attempt sent (a durable sleep).
RUNNING, SUCCEEDED, FAILED, DEAD, CANCELLED = "running", "succeeded", "failed", "dead", "cancelled"
SLEEPING = "sleeping"
STATES = (RUNNING, SLEEPING, SUCCEEDED, FAILED, DEAD, CANCELLED)
SETTLED = frozenset({SUCCEEDED, DEAD, CANCELLED})

#: The condition of ``ix_durable_runs_state``: it leaves out the state nearly every run ends in, so a
#: settle that succeeds writes no entry there (migration 0015). SQLite uses a partial index only for a
#: query that repeats this condition: every read by state in ``store/runs.py`` states it.
INDEXED_STATES_SQL = f"state <> '{SUCCEEDED}'"



class UtcDateTime(sa.types.TypeDecorator[datetime]):
    """A timestamp read back as an aware UTC datetime on every database.

    Stored as ``DateTime(timezone=True)`` (the migrations' type): PostgreSQL's
    ``timestamptz`` keeps the instant; SQLite keeps the text of the wall time
    and hands back a naive datetime, so values are written in UTC and read
    back as UTC. A naive value given to it is taken to be UTC already.
    """

    impl = sa.DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None or value.tzinfo is None:
            return value
        return value.astimezone(timezone.utc)

    def process_result_value(self, value: Any, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if not isinstance(value, datetime):
            raise TypeError(f"expected a datetime from the store, got {value!r}")
        return value.replace(tzinfo=timezone.utc) if value.tzinfo is None else value.astimezone(timezone.utc)


metadata = sa.MetaData()

runs = sa.Table(
    "durable_runs",
    metadata,
    sa.Column("id", sa.String(255), primary_key=True),  # the Celery task id
    sa.Column("task_name", sa.String(255), nullable=False),
    sa.Column("queue", sa.String(255), nullable=True),
    sa.Column("state", sa.String(16), nullable=False),
    sa.Column("attempts", sa.Integer, nullable=False),
    # JSON text: encoded (and round-trip checked) by the caller, so one rule
    # decides what may be stored, on every database.
    sa.Column("args", sa.Text, nullable=False),
    sa.Column("kwargs", sa.Text, nullable=False),
    sa.Column("result", sa.Text, nullable=True),
    sa.Column("last_error", sa.Text, nullable=True),
    sa.Column("started_at", UtcDateTime(), nullable=False),
    sa.Column("updated_at", UtcDateTime(), nullable=False),
    sa.Column("finished_at", UtcDateTime(), nullable=True),
    # The run lease (see celery_durable.store.runs): the token of the attempt
    # executing the run, or of the message it handed the run to (a durable
    # sleep, a store outage), and until when the holder's heartbeat vouches
    # for it (NULL: a hand-off, not a live attempt).
    sa.Column("lease_holder", sa.String(64), nullable=True),
    sa.Column("lease_expires_at", UtcDateTime(), nullable=True),
    # Attempts that started and never recorded an end (their process died):
    # a run that keeps killing its worker is buried once these use up its retries.
    sa.Column("lost_attempts", sa.Integer, nullable=False, server_default="0"),
    # The delivery's Celery retry count when its attempt began, and when a sleeping run's wake-up
    # is due: what the fleet needs to send a stranded run again (tasks/recovery.py).
    sa.Column("retries", sa.Integer, nullable=False, server_default="0"),
    sa.Column("wake_at", UtcDateTime(), nullable=True),
    # The token of the attempt whose settle wrote the outcome. Its re-send after a settle whose reply
    # was lost (it carries that token) claims the outcome its settler never heard, clearing this.
    sa.Column("settled_by", sa.String(64), nullable=True),
    # The store's reads by state (recovery, sleeping and dead runs), over every run not succeeded.
    sa.Index("ix_durable_runs_state", "state", sqlite_where=sa.text(INDEXED_STATES_SQL),
             postgresql_where=sa.text(INDEXED_STATES_SQL)),
    # Run retention (tasks/retention.py), over finished runs only: a run's start then writes no entry
    # its settle would move (migration 0014).
    sa.Index("ix_durable_runs_finished_at", "finished_at", sqlite_where=sa.text("finished_at IS NOT NULL"),
             postgresql_where=sa.text("finished_at IS NOT NULL")),
)


#: ``INDEXED_STATES_SQL`` as a clause: a read by state names it, or SQLite scans the table. A literal, not a
#: bind: the index's condition has the literal.
INDEXED_STATES = runs.c.state != sa.literal_column(f"'{SUCCEEDED}'")


def by_state(states: Sequence[str]) -> list[sa.ColumnElement[bool]]:
    """The WHERE terms for runs in ``states``: through the state index unless succeeded runs are asked for."""
    return [runs.c.state.in_(list(states)), *([] if SUCCEEDED in states else [INDEXED_STATES])]

steps = sa.Table(
    "durable_steps",
    metadata,
    sa.Column("run_id", sa.String(255), sa.ForeignKey("durable_runs.id", ondelete="CASCADE"),
              primary_key=True),
    sa.Column("name", sa.String(200), primary_key=True),
    sa.Column("occurrence", sa.Integer, primary_key=True),
    sa.Column("result", sa.Text, nullable=False),
    sa.Column("created_at", UtcDateTime(), nullable=False),
    # A rowid table on SQLite, on purpose: rows appended in order plus a small key index wrote fewer
    # pages than WITHOUT ROWID once results pass ~200 bytes (random inserts of fat rows split leaves).
)

outbox = sa.Table(
    "durable_outbox",
    metadata,
    # BIGINT on PostgreSQL; SQLite only autoincrements an INTEGER primary key.
    sa.Column("id", sa.BigInteger().with_variant(sa.Integer, "sqlite"), primary_key=True,
              autoincrement=True),
    sa.Column("task_id", sa.String(255), nullable=False, unique=True),
    sa.Column("task_name", sa.String(255), nullable=False),
    # JSON text, encoded by celery_durable.outbox.enqueue before the INSERT.
    sa.Column("args", sa.Text, nullable=False),
    sa.Column("kwargs", sa.Text, nullable=False),
    sa.Column("options", sa.Text, nullable=False),
    sa.Column("created_at", UtcDateTime(), nullable=False),
    # Not before this time: a row whose publish failed waits out its backoff here.
    sa.Column("available_at", UtcDateTime(), nullable=False),
    sa.Column("published_at", UtcDateTime(), nullable=True),
    sa.Column("attempts", sa.Integer, nullable=False, server_default="0"),
    sa.Column("last_error", sa.Text, nullable=True),
    # The relay's scan: unpublished rows in id order (published ones are only swept by age).
    sa.Index("ix_durable_outbox_pending", "published_at", "id"),
)

# Fleet limits (celery_durable.store.limits). A lease row is one run inside one
# scope: (task, "task", "") for durable_concurrency, (task, "key", key) for a
# key limit, (task, "rate", "") for a rate turn booked by a waiting message.
limit_leases = sa.Table(
    "durable_limit_leases",
    metadata,
    sa.Column("task_name", sa.String(255), primary_key=True),
    sa.Column("kind", sa.String(8), primary_key=True),
    sa.Column("key", sa.String(200), primary_key=True),
    sa.Column("task_id", sa.String(255), primary_key=True),
    # The worker process holding it (renewed by its heartbeat); NULL: booked
    # for a waiting message that was made ready and is on its way back.
    sa.Column("holder", sa.String(64), nullable=True),
    sa.Column("expires_at", UtcDateTime(), nullable=False),
    sa.Index("ix_durable_limit_leases_holder", "holder"),
)

# Messages waiting for a limit, kept whole (body, headers, properties) so the
# copy published when its turn comes is the message that arrived: same id,
# same retries, same callbacks.
limit_waiting = sa.Table(
    "durable_limit_waiting",
    metadata,
    sa.Column("id", sa.BigInteger().with_variant(sa.Integer, "sqlite"), primary_key=True, autoincrement=True),
    sa.Column("task_name", sa.String(255), nullable=False),
    sa.Column("kind", sa.String(8), nullable=False),
    sa.Column("key", sa.String(200), nullable=False),
    sa.Column("task_id", sa.String(255), nullable=False, unique=True),
    sa.Column("queue", sa.String(255), nullable=False),
    sa.Column("exchange", sa.String(255), nullable=False),
    sa.Column("routing_key", sa.String(255), nullable=False),
    sa.Column("body", sa.LargeBinary, nullable=False),
    # JSON text (kombu's typed JSON), as the broker delivered them.
    sa.Column("headers", sa.Text, nullable=False),
    sa.Column("properties", sa.Text, nullable=False),
    sa.Column("content_type", sa.String(128), nullable=False),
    sa.Column("content_encoding", sa.String(64), nullable=False),
    sa.Column("created_at", UtcDateTime(), nullable=False),
    # NULL: waiting for a lease in its scope. Set: to be published at that time
    # (its lease or rate turn is booked).
    sa.Column("publish_at", UtcDateTime(), nullable=True),
    sa.Index("ix_durable_limit_waiting_scope", "task_name", "kind", "key", "id"),
    sa.Index("ix_durable_limit_waiting_publish_at", "publish_at"),
)

# The limits each live worker declares, per (task, kind): the lowest applies fleet-wide, so a
# rolling deploy that changes a limit is never looser than its strictest worker. Renewed with
# the holder's leases; a dead worker's expire with them.
limit_declarations = sa.Table(
    "durable_limit_declarations",
    metadata,
    sa.Column("task_name", sa.String(255), primary_key=True),
    sa.Column("kind", sa.String(8), primary_key=True),
    sa.Column("holder", sa.String(64), primary_key=True),
    sa.Column("limit_value", sa.Integer, nullable=False),
    sa.Column("expires_at", UtcDateTime(), nullable=False),
)

# The fleet rate limit's state: per task, the theoretical arrival time of its next run (GCRA).
rate_limits = sa.Table(
    "durable_rate_limits",
    metadata,
    sa.Column("task_name", sa.String(255), primary_key=True),
    sa.Column("tat", UtcDateTime(), nullable=False),
)


# Durable beat (celery_durable.store.beat). One row per beat (its name: the app's main
# module unless set): the replica leading it, until when, and the term — raised each
# time the lease changes hands, so a fire can name the leadership it was made under.
beat_leader = sa.Table(
    "durable_beat_leader",
    metadata,
    sa.Column("beat", sa.String(200), primary_key=True),
    sa.Column("holder", sa.String(64), nullable=False),
    sa.Column("term", sa.BigInteger, nullable=False),
    sa.Column("expires_at", UtcDateTime(), nullable=False),
)

# Each entry's watermark: the latest occurrence decided (sent, or passed over by its
# catch-up policy), written in the transaction of the fire that moves it.
beat_entries = sa.Table(
    "durable_beat_entries",
    metadata,
    sa.Column("beat", sa.String(200), primary_key=True),
    sa.Column("entry", sa.String(200), primary_key=True),
    sa.Column("watermark", UtcDateTime(), nullable=False),
    sa.Column("paused", sa.Boolean, nullable=False, server_default=sa.false()),
    sa.Column("last_fire_at", UtcDateTime(), nullable=True),
    sa.Column("last_tick", UtcDateTime(), nullable=True),
)

# Every tick sent, unique per (beat, entry, tick): a tick is fired once whoever leads.
beat_fires = sa.Table(
    "durable_beat_fires",
    metadata,
    sa.Column("beat", sa.String(200), primary_key=True),
    sa.Column("entry", sa.String(200), primary_key=True),
    sa.Column("tick", UtcDateTime(), primary_key=True),
    sa.Column("task_id", sa.String(255), nullable=False),
    sa.Column("term", sa.BigInteger, nullable=False),
    sa.Column("fired_at", UtcDateTime(), nullable=False),
    sa.Index("ix_durable_beat_fires_fired_at", "fired_at"),
)

# Entries added at run time (``celery durable schedule add``, ``celery_durable.beat.schedule_entries``;
# migration 0013), read by the beat's leader each round beside the app's ``beat_schedule``. Kept as
# written: seconds (``every``) or a crontab line, and args, kwargs and options as JSON text.
beat_schedule = sa.Table(
    "durable_beat_schedule",
    metadata,
    sa.Column("beat", sa.String(200), primary_key=True),
    sa.Column("entry", sa.String(200), primary_key=True),
    sa.Column("task", sa.String(255), nullable=False),
    sa.Column("every", sa.Float, nullable=True),
    sa.Column("crontab", sa.String(200), nullable=True),
    sa.Column("args", sa.Text, nullable=False),
    sa.Column("kwargs", sa.Text, nullable=False),
    sa.Column("options", sa.Text, nullable=False),
    sa.Column("updated_at", UtcDateTime(), nullable=False),
)

#: The PostgreSQL broker's messages (``broker/``): a row is ready when ``visible_at`` has passed and
#: no live lease holds it; ack deletes it, a requeue clears its holder and keeps its ``id`` (its place).
broker_messages = sa.Table(
    "durable_broker_messages",
    metadata,
    sa.Column("id", sa.BigInteger().with_variant(sa.Integer, "sqlite"), primary_key=True, autoincrement=True),
    sa.Column("queue", sa.String(255), nullable=False),
    sa.Column("priority", sa.SmallInteger, nullable=False, server_default="0"),
    sa.Column("payload", sa.Text, nullable=False),  # the kombu message as sent, JSON
    sa.Column("enqueued_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now()),
    sa.Column("visible_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now()),
    sa.Column("holder", sa.String(255), nullable=True),
    sa.Column("lease_expires_at", sa.DateTime(timezone=True), nullable=True),
    sa.Column("delivery_count", sa.Integer, nullable=False, server_default="0"),
    # Hand-outs whose holder's lease lapsed (it died): the claim settles dead a row past its task's budget.
    sa.Column("lapses", sa.Integer, nullable=False, server_default="0"),
    sa.Index("ix_durable_broker_messages_claim", "queue", sa.text("priority DESC"), "id"),
    sa.Index("ix_durable_broker_messages_holder", "holder"),
)

#: The broker's bindings that route across processes (fan-out, topic, reply keys; migration 0012):
#: a binding whose queue declared ``x-expires`` lapses that long after ``seen_at`` (epoch seconds, the
#: database's clock), refreshed while a connection consumes the queue.
broker_bindings = sa.Table(
    "durable_broker_bindings",
    metadata,
    sa.Column("exchange", sa.String(255), primary_key=True),
    sa.Column("routing_key", sa.String(255), primary_key=True),
    sa.Column("queue", sa.String(255), primary_key=True),
    sa.Column("pattern", sa.Text, nullable=True),
    sa.Column("expires_after", sa.Float, nullable=True),
    sa.Column("seen_at", sa.Float, nullable=False),
    sa.Index("ix_durable_broker_bindings_queue", "queue"),
)
