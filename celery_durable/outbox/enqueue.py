"""``outbox.enqueue``: a task added to the caller's own SQLAlchemy transaction, sent once it commits."""

from __future__ import annotations

import json
import uuid
from datetime import datetime, timezone
from typing import Any

import sqlalchemy as sa
from celery.canvas import Signature, group, maybe_signature, maybe_unroll_group
from celery.utils.saferepr import saferepr
from sqlalchemy.engine import Connection
from sqlalchemy.orm import Session

from celery_durable.compat.canvas import chain_uses_links, is_chain, is_chord, merged_call, prepare_chain_steps
from celery_durable.errors import NotJSON, OutboxDatabaseMismatch, OutboxInvalid
from celery_durable.outbox.publishing.direct import send_in_transaction
from celery_durable.outbox.transaction import broker_in_database
from celery_durable.planning.outbox import OptionInvalid, chain_step_options, serialize_options, without_callbacks
from celery_durable.store import outbox as store
from celery_durable.store.engine import database_identity, ensure_schema, ensure_schema_in, store_url
from celery_durable.store.json_values import encode
from celery_durable.store.outbox import OutboxRow
from celery_durable.store.urls import shown_url

__all__ = ["enqueue"]


#: Options Celery puts on signatures it builds; they mean nothing in a message of its own.
_DROPPED = ("task_id", "parent_id", "root_id", "group_id", "group_index", "chord", "reply_to")

#: What ``enqueue`` takes, for the refusals.
_SUPPORTED = "a task signature (task.s(...)) or a chain of task signatures (chain(a.s(), b.s()) or a.s() | b.s())"


def enqueue(session_or_connection: Session | Connection, signature: Signature, **options: Any) -> Any:
    """Add ``signature`` to the caller's transaction, sent once and only if it commits; returns its ``AsyncResult``.

    Takes the apply_async options a message can keep (queue, routing_key,
    exchange, countdown, eta, expires, priority, headers, time_limit,
    soft_time_limit, shadow, serializer, argsrepr, kwargsrepr, task_id). Never commits: the task is
    published by a relay once, and only if, the caller's transaction commits.
    The session or connection must be on the app's ``durable_database_url``.

    On the PostgreSQL broker (``durable+postgresql://``) on that same database there is no
    outbox row and no relay: the broker's message row itself (the message the relay would
    publish, built by Celery's own send path) is inserted through the caller's connection.

    ``signature`` may be a chain of task signatures: as ``chain.apply_async(**options)``
    does, every step's id is fixed now (``task_id`` names the last step's), the options
    go to the first step, and its message carries the rest of the chain; the worker
    sends each next step, with its own options, when the previous one succeeds. The
    returned result is the last step's, its ``.parent`` links leading to the first.
    Groups, chords and link/link_error callbacks are refused.
    """
    if is_chain(signature):
        return _enqueue_chain(session_or_connection, signature, options)
    if type(signature) is not Signature:
        # group/chord create task ids of their own at publish: a
        # republish would start those again under new ids.
        raise OutboxInvalid(f"outbox.enqueue takes {_SUPPORTED}, not a {type(signature).__name__.lstrip('_')}")
    conn, direct = _prepare(session_or_connection, signature.app)
    merged = {**(signature.options or {}), **options}
    task_id = str(merged.pop("task_id", None) or uuid.uuid4())
    _insert(conn, direct, signature.app, signature.task, signature.args, signature.kwargs, merged, task_id)
    return signature.app.AsyncResult(task_id)


def _prepare(session_or_connection: Session | Connection, app: Any) -> tuple[Connection, bool]:
    """The caller's connection, checked, and whether the app's broker is the PostgreSQL one on its database."""
    conn = _connection(session_or_connection)
    url = store_url(app)
    _check_same_database(conn.engine.url, url)
    direct = broker_in_database(app, conn) is not None
    if direct:
        # The broker's own connection (the producer's) checks the schema on a connection of its
        # own: migrated first on one, a fresh schema made in the caller's transaction would
        # leave that check waiting on the caller's locks, and the caller waiting on it.
        ensure_schema(url)
    ensure_schema_in(conn, url)
    return conn, direct


def _insert(conn: Connection, direct: bool, app: Any, task_name: str, args: Any, kwargs: Any, options: dict[str, Any],
            task_id: str, steps: list[Signature] | None = None) -> None:
    for key in _DROPPED:
        options.pop(key, None)
    now = datetime.now(timezone.utc)
    args, kwargs = list(args or ()), dict(kwargs or {})
    try:
        stored_options = serialize_options(options, now)
        args_json = encode(f"the arguments of {task_name}", args)
        kwargs_json = encode(f"the keyword arguments of {task_name}", kwargs)
        if steps is not None:
            stored_options["chain"] = [_chain_step(step) for step in steps]
    except (OptionInvalid, NotJSON) as err:
        raise OutboxInvalid(f"outbox.enqueue({task_name}): {err}") from None
    _with_reprs(app, stored_options, args, kwargs)
    if direct:
        # The PostgreSQL broker on this database: the message row itself, in the caller's transaction.
        send_in_transaction(conn, app, OutboxRow(0, task_id, task_name, args_json, kwargs_json,
                                                 json.dumps(stored_options), 0))
        return
    store.insert_txn(conn, task_id=task_id, task_name=task_name, args=args_json, kwargs=kwargs_json,
                     options=json.dumps(stored_options), at=now)


