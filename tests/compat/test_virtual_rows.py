"""compat.virtual_rows: kombu's virtual transport hooks land on the row backend as the broker needs.

An in-memory backend stands for the rows: each test pins one kombu 5.x path
(publish → ``_put``, ``basic_get`` → ``_get``, ack, reject with and without
requeue, ``restore_unacked`` at channel close, consume → ``drain_events`` →
``_deliver``) to the backend call the PostgreSQL broker relies on.
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Sequence
from typing import Any

import pytest
from kombu import Connection, Exchange, Queue, transport
from kombu.transport import virtual

from celery_durable.compat.row_exchanges import Binding, Meta
from celery_durable.compat.virtual_rows import DELAY_HEADER, RowChannel, RowTransport


class MemoryRows:
    """Rows in a list: (tag, queue, message, priority, delay, holder)."""

    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []
        self.tags = itertools.count(1)
        self.calls: list[tuple[str, Any]] = []
        self.publishes = 0
        self.waits = 0
        self.notified: set[str] = set()
        self.bindings: dict[tuple[str, str, str], Binding] = {}
        self._read_fd, self._write_fd = os.pipe()
        os.set_blocking(self._read_fd, False)

    def publish(self, items: Sequence[tuple[str, dict[str, Any], int, float]]) -> None:
        self.publishes += 1
        for queue, message, priority, delay in items:
            self.rows.append({"tag": next(self.tags), "queue": queue, "message": message, "priority": priority,
                              "delay": delay, "held": False})

    def claim(self, queue: str, limit: int) -> list[dict[str, Any]]:
        taken = []
        for row in self.rows:
            if len(taken) == limit:
                break
            if row["queue"] == queue and not row["held"]:
                row["held"] = True
                message = dict(row["message"], properties=dict(row["message"]["properties"], delivery_tag=row["tag"]))
                taken.append(message)
        self.calls.append(("claim", (queue, limit)))
        return taken

    def take(self, queue: str, limit: int) -> list[dict[str, Any]]:
        taken = self.claim(queue, limit)
        for message in taken:
            self.rows = [row for row in self.rows if row["tag"] != message["properties"]["delivery_tag"]]
        self.calls.append(("take", (queue, limit)))
        return taken

    def ack(self, tag: Any) -> None:
        self.calls.append(("ack", tag))
        self.rows = [row for row in self.rows if row["tag"] != tag]

    def give_back(self, tag: Any) -> None:
        self.calls.append(("give_back", tag))
        for row in self.rows:
            if row["tag"] == tag:
                row["held"] = False

    def size(self, queue: str) -> int:
        return sum(row["queue"] == queue for row in self.rows)

    def ping(self) -> None:
        self.calls.append(("ping", None))

    def purge(self, queue: str) -> int:
        before = len(self.rows)
        self.rows = [row for row in self.rows if row["queue"] != queue or row["held"]]
        return before - len(self.rows)

    def clear_wakeups(self) -> None:
        pass

    def wait(self, timeout: float) -> bool:
        self.waits += 1
        return False

    def wake(self) -> None:
        self.calls.append(("wake", None))
        os.write(self._write_fd, b"x")

    def notify(self, queue: str) -> None:
        """What the insert trigger's NOTIFY does: the LISTEN socket turns readable, naming ``queue``."""
        self.notified.add(queue)
        os.write(self._write_fd, b"n")

    def wakeup_fds(self) -> list[int]:
        return [self._read_fd]

    def take_wakeups(self) -> tuple[bool, set[str]]:
        data = b""
        try:
            while chunk := os.read(self._read_fd, 4096):
                data += chunk
        except BlockingIOError:
            pass
        notified, self.notified = self.notified, set()
        return b"x" in data, notified

    def bind(self, binding: Binding) -> None:
        self.bindings[(binding.exchange, binding.routing_key, binding.queue)] = binding

    def unbind(self, queue: str, exchange: str | None = None, routing_key: str | None = None) -> None:
        self.bindings = {key: b for key, b in self.bindings.items()
                         if not (b.queue == queue and exchange in (None, b.exchange)
                                 and routing_key in (None, b.routing_key))}

    def shared_table(self, exchange: str, *, fresh: bool) -> list[Meta]:
        return [(b.routing_key, b.pattern, b.queue) for b in self.bindings.values() if b.exchange == exchange]

    def refresh_bindings(self, consumed: Sequence[Binding]) -> list[str]:
        self.calls.append(("refresh_bindings", sorted(b.queue for b in consumed)))
        return []

    def close(self) -> None:
        self.calls.append(("close", None))


BACKEND = MemoryRows()


class MemoryTransport(RowTransport):
    polling_interval = 0.01

    def open_rows(self) -> MemoryRows:
        return BACKEND


@pytest.fixture
def conn(monkeypatch: pytest.MonkeyPatch) -> Any:
    global BACKEND
    BACKEND = MemoryRows()
    monkeypatch.setitem(transport.TRANSPORT_ALIASES, "rows-memory", f"{__name__}:MemoryTransport")
    with Connection("rows-memory://") as connection:
        yield connection


