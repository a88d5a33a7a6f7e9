"""A TCP proxy a test owns, to cut its broker or store connections without touching the shared service.

Fault tests never stop a shared Redis, RabbitMQ or PostgreSQL: on a developer's laptop that
kills their broker, and on a shared CI host it breaks every other test running beside it.
Instead the code under test connects through a ``FaultProxy`` and the test breaks the proxy::

    with FaultProxy.for_url(REDIS_URL) as proxy:
        app = Celery(broker=proxy.url_for(REDIS_URL))
        proxy.outage()            # every open connection reset, new ones REFUSED
        proxy.restore()           # accepting and forwarding again
        proxy.drop_connections()  # open connections reset once; new ones still accepted

During an outage a new connection is **refused** (ECONNREFUSED, at once): the listening socket
stops listening but keeps its port (Linux ``shutdown(SHUT_RD)`` on a listener bound to an
explicit port), the symptom a stopped service gives. Where the platform cannot stop listening
that way, a new connection is accepted and reset at once instead (the client's first read or
write fails with ECONNRESET); ``refuses`` says which. Open connections are cut with a TCP RST
by default (``reset=False``: a FIN), so a pooled client's next write fails as it would after a
service restart, instead of finding a readable EOF it may recover from silently.

One thread runs a ``selectors`` loop for the listener and every connection (a celery worker
opens several), so ``close()`` leaves no thread behind. Each direction is forwarded on its own:
an EOF from one side is passed on as a half-close once the bytes before it went out.
"""

from __future__ import annotations

import errno
import queue
import selectors
import socket
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from types import TracebackType
from typing import Self
from urllib.parse import urlsplit, urlunsplit

#: Ports assumed when a URL names none.
DEFAULT_PORTS = {"redis": 6379, "rediss": 6380, "amqp": 5672, "pyamqp": 5672, "amqps": 5671,
                 "postgresql": 5432, "postgres": 5432}

#: Bytes buffered per direction before the proxy stops reading the sender (backpressure).
BUFFER_LIMIT = 256 * 1024

#: How long a control call (outage, restore, drop, close) waits for the loop thread to carry it out.
CONTROL_TIMEOUT = 10.0


def _scheme_port(scheme: str) -> int:
    # "postgresql+psycopg2" -> "postgresql"
    base = scheme.split("+", 1)[0].lower()
    if base not in DEFAULT_PORTS:
        raise ValueError(f"no default port known for scheme {scheme!r}: give the port in the URL")
    return DEFAULT_PORTS[base]


def url_target(url: str) -> tuple[str, int]:
    """The (host, port) a broker or database URL connects to."""
    parts = urlsplit(url)
    host = parts.hostname or "127.0.0.1"
    return host, parts.port or _scheme_port(parts.scheme)


def rewrite_url(url: str, host: str, port: int) -> str:
    """``url`` with its host and port replaced; user, password, path and query kept byte for byte.

    The query is not decoded and re-encoded, so ``?options=-csearch_path%3Dschema`` survives.
    """
    parts = urlsplit(url)
    userinfo, _, _ = parts.netloc.rpartition("@")
    shown = f"[{host}]" if ":" in host else host
    netloc = f"{userinfo}@{shown}:{port}" if userinfo else f"{shown}:{port}"
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


def _reset(sock: socket.socket) -> None:
    """Close with a TCP RST instead of a FIN (SO_LINGER on, zero seconds)."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    sock.close()


@dataclass(eq=False)
class _Pipe:
    """One proxied connection: the client's socket, the upstream socket, a buffer per direction."""

    client: socket.socket
    upstream: socket.socket
    connecting: bool = True
    to_upstream: bytearray = field(default_factory=bytearray)
    to_client: bytearray = field(default_factory=bytearray)
    client_eof: bool = False  # the client sent FIN: pass it on once to_upstream is flushed
    upstream_eof: bool = False
    client_shut: bool = False  # the FIN was passed on (shutdown(SHUT_WR) on the other socket)
    upstream_shut: bool = False

    def done(self) -> bool:
        return self.client_shut and self.upstream_shut