def _enqueue_chain(session_or_connection: Session | Connection, sig: Signature, options: dict[str, Any]) -> Any:
    """What ``chain.apply_async(**options)`` (Celery 5.7 ``_chain.run``) publishes, as one row.

    ``prepare_steps`` clones and freezes every step (the last one with ``task_id``);
    the first step is sent with the chain's options merged over its own and, in its
    body's embed, the frozen rest of the chain (last step first, as Celery keeps it).
    """
    app = sig.app
    _refuse_canvas_steps(sig)
    merged = _without_callbacks("outbox.enqueue(chain)",
                                {k: v for k, v in dict(sig.options, **options).items() if v is not None})
    use_link = chain_uses_links(sig)
    if use_link or (use_link is None and app.conf.task_protocol == 1):
        raise OutboxInvalid("outbox.enqueue(chain) needs task protocol 2: protocol 1 links the steps with "
                            "callbacks, which a republish would start again under new ids")
    conn, direct = _prepare(session_or_connection, app)
    # Consumed by _chain.run, not sent with the first task (task_id names the last step).
    last_task_id = merged.pop("task_id", None)
    for key in ("group_id", "group_index", "chord", "root_id", "parent_id", "producer", "publisher"):
        merged.pop(key, None)
    steps, results = prepare_chain_steps(sig, app, last_task_id)
    for step in steps:
        if type(step) is not Signature:  # pragma: no cover - _refuse_canvas_steps saw them first
            raise OutboxInvalid(f"outbox.enqueue takes {_SUPPORTED}: a chain step is a "
                                f"{type(step).__name__}")
    first = steps.pop()
    # Signature.apply_async: the chain's options over the first step's own (group_id kept).
    args, kwargs, first_options = merged_call(first, merged)
    first_options = _without_callbacks(f"outbox.enqueue({first.task})", first_options)
    task_id = str(first_options.pop("task_id"))
    _insert(conn, direct, app, first.task, args, kwargs, first_options, task_id, steps)
    # _chain.run returns the last step's frozen result (parents linked), or the
    # one task's own result for a chain of one.
    return results[0] if steps else app.AsyncResult(task_id)


def _without_callbacks(where: str, options: dict[str, Any]) -> dict[str, Any]:
    try:
        return without_callbacks(where, options)
    except OptionInvalid as err:
        raise OutboxInvalid(f"{err}; it takes {_SUPPORTED}") from None


def _refuse_canvas_steps(sig: Signature) -> None:
    """Refuse a chain that holds anything but task signatures (nested chains are spliced, as Celery does)."""
    pending = list(sig.tasks or ())
    if not pending:
        raise OutboxInvalid(f"outbox.enqueue takes {_SUPPORTED}, not an empty chain")
    while pending:
        step = maybe_signature(pending.pop(0), app=sig.app)
        if isinstance(step, group) and not is_chord(step):
            # A group of one is that task (Celery unrolls it); anything else runs in parallel.
            step = maybe_unroll_group(step)
        if is_chain(step):
            pending[:0] = list(step.tasks or ())
            continue
        if type(step) is not Signature:
            raise OutboxInvalid(f"outbox.enqueue takes {_SUPPORTED}: a chain holding a "
                                f"{type(step).__name__.lstrip('_')} is not supported (groups and chords "
                                f"are not: only task signatures may be chained)")


def _chain_step(step: Signature) -> dict[str, Any]:
    """A later chain step as the first message's embed carries it: the frozen signature, as JSON."""
    entry = dict(step)
    # Kept as JSON structures (kombu's typed values as their envelopes): the chain is
    # stored with the options, and a worker's kombu decodes the envelopes when it reads the message.
    entry["args"] = json.loads(encode(f"the arguments of {step.task}", list(step.args or ())))
    entry["kwargs"] = json.loads(encode(f"the keyword arguments of {step.task}", dict(step.kwargs or {})))
    entry["options"] = chain_step_options(step.task, step.options or {})
    encode(f"the chain step {step.task}", entry)
    return entry


def _with_reprs(app: Any, options: dict[str, Any], args: list[Any], kwargs: dict[str, Any]) -> None:
    # The message's argsrepr/kwargsrepr (what logs and monitors show), made here
    # as Celery's apply_async makes them in the caller: the relay publishes every
    # producer's rows in one thread, and this repr is a quarter of a message's cost.
    amqp, maxlevels = app.amqp, app.conf.task_repr_maxlevels
    if "argsrepr" not in options:
        options["argsrepr"] = saferepr(args, amqp.argsrepr_maxsize, maxlevels=maxlevels)
    if "kwargsrepr" not in options:
        options["kwargsrepr"] = saferepr(kwargs, amqp.kwargsrepr_maxsize, maxlevels=maxlevels)


def _connection(obj: Any) -> Connection:
    if isinstance(obj, Session):
        # The session's connection, in its current transaction (begun if needed, never committed here).
        return obj.connection()
    if isinstance(obj, Connection):
        return obj
    raise OutboxInvalid(f"outbox.enqueue takes a SQLAlchemy Session or Connection, got {type(obj).__name__}")


def _check_same_database(conn_url: sa.engine.URL, durable_url: str) -> None:
    if database_identity(conn_url) != database_identity(durable_url):
        raise OutboxDatabaseMismatch(
            f"outbox.enqueue needs a session or connection on the durable store's database "
            f"({shown_url(durable_url)}, the app's "
            f"durable_database_url), got one on "
            f"{shown_url(conn_url)}: a row committed elsewhere would never "
            f"be published, and a second transaction would not commit with yours",
            setting="durable_database_url",
        )
