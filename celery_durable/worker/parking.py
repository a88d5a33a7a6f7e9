"""Poison messages: moved aside to ``<queue>.durable.parked`` and logged, never fatal to the worker.

A message whose content cannot be decoded (not JSON, a body that is not
base64, a content type or encoding nobody accepts, a payload Celery's
strategy chokes on) would otherwise crash the worker, or be acked and lost
(stock Celery's ``on_decode_error``). Parking keeps it, byte for byte where
the broker allows, where an operator can read it:

- Redis: the list ``<queue>.durable.parked`` (``LRANGE``), raw items as popped;
- RabbitMQ: the durable queue ``<queue>.durable.parked``, body, properties and
  headers as delivered, plus ``x-durable-parked-from`` and ``-reason`` headers;
- kombu's virtual transports (the embedded SQLAlchemy broker): the queue
  ``<queue>.durable.parked`` on the same transport.
"""

from __future__ import annotations

import json
import logging
from typing import Any, Protocol

from kombu.utils.encoding import bytes_to_str, str_to_bytes

from celery_durable.compat.host_types import HostChannel, HostMessage, RedisChannel, VirtualChannel
from celery_durable.compat.redis_channel import channel_client, is_redis
from celery_durable.compat.redis_claim import forget_unacked
from celery_durable.compat.transport_guards import message_raw, put_raw
from celery_durable.headers import PARKED_FROM_HEADER, PARKED_REASON_HEADER, PARKED_SUFFIX

logger = logging.getLogger(__name__)

#: How much of a parked item the log shows: enough to recognise it, not a whole payload.
HEAD_BYTES = 200


def parked_name(queue: str) -> str:
    """Where ``queue``'s poison messages go (a Redis list or a broker queue)."""
    return f"{queue}{PARKED_SUFFIX}"


def head(raw: Any) -> str:
    """The first ``HEAD_BYTES`` bytes of ``raw``, repr'd (safe to log whatever the bytes are)."""
    if raw is None:
        return "None"
    if not isinstance(raw, (bytes, str)):
        raw = repr(raw)
    return repr(str_to_bytes(raw)[:HEAD_BYTES])


def log_parked(queue: str, raw: Any, reason: str) -> None:
    shown = head(raw)
    logger.error(
        "durable.message.parked queue=%s parked_to=%s reason=%s head=%s",
        queue, parked_name(queue), reason, shown,
        extra={"event": "durable.message.parked", "queue": queue, "parked_to": parked_name(queue), "reason": reason,
               "head": shown},
    )


def undecodable(message: HostMessage) -> str | None:
    """Why Celery could not decode ``message``'s body, or None if it can.

    The body is decoded here, before Celery's strategy sees the message;
    kombu caches the result (``Message.payload``), so the strategy does not
    decode it a second time.
    """
    if message.errors:
        # kombu keeps a decompression failure until someone re-raises it.
        return f"cannot decompress: {message.errors[0][1]!r}"
    try:
        message.decode()
    except Exception as exc:  # noqa: BLE001 - any failure to decode is the content's fault
        return f"cannot decode: {exc!r}"
    return None


class Parker(Protocol):
    def park(self, queue: str, message: HostMessage, reason: str) -> None:
        """Copy a delivered message to the parked place, log it, then ack it."""
        ...


class RedisParker:
    """Redis: the message's raw item goes on the list ``<queue>.durable.parked``."""

    def __init__(self, channel: RedisChannel) -> None:
        self._channel = channel

    def park(self, queue: str, message: HostMessage, reason: str) -> None:
        raw = json.dumps(message_raw(message))
        with channel_client(self._channel) as client:
            client.lpush(parked_name(queue), raw)
        log_parked(queue, raw, reason)
        # After the push: a crash between the two leaves it parked and still
        # unacked, so it is restored and parked again, never lost.
        message.ack()


class AmqpParker:
    """RabbitMQ: the message is republished, confirmed, to the durable queue ``<queue>.durable.parked``."""

    def __init__(self, connection: Any) -> None:
        self._connection = connection
        self._channel: Any = None
        self._declared: set[str] = set()

    def _confirming_channel(self) -> Any:
        if self._channel is None or not getattr(self._channel, "is_open", True):
            self._channel = self._connection.channel()
            self._channel.confirm_select()
            self._declared.clear()
        return self._channel

    def park(self, queue: str, message: HostMessage, reason: str) -> None:
        from amqp import Message as AmqpMessage

        channel = self._confirming_channel()
        target = parked_name(queue)
        if target not in self._declared:
            channel.queue_declare(queue=target, durable=True, auto_delete=False)
            self._declared.add(target)
        properties = dict(message.properties)
        headers = dict(properties.get("application_headers") or {})
        if not message.errors:
            # kombu decompressed the body on delivery: the copy is not compressed.
            headers.pop("compression", None)
        headers[PARKED_FROM_HEADER] = queue
        headers[PARKED_REASON_HEADER] = reason[:1000]
        properties["application_headers"] = headers
        properties["delivery_mode"] = 2
        body = message.body if isinstance(message.body, bytes) else str_to_bytes(message.body or "")
        # Confirmed before the original is acked: an unconfirmed copy could be
        # lost while the ack is not.
        channel.basic_publish_confirm(AmqpMessage(body, **properties), exchange="", routing_key=target)
        log_parked(queue, body, reason)
        message.ack()


class VirtualParker:
    """kombu's virtual transports (the SQLAlchemy broker): the payload goes to the queue ``<queue>.durable.parked``."""

    def __init__(self, channel: HostChannel) -> None:
        self._channel = channel

    def park(self, queue: str, message: HostMessage, reason: str) -> None:
        put_raw(self._channel, parked_name(queue), message_raw(message))
        log_parked(queue, json.dumps(message_raw(message)), reason)
        message.ack()


def parker_for(connection: Any, channel: HostChannel) -> Parker:
    if is_redis(channel):
        return RedisParker(channel)
    if connection.transport.driver_type == "amqp":
        return AmqpParker(connection)
    return VirtualParker(channel)


def envelope(channel: VirtualChannel, raw: Any) -> tuple[Any, str | None]:
    """A virtual transport's raw item as the channel's Message, or None and why it is not one.

    kombu would raise out of its read (taking the worker down) on an item
    that is not JSON, lacks ``properties``, or has a body its
    ``body_encoding`` cannot decode (not base64).
    """
    try:
        payload = json.loads(bytes_to_str(raw))
        return channel.Message(payload, channel=channel), None
    except Exception as exc:  # noqa: BLE001 - whatever the content breaks, it is the content's fault
        return None, f"not a kombu message: {exc!r}"


def park_redis_items(client: Any, qos: Any, queue: str, items: list[tuple[Any, Any, str]]) -> None:
    """Push popped ``(raw, delivery_tag, reason)`` items to the parked list; forget their unacked records.

    One pipeline: the parked copy and the removal from kombu's unacked hash
    and index go together, so the restorer never puts a parked item back.
    """
    with client.pipeline() as pipe:
        for raw, tag, _ in items:
            pipe.lpush(parked_name(queue), raw)
            if tag is not None:
                forget_unacked(pipe, qos, tag)
        pipe.execute()
    for raw, _, reason in items:
        log_parked(queue, raw, reason)


class _ParkingPolicy:
    """This module's parking, as the transport guards take it (``compat.transport_guards.PoisonPolicy``)."""

    envelope = staticmethod(envelope)
    park_redis_items = staticmethod(park_redis_items)
    parked_name = staticmethod(parked_name)
    log_parked = staticmethod(log_parked)


POISON_POLICY = _ParkingPolicy()
