"""Exchanges across processes for kombu's virtual transport over rows.

kombu's virtual transports keep exchange bindings in each process's memory. The bindings another
process must route by — to a fan-out or topic exchange, or a direct key that is not the queue's own
name (a reply queue's) — are also the backend's rows here (``supports_fanout``, ``_queue_bind``,
``_lookup``, ``_put_fanout``: private hooks of kombu 5.x, pinned by tests/compat/test_virtual_rows.py),
so remote control, replies and task events cross processes as they do on Redis. A queue declared with
``x-expires`` keeps its bindings while this process consumes it (``expiring_bindings``, refreshed by
the transport).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from kombu.transport import virtual
from kombu.transport.base import to_rabbitmq_queue_arguments

#: A kombu routing-table entry: (routing key, pattern or None, queue).
Meta = tuple[str, str | None, str]


@dataclass(frozen=True)
class Binding:
    """A binding other processes route by (the backend keeps it); ``expires_after``: the queue's x-expires."""

    exchange: str
    routing_key: str
    pattern: str | None
    queue: str
    expires_after: float | None



class SharedBindings(Protocol):
    """What a backend keeps for the bindings other processes route by (and the publish a broadcast makes)."""

    def publish(self, items: Sequence[tuple[str, dict[str, Any], int, float]]) -> None:
        """Insert (queue, message, priority, delay seconds) items, all in one statement."""

    def size(self, queue: str) -> int: ...

    def purge(self, queue: str) -> int: ...

    def bind(self, binding: Binding) -> None:
        """Record a binding other processes route by."""

    def unbind(self, queue: str, exchange: str | None = None, routing_key: str | None = None) -> None: ...

    def shared_table(self, exchange: str, *, fresh: bool) -> list[Meta]:
        """The recorded bindings of ``exchange`` as kombu's routing table; ``fresh``: not a cached read."""

    def refresh_bindings(self, consumed: Sequence[Binding]) -> list[str]:
        """Mark ``consumed`` seen now; drop the lapsed bindings of others and their queues' messages."""



class ExchangeChannel(virtual.Channel):
    """A virtual channel whose bindings other processes route by are the backend's."""

    supports_fanout = True

    def __init__(self, connection: Any, **kwargs: Any) -> None:
        #: Seconds of no consumer after which a queue is gone (its ``x-expires``), by queue declared here.
        self._expires: dict[str, float] = {}
        super().__init__(connection, **kwargs)  # type: ignore[no-untyped-call]

    @property
    def rows(self) -> SharedBindings:
        rows: SharedBindings = self.connection.rows
        return rows

    def _item(self, queue: str, message: dict[str, Any]) -> tuple[str, dict[str, Any], int, float]:
        """The backend's publish item for ``message`` on ``queue`` (the row channel's)."""
        raise NotImplementedError

    def prepare_queue_arguments(self, arguments: Any, **kwargs: Any) -> Any:
        """A queue's ``expires`` and ``message_ttl`` as RabbitMQ's ``x-`` arguments (what ``_new_queue`` reads)."""
        return to_rabbitmq_queue_arguments(arguments, **kwargs)

    def _new_queue(self, queue: str, **kwargs: Any) -> None:
        # A queue is rows with its name: nothing to create. Its x-expires (ms) says when its bindings lapse.
        expires = (kwargs.get("arguments") or {}).get("x-expires")
        if expires:
            self._expires[queue] = float(expires) / 1000.0

    # -- exchanges across processes ----------------------------------------------------------------------
    def _queue_bind(self, exchange: str, routing_key: str, pattern: str | None, queue: str) -> None:
        binding = self._shared_binding(exchange, routing_key, pattern, queue)
        if binding is not None:
            self.rows.bind(binding)

    def _shared_binding(self, exchange: str, routing_key: str, pattern: str | None, queue: str) -> Binding | None:
        """The binding as other processes must see it; None for a direct binding under the queue's own name,
        which routes alike in every process that declared the queue (Celery's producers declare theirs)."""
        if self._exchange_type(exchange).type == "direct" and routing_key == queue:
            return None
        return Binding(exchange, routing_key, pattern, queue, self._expires.get(queue))

    def _lookup(self, exchange: str, routing_key: str, default: str | None = None) -> list[str]:
        if not exchange:
            return [routing_key]
        kind = self._exchange_type(exchange)
        if kind.type == "direct":
            # This process's own bindings first (a task queue it declared); a miss reads the shared ones
            # anew: a reply key the asking client bound a moment ago.
            local = self.state.exchanges.get(exchange, {}).get("table", [])
            found = kind.lookup(local, exchange, routing_key, None) \
                or kind.lookup(self.rows.shared_table(exchange, fresh=True), exchange, routing_key, None)
        else:
            found = kind.lookup(self.rows.shared_table(exchange, fresh=kind.type == "fanout"),
                                exchange, routing_key, None)
        if not found:
            # Unroutable: dropped, as RabbitMQ drops an unroutable message that is not mandatory
            # (kombu's dead-letter queue when the transport options name one).
            fallback: str | None = default or self.deadletter_queue
            return [fallback] if fallback else []
        return sorted(found)

    def _exchange_type(self, exchange: str) -> Any:
        """kombu's routing logic for ``exchange`` (as declared in this process; direct if it was not)."""
        return self.typeof(exchange)  # type: ignore[no-untyped-call]

    def _put_fanout(self, exchange: str, message: dict[str, Any], routing_key: str, **kwargs: Any) -> None:
        """A copy for every queue bound to ``exchange`` in any process, in one backend call."""
        queues = sorted({queue for _, _, queue in self.rows.shared_table(exchange, fresh=True)})
        if queues:
            self.rows.publish([self._item(queue, message) for queue in queues])

    def queue_unbind(self, queue: str, exchange: str | None = None, routing_key: str = "",
                     arguments: Any = None, **kwargs: Any) -> None:
        super().queue_unbind(queue, exchange, routing_key, arguments, **kwargs)  # type: ignore[no-untyped-call]
        self.rows.unbind(queue, exchange or "amq.direct", routing_key)

    def queue_delete(self, queue: str, if_unused: bool = False, if_empty: bool = False, **kwargs: Any) -> None:
        if if_empty and self.rows.size(queue):
            return
        bound_here = list(self.state.queue_bindings(queue))
        super().queue_delete(queue, if_unused=if_unused, if_empty=if_empty, **kwargs)  # type: ignore[no-untyped-call]
        if not bound_here:
            self.rows.purge(queue)  # kombu purges a queue once per binding it knows of here: none
        self.rows.unbind(queue)
        self._expires.pop(queue, None)

    def expiring_bindings(self) -> list[Binding]:
        """The shared bindings of the expiring queues this channel consumes: kept alive while it does."""
        consumed = []
        for queue in self._active_queues:
            if queue not in self._expires:
                continue
            for exchange, routing_key, arguments in self.state.queue_bindings(queue):
                _, pattern, _ = self._exchange_type(exchange).prepare_bind(queue, exchange, routing_key, arguments)
                binding = self._shared_binding(exchange, routing_key, pattern, queue)
                if binding is not None:
                    consumed.append(binding)
        return consumed

