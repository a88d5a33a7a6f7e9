"""Redis: a batch's messages stored exactly as kombu's Redis channel stores them, all LPUSHed in one MULTI/EXEC.

Each row goes through Celery's send path up to the transport call
(``task_message.capture_row``); the channel's own pieces then finish it:
``_inplace_augment_message`` (body encoding, delivery tag, delivery_info) and
``_put`` with kombu's publish-batch hook, which records the LPUSH (to the
priority list ``_q_for_pri`` picks) and any PEXPIRE instead of running it.
Only routes kombu resolves to plain lists are batched: the anonymous exchange
(Celery's route for a direct queue) and a direct exchange this channel has
declared, looked up in the binding table once per batch. Fanout, topic,
headers, an exchange this process never declared (kombu would assume
``direct``), or a key bound to no queue: that message takes kombu's own
``basic_publish``, in its place in id order.

All or none: Redis applies a MULTI/EXEC as a whole, so a dropped connection
before EXEC leaves nothing behind, and the batch is retried. Two cases still
deliver twice, each under the same task ids (a durable task's second delivery
is a no-op): a reply to EXEC lost after Redis ran it, and a command Redis
refuses inside EXEC (a queue key holding a non-list), which does not undo the
others but fails the batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from celery_durable.clock import Clock
from celery_durable.compat.host_types import RedisChannel
from celery_durable.compat.kombu_publish import producer_batch_seam_free, record_redis_put, redis_batch_supported
from celery_durable.compat.redis_channel import channel_client
from celery_durable.outbox.publishing.outcome import BatchPublished
from celery_durable.outbox.publishing.task_message import Captured, RowSender
from celery_durable.store.outbox import OutboxRow

#: (command name, arguments) as kombu's Redis channel hands them to a pipeline.
Command = tuple[str, tuple[Any, ...]]


def handles(transport: Any, producer: Any) -> bool:
    """Kombu's Redis transport, new enough to have the publish-batch hook, and safe to batch as configured."""
    if getattr(transport, "driver_type", None) != "redis":
        return False
    return redis_batch_supported(producer.channel) and producer_batch_seam_free(producer)


@dataclass
class _Pending:
    """A row's way out: Redis commands to batch, or (``commands is None``) kombu's per-message publish."""

    captured: Captured
    commands: list[Command] | None


def publish(app: Any, producer: Any, rows: Sequence[OutboxRow], clock: Clock) -> BatchPublished:
    channel: RedisChannel = producer.channel
    sender = RowSender(app, producer, clock)
    # Building first, writing second: a row that cannot be built stops the
    # batch before anything of it is written, and what comes before it goes
    # out as usual.
    pending: list[_Pending] = []
    build_error: BaseException | None = None
    routes: dict[tuple[str, str], frozenset[str]] = {}
    for row in rows:
        try:
            captured = sender.capture(row)
            if captured.channel is not channel:
                raise RuntimeError("the producer changed channel while capturing")
            pending.append(_Pending(captured, commands_for(channel, captured, routes)))
        except Exception as exc:  # noqa: BLE001 - a row that cannot be built defers the row
            build_error = exc
            break
    sent = batched = one_by_one = 0
    start = 0
    while start < len(pending):
        if pending[start].commands is None:
            try:
                item = pending[start].captured
                channel.basic_publish(item.message, **item.publish_kwargs)
            except Exception as exc:  # noqa: BLE001 - the outcome carries the error: the relay retries the rest
                return BatchPublished(sent, exc, batched, one_by_one)
            sender.announce([item])
            sent, one_by_one, start = sent + 1, one_by_one + 1, start + 1
            continue
        end = start
        while end < len(pending) and pending[end].commands is not None:
            end += 1
        try:
            execute(channel, [c for item in pending[start:end] for c in item.commands or ()])
        except Exception as exc:  # noqa: BLE001 - the outcome carries the error: the relay retries the rest
            return BatchPublished(sent, exc, batched, one_by_one)
        sender.announce([item.captured for item in pending[start:end]])
        sent, batched, start = sent + end - start, batched + end - start, end
    return BatchPublished(sent, build_error, batched, one_by_one)


def commands_for(channel: RedisChannel, captured: Captured,
                 routes: dict[tuple[str, str], frozenset[str]]) -> list[Command] | None:
    """The Redis commands kombu's ``basic_publish`` would run for ``captured``; None to leave it to kombu."""
    exchange, routing_key = captured.exchange, captured.routing_key
    queues = _queues(channel, exchange, routing_key, routes)
    if not queues:
        return None
    recorder = _Recorder()
    record_redis_put(channel, captured.message, exchange, routing_key, queues, recorder)
    return recorder.commands


def _queues(channel: RedisChannel, exchange: str, routing_key: str,
            routes: dict[tuple[str, str], frozenset[str]]) -> frozenset[str]:
    if not exchange:
        # The anonymous exchange: kombu puts the message on the list named by the routing key.
        return frozenset([routing_key]) if routing_key else frozenset()
    declared = channel.state.exchanges.get(exchange)
    if declared is None or declared.get("type") != "direct":
        return frozenset()
    key = (exchange, routing_key)
    if key not in routes:
        table = channel.get_table(exchange)
        routes[key] = frozenset(channel.typeof(exchange).lookup(table, exchange, routing_key, None))
    return routes[key]


class _Recorder:
    """Kombu's Redis ``_put`` adds its final commands here (its ``_publish_batch`` hook) instead of running them."""

    def __init__(self) -> None:
        self.commands: list[Command] = []

    def add(self, name: str, *args: Any) -> None:
        self.commands.append((name, args))


def execute(channel: RedisChannel, commands: Sequence[Command]) -> None:
    """Run ``commands`` in one MULTI/EXEC on the channel's own client (key prefix and pool included)."""
    if not commands:
        return
    with channel_client(channel) as client, client.pipeline(transaction=True) as pipe:
        for name, args in coalesce_pushes(commands):
            getattr(pipe, name)(*args)
        pipe.execute()


def coalesce_pushes(commands: Sequence[Command]) -> list[Command]:
    """Consecutive LPUSHes to one list as one LPUSH of all their values, in the same order.

    ``LPUSH key a b`` pushes ``a`` then ``b``: the list ends as after two
    LPUSHes. Inside one MULTI/EXEC nothing can run between them, so the batch
    is stored exactly as before, with one command to send and one reply to
    read per run of pushes instead of one per message.
    """
    runs: list[tuple[str, list[Any]]] = []
    for name, args in commands:
        if name == "lpush" and runs and runs[-1][0] == "lpush" and runs[-1][1][0] == args[0]:
            runs[-1][1].extend(args[1:])
        else:
            runs.append((name, list(args)))
    return [(name, tuple(args)) for name, args in runs]
