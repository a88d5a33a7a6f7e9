"""``celery durable status``: the fleet on one screen (``--json`` for scripts).

Workers from remote control (``inspect stats``: each ``-P durable`` worker's
in-flight, capacity and slots per queue), the queues they consume from the
broker (``compat/queue_probe.py``: depth and the oldest ready message's age),
runs by state, dead runs per queue and the outbox backlog from the store.
What cannot be read is named on its own line and the rest is still shown.
Exit status: 0 all read; 1 the broker or the store could not be read, or
the store URL does not parse (named, one line); 2 bad options.
"""

from __future__ import annotations

import json
from datetime import datetime, timezone
from time import time
from typing import Any

import click
from celery.bin.base import CeleryCommand

from celery_durable.cli.group import durable, store_url_of
from celery_durable.cli.options import Seconds
from celery_durable.cli.status_view import FleetSnapshot, QueueView, WorkerView, render


def read_workers(app: Any, timeout: float) -> list[WorkerView]:
    replies = app.control.inspect(timeout=timeout).stats() or {}
    workers = []
    for name, reply in sorted(replies.items()):
        stats = reply.get("durable") if isinstance(reply, dict) else None
        if not stats:
            continue  # a worker of another pool: no durable section
        port = stats.get("metrics_port")
        workers.append(WorkerView(name, int(stats["in_flight"]), int(stats["capacity"]),
                                  dict(stats.get("held_by_queue") or {}), dict(stats.get("queue_slots") or {}),
                                  int(port) if port is not None else None))
    return workers


def read_queues(app: Any, names: list[str], dead: dict[str, int]) -> list[QueueView]:
    from kombu.entity import Queue

    from celery_durable.compat.queue_probe import probe
    from celery_durable.planning.queue_age import oldest_ready_seconds

    views = []
    with app.connection_for_read() as connection:
        channel = connection.channel()
        for name in names:
            if not getattr(channel, "is_open", True):
                channel = connection.channel()  # RabbitMQ closed it: it asked for a queue the broker lacks
            queue = app.amqp.queues[name] if name in app.amqp.queues else Queue(name)
            probed = probe(channel, queue)
            if probed is None:
                views.append(QueueView(name, None, None, dead.get(name, 0)))
                continue
            age = oldest_ready_seconds(probed.depth, probed.heads, time(), probed.ready_for)
            views.append(QueueView(name, probed.depth, age, dead.get(name, 0)))
    return views


def read_store(url: str, snapshot: FleetSnapshot) -> dict[str, int]:
    """Runs by state and the outbox backlog into ``snapshot``; returns dead runs per queue."""
    from celery_durable.store import outbox as store_outbox
    from celery_durable.store import run_reads
    from celery_durable.store.engine import ensure_schema, unavailable_as_error

    with unavailable_as_error(url), ensure_schema(url).connect() as conn:
        snapshot.runs_by_state = run_reads.count_by_state(conn)
        snapshot.outbox_backlog, oldest = store_outbox.backlog(conn)
        dead = run_reads.dead_by_queue(conn)
    if oldest is not None:
        snapshot.outbox_oldest_seconds = max(0.0, (datetime.now(timezone.utc) - oldest).total_seconds())
    return dead


def fleet_snapshot(app: Any, url: str, timeout: float = 1.0) -> FleetSnapshot:
    """Everything ``status`` shows; a part that cannot be read is a line in ``problems``."""
    snapshot = FleetSnapshot()
    dead: dict[str, int] = {}
    try:
        dead = read_store(url, snapshot)
    except Exception as err:  # noqa: BLE001 - shown, and the exit status says so
        snapshot.store_unread = True
        snapshot.problems.append(f"the store could not be read: {str(err).splitlines()[0]}")
    try:
        snapshot.workers = read_workers(app, timeout)
        names = sorted({queue for worker in snapshot.workers for queue in worker.queue_slots})
        snapshot.queues = read_queues(app, names, dead)
    except Exception as err:  # noqa: BLE001 - shown, and the exit status says so
        snapshot.problems.append(f"the broker could not be read: {str(err).splitlines()[0]}")
    return snapshot


@durable.command(cls=CeleryCommand, name="status")
@click.option("--json", "as_json", is_flag=True, help="one JSON document instead of the screen")
@click.option("--timeout", default=1.0, show_default=True, type=Seconds(0.1, 300),
              help="seconds to wait for workers to answer")
@click.pass_context
def status(ctx: click.Context, as_json: bool, timeout: float) -> None:
    """Workers, queues, runs and the outbox, on one screen."""
    app = ctx.find_root().obj.app
    snapshot = fleet_snapshot(app, store_url_of(app), timeout)
    click.echo(json.dumps(snapshot.as_json(), indent=2) if as_json else render(snapshot))
    if snapshot.problems:
        ctx.exit(1)