QUEUE = Queue("q", Exchange("q"), "q")


def _publish(conn: Any, body: Any, **kwargs: Any) -> None:
    conn.Producer().publish(body, exchange=QUEUE.exchange, routing_key="q", declare=[QUEUE], **kwargs)


def test_the_hooks_kombu_calls_are_on_its_virtual_channel() -> None:
    for name in ("_get", "_put", "_size", "_purge", "_delete", "_new_queue", "_has_queue", "_restore",
                 "_restore_at_beginning", "_get_message_priority", "_inplace_augment_message", "_lookup"):
        assert name in vars(virtual.Channel) or name in vars(virtual.base.AbstractChannel), name
        # Filled by one of our channel classes (RowChannel, or ExchangeChannel under it), not kombu's own.
        ours = [cls for cls in RowChannel.__mro__ if cls.__module__.startswith("celery_durable.")]
        assert any(name in vars(cls) for cls in ours) \
            or name in ("_get_message_priority", "_inplace_augment_message", "_lookup"), name
    assert "_deliver" in vars(virtual.Transport)


def test_publish_is_one_backend_put_with_priority_and_the_delay_header(conn: Any) -> None:
    _publish(conn, {"n": 1}, priority=7, headers={DELAY_HEADER: 1500})
    (row,) = BACKEND.rows
    assert (row["queue"], row["priority"], row["delay"]) == ("q", 7, 1.5)
    assert row["message"]["properties"]["delivery_info"]["routing_key"] == "q"


def test_basic_publish_many_is_one_backend_call(conn: Any) -> None:
    channel = conn.default_channel
    QUEUE(channel).declare()
    messages = [channel.prepare_message(channel.encode_body(f'"{i}"')[0]) for i in range(5)]
    channel.basic_publish_many(messages, "q", "q")
    assert BACKEND.publishes == 1
    assert len(BACKEND.rows) == 5


def test_basic_get_claims_one_and_ack_deletes_it(conn: Any) -> None:
    _publish(conn, {"n": 1})
    message = QUEUE(conn.default_channel).get()
    assert message.payload == {"n": 1}
    assert ("claim", ("q", 1)) in BACKEND.calls
    message.ack()
    assert ("ack", message.delivery_tag) in BACKEND.calls
    assert BACKEND.rows == []


def test_reject_with_requeue_gives_back_in_place_and_without_deletes(conn: Any) -> None:
    _publish(conn, {"n": 1})
    _publish(conn, {"n": 2})
    first = QUEUE(conn.default_channel).get()
    first.reject(requeue=True)
    assert ("give_back", first.delivery_tag) in BACKEND.calls
    assert [row["tag"] for row in BACKEND.rows] == [first.delivery_tag, first.delivery_tag + 1]
    again = QUEUE(conn.default_channel).get()
    assert again.delivery_tag == first.delivery_tag  # its place kept: taken before the second
    again.reject(requeue=False)
    assert ("ack", again.delivery_tag) in BACKEND.calls
    assert len(BACKEND.rows) == 1


def test_channel_close_gives_back_what_it_holds_unacked(conn: Any) -> None:
    _publish(conn, {"n": 1})
    channel = conn.channel()
    message = QUEUE(channel).get()
    channel.close()
    assert ("give_back", message.delivery_tag) in BACKEND.calls
    assert not BACKEND.rows[0]["held"]


def test_consume_drains_by_claiming_up_to_the_prefetch_room(conn: Any) -> None:
    for n in range(5):
        _publish(conn, {"n": n})
    got: list[Any] = []
    with conn.Consumer(QUEUE, callbacks=[lambda body, message: got.append(message)], prefetch_count=3):
        conn.drain_events(timeout=1)
        assert [m.payload["n"] for m in got] == [0, 1, 2]
        assert ("claim", ("q", 3)) in BACKEND.calls
        # The QoS is full: the next drain claims nothing and times out after waiting on the backend.
        with pytest.raises(TimeoutError):
            conn.drain_events(timeout=0.05)
        assert BACKEND.waits >= 1
        got[0].ack()
        conn.drain_events(timeout=1)
        assert [m.payload["n"] for m in got] == [0, 1, 2, 3]


def test_fanout_direct_and_topic_exchanges_so_celery_runs_remote_control(conn: Any) -> None:
    assert conn.supports_exchange_type("fanout")
    assert conn.supports_exchange_type("direct")
    assert conn.supports_exchange_type("topic")


def test_the_names_fan_out_rides_on_are_kombus() -> None:
    # kombu calls _queue_bind for every binding and _put_fanout for a fan-out publish only when the
    # channel says supports_fanout; basic_consume keeps _tag_to_queue; queue_declare asks the channel to
    # prepare the queue's arguments (its x-expires); the state lists a queue's bindings.
    assert virtual.Channel.supports_fanout is False and RowChannel.supports_fanout is True
    assert "_put_fanout" in virtual.exchange.FanoutExchange.deliver.__code__.co_names
    assert "_queue_bind" in virtual.Channel.queue_bind.__code__.co_names
    assert "_tag_to_queue" in virtual.Channel.basic_consume.__code__.co_names
    assert "prepare_queue_arguments" in Queue.queue_declare.__code__.co_names
    assert callable(virtual.base.BrokerState().queue_bindings)


