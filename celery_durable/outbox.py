"""``outbox.enqueue``: add a task to the caller's own SQLAlchemy transaction; the relay publishes it on commit."""

from __future__ import annotations

import json
import uuid
from datetime import datetime, timezone
from typing import Any

import sqlalchemy as sa
from celery.canvas import Signature
from celery.utils.saferepr import saferepr
from sqlalchemy.engine import Connection
from sqlalchemy.orm import Session

from .checkpoints import encode
from .errors import NotJSON, OutboxDatabaseMismatch, OutboxInvalid
from .planning.outbox import OptionInvalid, serialize_options
from .store import outbox as store
from .store.engine import ensure_schema, resolve_url, store_url

__all__ = ["enqueue"]


def enqueue(session_or_connection: Session | Connection, signature: Signature, **options: Any) -> Any:
    """Insert ``signature`` into the outbox in the caller's transaction; returns its ``AsyncResult``.

    Takes the apply_async options a message can keep (queue, routing_key,
    exchange, countdown, eta, expires, priority, headers, time_limit,
    soft_time_limit, shadow, serializer, argsrepr, kwargsrepr, task_id). Never commits: the task is
    published by a relay once, and only if, the caller's transaction commits.
    The session or connection must be on the app's ``durable_database_url``.
    """
    if type(signature) is not Signature:
        # chain/group/chord create task ids of their own at publish: a
        # republish would start those again under new ids.
        raise OutboxInvalid(f"outbox.enqueue takes a task signature (task.s(...)), not a "
                            f"{type(signature).__name__}")
    conn = _connection(session_or_connection)
    app = signature.app
    url = store_url(app)
    _check_same_database(conn.engine.url, url)
    ensure_schema(url)

    merged = {**(signature.options or {}), **options}
    task_id = str(merged.pop("task_id", None) or uuid.uuid4())
    # Celery puts these on signatures it builds; they mean nothing in a message of its own.
    for key in ("task_id", "parent_id", "root_id", "group_id", "group_index", "chord", "reply_to"):
        merged.pop(key, None)
    now = datetime.now(timezone.utc)
    try:
        stored_options = serialize_options(merged, now)
        args = encode(f"the arguments of {signature.task}", list(signature.args or ()))
        kwargs = encode(f"the keyword arguments of {signature.task}", dict(signature.kwargs or {}))
    except (OptionInvalid, NotJSON) as err:
        raise OutboxInvalid(f"outbox.enqueue({signature.task}): {err}") from None
    _with_reprs(app, stored_options, signature)
    store.insert_txn(conn, task_id=task_id, task_name=signature.task, args=args, kwargs=kwargs,
                     options=json.dumps(stored_options), at=now)
    return app.AsyncResult(task_id)


def _with_reprs(app: Any, options: dict[str, Any], signature: Signature) -> None:
    # The message's argsrepr/kwargsrepr (what logs and monitors show), made here
    # as Celery's apply_async makes them in the caller: the relay publishes every
    # producer's rows in one thread, and this repr is a quarter of a message's cost.
    amqp, maxlevels = app.amqp, app.conf.task_repr_maxlevels
    if "argsrepr" not in options:
        options["argsrepr"] = saferepr(list(signature.args or ()), amqp.argsrepr_maxsize, maxlevels=maxlevels)
    if "kwargsrepr" not in options:
        options["kwargsrepr"] = saferepr(dict(signature.kwargs or {}), amqp.kwargsrepr_maxsize,
                                         maxlevels=maxlevels)


def _connection(obj: Any) -> Connection:
    if isinstance(obj, Session):
        # The session's connection, in its current transaction (begun if needed, never committed here).
        return obj.connection()
    if isinstance(obj, Connection):
        return obj
    raise OutboxInvalid(f"outbox.enqueue takes a SQLAlchemy Session or Connection, got {type(obj).__name__}")


def database_identity(url: sa.engine.URL | str) -> tuple[Any, ...]:
    """What makes two URLs the same database: driver and password do not; host, name and options do."""
    parsed = sa.engine.make_url(resolve_url(str(url) if isinstance(url, str) else
                                            url.render_as_string(hide_password=False)))
    backend = parsed.get_backend_name()
    if backend == "sqlite":
        return (backend, parsed.database)
    # ``options`` can carry a search_path: another schema is another set of tables.
    return (backend, parsed.host or "localhost", parsed.port or 5432, parsed.database, parsed.username,
            tuple(sorted((k, str(v)) for k, v in parsed.query.items())))


def _check_same_database(conn_url: sa.engine.URL, durable_url: str) -> None:
    if database_identity(conn_url) != database_identity(durable_url):
        raise OutboxDatabaseMismatch(
            f"outbox.enqueue needs a session or connection on the durable store's database "
            f"({sa.engine.make_url(durable_url).render_as_string(hide_password=True)}, the app's "
            f"durable_database_url), got one on "
            f"{conn_url.render_as_string(hide_password=True)}: a row committed elsewhere would never "
            f"be published, and a second transaction would not commit with yours",
            setting="durable_database_url",
        )