class FaultProxy:
    """Forwards 127.0.0.1:``port`` to ``target_host:target_port`` until told to fail."""

    def __init__(self, target_host: str, target_port: int, *, listen_host: str = "127.0.0.1") -> None:
        self.target = (target_host, target_port)
        self._listener = self._bind(listen_host)
        self.host, self.port = self._listener.getsockname()[:2]
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._commands: queue.SimpleQueue[tuple[Callable[[], None], threading.Event]] = queue.SimpleQueue()
        self._pipes: set[_Pipe] = set()
        self._in_outage = False
        self._closed = False
        self._stop = False
        #: Connections accepted and forwarded since the start (not counting those refused or reset).
        self.accepted = 0
        #: True: during an outage new connections are refused; False: accepted and reset at once.
        self.refuses = True
        self._selector.register(self._listener, selectors.EVENT_READ, "listener")
        self._selector.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._thread = threading.Thread(target=self._loop, name=f"faultproxy-{self.port}", daemon=True)
        self._thread.start()

    @classmethod
    def for_url(cls, url: str) -> FaultProxy:
        """A proxy in front of the host and port ``url`` connects to."""
        return cls(*url_target(url))

    @staticmethod
    def _bind(host: str) -> socket.socket:
        # The port is bound explicitly (not 0): only then does Linux keep it through the
        # shutdown(SHUT_RD) that stops listening during an outage.
        for _ in range(20):
            probe = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            probe.bind((host, 0))
            port = probe.getsockname()[1]
            probe.close()
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind((host, port))
            except OSError:
                # Another socket took the port between the probe and the bind: pick again.
                sock.close()
                continue
            sock.listen(128)
            sock.setblocking(False)
            return sock
        raise OSError(errno.EADDRINUSE, "could not bind a proxy port")

    # -- the test's controls -------------------------------------------------------------
    def url_for(self, url: str) -> str:
        """``url`` rewritten to connect through this proxy; it must name the proxy's target."""
        if url_target(url)[1] != self.target[1]:
            raise ValueError(f"{url} does not connect to this proxy's target {self.target[0]}:{self.target[1]}")
        return rewrite_url(url, self.host, self.port)

    @property
    def connections(self) -> int:
        """Connections open through the proxy right now."""
        return len(self._pipes)

    @property
    def in_outage(self) -> bool:
        return self._in_outage

    def outage(self, *, reset: bool = True) -> None:
        """Cut every open connection and refuse new ones until ``restore()``; done when this returns."""
        self._control(lambda: self._do_outage(reset))

    def restore(self) -> None:
        """Accept and forward new connections again; done when this returns."""
        self._control(self._do_restore)

    def drop_connections(self, *, reset: bool = True) -> None:
        """Cut every open connection once (RST, or FIN with ``reset=False``); new ones are accepted."""
        self._control(lambda: self._drop_all(reset))

    def close(self) -> None:
        """Cut every connection, stop listening and join the loop thread. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._thread.is_alive():
            self._control(self._do_stop)
            self._thread.join(CONTROL_TIMEOUT)
        if self._thread.is_alive():
            raise RuntimeError(f"fault proxy thread on port {self.port} did not stop")
        # Only left if the loop died of an error: its connections must not outlive the proxy.
        for pipe in list(self._pipes):
            self._close_pipe(pipe, reset=True)
        self._selector.close()
        for sock in (self._listener, self._wake_r, self._wake_w):
            sock.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def _control(self, action: Callable[[], None]) -> None:
        if not self._thread.is_alive():
            raise RuntimeError("the fault proxy is closed")
        done = threading.Event()
        self._commands.put((action, done))
        self._wake_w.send(b"x")
        if not done.wait(CONTROL_TIMEOUT):
            raise RuntimeError(f"fault proxy on port {self.port} did not answer within {CONTROL_TIMEOUT}s")

    # -- the loop thread's side ------------------------------------------------------------
    def _do_outage(self, reset: bool) -> None:
        self._in_outage = True
        self._drop_all(reset)
        if self.refuses:
            try:
                self._selector.unregister(self._listener)
                # Linux: the listener stops listening (connects are refused) and keeps its port.
                self._listener.shutdown(socket.SHUT_RD)
            except OSError:
                # Elsewhere: keep accepting and reset each new connection (see _accept).
                self.refuses = False
                self._selector.register(self._listener, selectors.EVENT_READ, "listener")

    def _do_restore(self) -> None:
        if not self._in_outage:
            return
        self._in_outage = False
        if self.refuses:
            self._listener.listen(128)
            self._selector.register(self._listener, selectors.EVENT_READ, "listener")

    def _do_stop(self) -> None:
        self._drop_all(True)
        self._stop = True

    def _drop_all(self, reset: bool) -> None:
        for pipe in list(self._pipes):
            self._close_pipe(pipe, reset=reset)

    def _loop(self) -> None:
        while not self._stop:
            for key, mask in self._selector.select():
                if key.data == "wake":
                    self._run_commands()
                elif key.data == "listener":
                    self._accept()
                elif isinstance(key.data, _Pipe) and key.data in self._pipes:
                    self._service(key.data, key.fileobj, mask)  # type: ignore[arg-type]

    def _run_commands(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except BlockingIOError:
            pass
        while True:
            try:
                action, done = self._commands.get_nowait()
            except queue.Empty:
                return
            try:
                action()
            finally:
                done.set()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return
            if self._in_outage:
                _reset(client)
                continue
            client.setblocking(False)
            upstream = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            upstream.setblocking(False)
            pipe = _Pipe(client, upstream)
            self._pipes.add(pipe)
            self.accepted += 1
            err = upstream.connect_ex(self.target)
            if err not in (0, errno.EINPROGRESS, errno.EWOULDBLOCK):
                # The real service is down: the client sees that as a reset.
                self._close_pipe(pipe, reset=True)
                continue
            self._update(pipe)

    def _service(self, pipe: _Pipe, sock: socket.socket, mask: int) -> None:
        try:
            if pipe.connecting:
                err = pipe.upstream.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
                if err:
                    raise OSError(err, "upstream connect failed")
                pipe.connecting = False
            elif sock is pipe.client:
                self._pump(pipe, mask, from_client=True)
            else:
                self._pump(pipe, mask, from_client=False)
        except OSError:
            # A reset on one side is passed on to the other as a reset.
            self._close_pipe(pipe, reset=True)
            return
        if pipe.done():
            self._close_pipe(pipe, reset=False)
        else:
            self._update(pipe)

    def _pump(self, pipe: _Pipe, mask: int, *, from_client: bool) -> None:
        if mask & selectors.EVENT_READ:
            sock = pipe.client if from_client else pipe.upstream
            try:
                data = sock.recv(65536)
            except (BlockingIOError, InterruptedError):
                data = None
            if data == b"":
                if from_client:
                    pipe.client_eof = True
                else:
                    pipe.upstream_eof = True
            elif data:
                (pipe.to_upstream if from_client else pipe.to_client).extend(data)
        # Send what each side takes now (the rest waits for EVENT_WRITE), then pass an EOF
        # on as a half-close only once the bytes sent before it are out.
        for dst, buf in ((pipe.upstream, pipe.to_upstream), (pipe.client, pipe.to_client)):
            if buf:
                try:
                    sent = dst.send(buf)
                except (BlockingIOError, InterruptedError):
                    sent = 0
                del buf[:sent]
        if pipe.client_eof and not pipe.to_upstream and not pipe.client_shut:
            pipe.upstream.shutdown(socket.SHUT_WR)
            pipe.client_shut = True
        if pipe.upstream_eof and not pipe.to_client and not pipe.upstream_shut:
            pipe.client.shutdown(socket.SHUT_WR)
            pipe.upstream_shut = True

    def _update(self, pipe: _Pipe) -> None:
        if pipe.connecting:
            self._register(pipe.upstream, selectors.EVENT_WRITE, pipe)
            self._register(pipe.client, 0, pipe)
            return
        client_events = ((selectors.EVENT_READ if not pipe.client_eof and len(pipe.to_upstream) < BUFFER_LIMIT
                          else 0) | (selectors.EVENT_WRITE if pipe.to_client else 0))
        upstream_events = ((selectors.EVENT_READ if not pipe.upstream_eof and len(pipe.to_client) < BUFFER_LIMIT
                            else 0) | (selectors.EVENT_WRITE if pipe.to_upstream else 0))
        self._register(pipe.client, client_events, pipe)
        self._register(pipe.upstream, upstream_events, pipe)

    def _register(self, sock: socket.socket, events: int, pipe: _Pipe) -> None:
        try:
            registered = self._selector.get_key(sock)
        except KeyError:
            registered = None
        if events == 0:
            if registered is not None:
                self._selector.unregister(sock)
        elif registered is None:
            self._selector.register(sock, events, pipe)
        elif registered.events != events:
            self._selector.modify(sock, events, pipe)

    def _close_pipe(self, pipe: _Pipe, *, reset: bool) -> None:
        self._pipes.discard(pipe)
        for sock in (pipe.client, pipe.upstream):
            try:
                self._selector.unregister(sock)
            except (KeyError, ValueError):
                pass
            if reset:
                _reset(sock)
            else:
                sock.close()
