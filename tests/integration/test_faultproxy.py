"""The tests' TCP fault proxy against real Redis, RabbitMQ and PostgreSQL, and a local echo server."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator

import amqp
import pytest
import redis
import sqlalchemy as sa

from tests.faultproxy import FaultProxy
from tests.services import (
    AMQP_URL,
    REDIS_URL,
    amqp_problem,
    postgres_url,
    redis_problem,
    require,
)

Factory = Callable[[str], FaultProxy]


def proxy_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("faultproxy-")]


def redis_client(url: str) -> redis.Redis:
    # No retries: the test wants to see each failure, not redis-py riding over it.
    return redis.Redis.from_url(url, socket_connect_timeout=2, socket_timeout=2, retry_on_timeout=False,
                                retry=None)


def test_redis_works_through_the_proxy_fails_in_an_outage_and_works_after_restore(fault_proxy: Factory) -> None:
    require("Redis", redis_problem())
    proxy = fault_proxy(REDIS_URL)
    url = proxy.url_for(REDIS_URL)
    client = redis_client(url)
    assert client.ping() and proxy.connections == 1

    proxy.outage()
    # The open connection was cut, and a new one is refused at once rather than hanging.
    assert proxy.connections == 0
    with pytest.raises(redis.ConnectionError):
        client.ping()
    started = time.monotonic()
    with pytest.raises(redis.ConnectionError, match="refused|Connection reset"):
        redis_client(url).ping()
    assert time.monotonic() - started < 1.0
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", proxy.port), timeout=2)

    proxy.restore()
    assert redis_client(url).ping()
    assert client.ping()  # the pool reconnects on its own


def test_drop_connections_cuts_open_connections_once_and_keeps_accepting(fault_proxy: Factory) -> None:
    require("Redis", redis_problem())
    proxy = fault_proxy(REDIS_URL)
    sock = socket.create_connection(("127.0.0.1", proxy.port), timeout=2)
    sock.sendall(b"PING\r\n")
    assert sock.recv(64) == b"+PONG\r\n"
    proxy.drop_connections()
    # A reset, not an EOF: the next read fails as after a broker restart.
    with pytest.raises(ConnectionResetError):
        sock.recv(64)
    sock.close()
    assert redis_client(proxy.url_for(REDIS_URL)).ping()


def test_postgresql_works_through_the_proxy_fails_in_an_outage_and_works_after_restore(
        fault_proxy: Factory) -> None:
    base = postgres_url()
    proxy = fault_proxy(base)
    engine = sa.create_engine(proxy.url_for(base), connect_args={"connect_timeout": 2}, pool_pre_ping=False)
    try:
        with engine.connect() as conn:
            assert conn.exec_driver_sql("SELECT 1").scalar() == 1
            proxy.outage()
            with pytest.raises(sa.exc.OperationalError):
                conn.exec_driver_sql("SELECT 1")
        started = time.monotonic()
        with pytest.raises(sa.exc.OperationalError, match="refused"), engine.connect():
            pass
        assert time.monotonic() - started < 1.0
        proxy.restore()
        with engine.connect() as conn:
            assert conn.exec_driver_sql("SELECT 1").scalar() == 1
    finally:
        engine.dispose()


def test_rabbitmq_works_through_the_proxy_fails_in_an_outage_and_works_after_restore(
        fault_proxy: Factory) -> None:
    require("RabbitMQ", amqp_problem())
    proxy = fault_proxy(AMQP_URL)
    url = proxy.url_for(AMQP_URL)
    assert amqp_problem(url) is None
    proxy.outage()
    started = time.monotonic()
    # amqp's own connection: kombu's connect() retries after an interval, which is not the proxy's time.
    with pytest.raises(ConnectionRefusedError):
        amqp.Connection(f"127.0.0.1:{proxy.port}", userid="guest", password="guest", connect_timeout=2).connect()
    assert time.monotonic() - started < 1.0
    proxy.restore()
    assert amqp_problem(url) is None


@pytest.fixture
def echo_server() -> Iterator[tuple[str, int]]:
    """A local server that reads until the client's EOF, then sends it all back and closes."""
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.2)
    stopping = threading.Event()
    handlers: list[threading.Thread] = []

    def handle(conn: socket.socket) -> None:
        with conn:
            received = bytearray()
            try:
                while chunk := conn.recv(65536):
                    received.extend(chunk)
                conn.sendall(bytes(received))
            except ConnectionResetError:
                pass  # the proxy cut the connection: what the close test does on purpose

    def serve() -> None:
        while not stopping.is_set():
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            handler = threading.Thread(target=handle, args=(conn,), daemon=True)
            handler.start()
            handlers.append(handler)

    acceptor = threading.Thread(target=serve, daemon=True)
    acceptor.start()
    yield server.getsockname()[:2]
    stopping.set()
    acceptor.join(5)
    for handler in handlers:
        handler.join(5)
    server.close()


def echo(port: int, payload: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(payload)
        # Half-close: the server answers only after our EOF, over the direction still open.
        sock.shutdown(socket.SHUT_WR)
        received = bytearray()
        while chunk := sock.recv(65536):
            received.extend(chunk)
        return bytes(received)


def test_half_close_many_connections_and_large_transfers(echo_server: tuple[str, int]) -> None:
    before = len(proxy_threads())
    with FaultProxy(*echo_server) as proxy:
        big = bytes(range(256)) * 16 * 1024  # 4 MiB: more than the proxy buffers, so backpressure works
        assert echo(proxy.port, big) == big
        results: dict[int, bytes] = {}

        def one(i: int) -> None:
            results[i] = echo(proxy.port, f"conn-{i}-".encode() * 1000)

        workers = [threading.Thread(target=one, args=(i,)) for i in range(64)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join(30)
        assert {i: results.get(i) for i in range(64)} == {i: f"conn-{i}-".encode() * 1000 for i in range(64)}
        assert proxy.accepted == 65
        assert len(proxy_threads()) == before + 1
    assert len(proxy_threads()) == before
    assert proxy.connections == 0


def test_close_cuts_open_connections_and_joins_its_thread(echo_server: tuple[str, int]) -> None:
    before = len(proxy_threads())
    proxy = FaultProxy(*echo_server)
    sock = socket.create_connection(("127.0.0.1", proxy.port), timeout=5)
    sock.sendall(b"unanswered")
    proxy.close()
    proxy.close()  # idempotent
    assert len(proxy_threads()) == before
    with pytest.raises(ConnectionResetError):
        sock.recv(64)
    sock.close()
    with pytest.raises(RuntimeError, match="closed"):
        proxy.outage()


def test_a_target_that_is_down_resets_the_client() -> None:
    probe = socket.create_server(("127.0.0.1", 0))
    dead_port = probe.getsockname()[1]
    probe.close()  # nothing listens there now
    # The proxy resets the client as soon as it cannot reach the target: a fast reset
    # reaches the client while it is still connecting, a slower one at its first read.
    with FaultProxy("127.0.0.1", dead_port) as proxy, pytest.raises(ConnectionResetError), \
            socket.create_connection(("127.0.0.1", proxy.port), timeout=5) as sock:
        sock.recv(64)