def test_a_broadcast_from_one_connection_reaches_the_queue_another_bound(conn: Any,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    # Two kombu connections share BACKEND (two processes on one database); each has its own bindings.
    broadcast = Exchange("ctl", "fanout", auto_delete=True)
    pidbox = Queue("w1.ctl", broadcast, expires=10.0, auto_delete=True)
    with Connection("rows-memory://") as worker:
        pidbox(worker.default_channel).declare()
        assert list(BACKEND.bindings.values()) == [Binding("ctl", "", None, "w1.ctl", 10.0)]
        conn.Producer().publish({"method": "ping"}, exchange=broadcast, declare=[broadcast])
        assert [row["queue"] for row in BACKEND.rows] == ["w1.ctl"]
        received: list[Any] = []
        with worker.Consumer([pidbox], callbacks=[lambda body, message: received.append(body)], no_ack=True):
            worker.drain_events(timeout=1)
        assert received == [{"method": "ping"}]
        assert BACKEND.rows == []  # consumed without acks: acked as delivered
        assert ("refresh_bindings", ["w1.ctl"]) in BACKEND.calls  # a consumer of an expiring queue keeps it
        pidbox(worker.default_channel).delete()
        assert BACKEND.bindings == {}


def test_wake_ends_a_drain_at_once_so_a_loop_without_a_hub_runs_its_queued_kicks(conn: Any) -> None:
    import time

    conn.connect()
    conn.transport.wake()
    started = time.monotonic()
    with pytest.raises(TimeoutError):
        conn.drain_events(timeout=5)
    assert time.monotonic() - started < 1.0
    assert ("wake", None) in BACKEND.calls
    # Once: the next drain waits its time out again.
    started = time.monotonic()
    with pytest.raises(TimeoutError):
        conn.drain_events(timeout=0.2)
    assert time.monotonic() - started >= 0.2


@pytest.mark.parametrize(("headers", "expected"), [
    ({}, 0.0),
    ({DELAY_HEADER: 1500}, 1.5),
    ({"eta": "2026-12-05T10:00:03+00:00"}, 3.0),
    ({"eta": "2026-12-05T10:00:03"}, 3.0),  # no zone: UTC, Celery's default enable_utc
    ({"eta": "2026-12-05T11:00:03+01:00"}, 3.0),
    ({"eta": "2026-12-05T09:59:00+00:00"}, 0.0),  # already due
    ({"eta": "2026-12-05T10:00:03+00:00", DELAY_HEADER: 5000}, 5.0),  # the later of the two
    ({"eta": "not a time"}, 0.0),
    ({"eta": None}, 0.0),
])
def test_a_celery_eta_or_x_delay_header_is_the_rows_delay(headers: dict[str, Any], expected: float) -> None:
    from datetime import datetime, timezone

    from celery_durable.compat.virtual_rows import delivery_delay

    now = datetime(2026, 12, 5, 10, 0, 0, tzinfo=timezone.utc).timestamp()
    assert delivery_delay(headers, now) == pytest.approx(expected)


def test_in_celerys_event_loop_a_notify_of_a_consumed_queue_claims_at_once_and_an_ack_claims_again(
        conn: Any) -> None:
    from kombu.asynchronous import Hub

    assert conn.transport.implements.asynchronous  # Celery gives the worker a hub
    hub = Hub()
    got: list[Any] = []
    other = Queue("other", Exchange("other"), "other")
    conn.connect()
    conn.transport.polling_interval = 60  # only a wake-up can explain a claim
    with conn.Consumer([QUEUE], callbacks=[lambda body, m: got.append(m)], prefetch_count=1):
        conn.transport.register_with_event_loop(conn.connection, hub)
        loop = hub.create_loop()

        def spin_until(condition: Any) -> None:
            deadline = time.monotonic() + 5
            while not condition():
                assert time.monotonic() < deadline
                next(loop)

        conn.Producer().publish("elsewhere", exchange=other.exchange, routing_key="other", declare=[other])
        BACKEND.notify("other")  # not a queue this consumer reads: no claim
        claims = [c for c in BACKEND.calls if c[0] == "claim"]
        spin_until(lambda: not BACKEND.notified)
        assert [c for c in BACKEND.calls if c[0] == "claim"] == claims
        _publish(conn, "one")
        _publish(conn, "two")
        BACKEND.notify("q")
        spin_until(lambda: len(got) == 1)
        assert got[0].payload == "one"
        got[0].ack()  # the prefetch room it frees claims again, through the hub
        spin_until(lambda: len(got) == 2)
        assert got[1].payload == "two"
    hub.close()
