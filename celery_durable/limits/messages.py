"""The gate's hands on a broker message: read its arguments, keep it as a waiting row, ack it."""

from __future__ import annotations

from typing import Any

from kombu.utils import json as kombu_json

from celery_durable.compat.host_types import HostMessage
from celery_durable.compat.redis_claim import ack_many
from celery_durable.store.limit_waiting import WaitingMessage

#: Message properties a parked message keeps (the rest are the broker's, per delivery).
KEPT_PROPERTIES = ("priority", "correlation_id", "reply_to", "delivery_mode")


def ack(message: HostMessage) -> None:
    if not message.acknowledged:
        message.ack()


def ack_all(messages: list[HostMessage]) -> None:
    """Ack ``messages``: Redis ones of one channel in one round trip, others one by one."""
    pending = [message for message in messages if not message.acknowledged]
    by_channel: dict[int, list[Any]] = {}
    for message in pending:
        by_channel.setdefault(id(message.channel), []).append(message)
    for group in by_channel.values():
        if group[0].channel.connection.client.transport.driver_type == "redis":
            ack_many(group)
        else:
            for message in group:
                message.ack()


def arguments(message: HostMessage) -> tuple[Any, Any]:
    """The task's (args, kwargs), whichever task protocol sent it."""
    payload = message.decode()
    if isinstance(payload, dict):  # task protocol 1
        return payload.get("args") or (), payload.get("kwargs") or {}
    args, kwargs = payload[0], payload[1]
    return args or (), kwargs or {}


def parked(queue: str, task_id: str, message: HostMessage) -> WaitingMessage:
    """``message`` as the store keeps it while it waits, to be published again unchanged."""
    delivery = message.delivery_info or {}
    properties = message.properties or {}
    body = message.body
    if isinstance(body, str):
        body = body.encode(message.content_encoding or "utf-8")
    return WaitingMessage(
        task_id=task_id,
        queue=queue,
        exchange=delivery.get("exchange") or "",
        routing_key=delivery.get("routing_key") or queue,
        body=bytes(body),
        headers=kombu_json.dumps(message.headers or {}),
        properties=kombu_json.dumps({k: properties[k] for k in KEPT_PROPERTIES if properties.get(k) is not None}),
        content_type=message.content_type or "application/json",
        content_encoding=message.content_encoding or "utf-8",
    )
