"""The shapes of the host objects the worker is handed: a kombu message, a Celery request, a kombu channel.

Structural types (``Protocol``) of what celery_durable reads off them, so the
seam is typed without importing the host's classes into every module. Each
names only what the code uses, documented or behind a compat function.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any, Protocol


class HostMessage(Protocol):
    """A kombu ``Message`` as a transport delivers it (documented kombu API)."""

    @property
    def delivery_tag(self) -> Any: ...

    @property
    def delivery_info(self) -> dict[str, Any]: ...

    @property
    def headers(self) -> dict[str, Any]: ...

    @property
    def properties(self) -> dict[str, Any]: ...

    @property
    def body(self) -> Any: ...

    @property
    def content_type(self) -> str | None: ...

    @property
    def content_encoding(self) -> str | None: ...

    @property
    def acknowledged(self) -> bool: ...

    @property
    def errors(self) -> list[Any]: ...

    @property
    def channel(self) -> Any: ...

    def decode(self) -> Any: ...

    def ack(self, multiple: bool = False) -> None: ...

    def reject(self, requeue: bool = False) -> None: ...

    def requeue(self) -> None: ...


class HostRequest(Protocol):
    """A Celery worker ``Request``: the message it was made from and the task it runs."""

    @property
    def id(self) -> str: ...

    @property
    def name(self) -> str: ...

    @property
    def message(self) -> HostMessage: ...

    @property
    def delivery_info(self) -> dict[str, Any]: ...


class HostChannel(Protocol):
    """A kombu channel (any transport): what a fetch, a park or a republish uses of it (kombu's channel API)."""

    @property
    def connection(self) -> Any: ...

    def basic_get(self, queue: str, no_ack: bool = False, **kwargs: Any) -> Any: ...

    def basic_publish(self, message: Any, exchange: str = "", routing_key: str = "", **kwargs: Any) -> Any: ...

    def basic_qos(self, prefetch_size: int, prefetch_count: int, apply_global: bool = False) -> Any: ...

    def message_to_python(self, raw_message: Any) -> Any: ...

    def close(self) -> None: ...


class AmqpChannel(HostChannel, Protocol):
    """py-amqp's channel (RabbitMQ)."""

    @property
    def is_open(self) -> bool: ...


class VirtualChannel(HostChannel, Protocol):
    """A channel of kombu's virtual transports (Redis, SQLAlchemy, memory): the exchange table it routes by."""

    @property
    def state(self) -> Any: ...

    def Message(self, payload: Any, channel: Any = None, **kwargs: Any) -> Any: ...  # kombu's name for its factory

    def get_table(self, exchange: str) -> Any: ...

    def typeof(self, exchange: str, default: str = "direct") -> Any: ...


class RedisChannel(VirtualChannel, Protocol):
    """kombu's Redis ``Channel``: beside a channel's API, the names compat.redis_channel reads."""

    @property
    def connection_errors(self) -> tuple[type[BaseException], ...]: ...

    @property
    def visibility_timeout(self) -> float: ...

    @property
    def qos(self) -> Any: ...

    def conn_or_acquire(self, client: Any = None) -> AbstractContextManager[Any]: ...
