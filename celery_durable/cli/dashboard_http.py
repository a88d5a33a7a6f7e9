"""The dashboard's HTTP server: the Host it answers to, the headers every response carries, bounded connections.

The page can requeue and cancel runs, so it must not be reachable from
another site: a foreign ``Host`` is refused (DNS rebinding points an attacker's
name at 127.0.0.1; the browser then sends that name as the Host), and every
response forbids framing and sniffing and allows only the page's own script
and style. The standard library's server holds a thread per connection for
as long as the client stays silent; here each read times out and the
connections served at once are capped, so idle sockets cannot pile threads up.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import threading
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

logger = logging.getLogger(__name__)

#: Seconds a connection may stay silent (a request not yet sent in full, or none) before it is closed.
IDLE_TIMEOUT = 5.0
#: Connections served at once; one past it is closed as soon as it is accepted.
MAX_CONNECTIONS = 64

#: Only the page's own files: its script and style are served (dashboard.js, dashboard.css), not inline,
#: so no 'unsafe-inline' is needed; it fetches /api/state and posts actions to its own origin.
CONTENT_SECURITY_POLICY = ("default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
                           "img-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
SECURITY_HEADERS = (
    ("Content-Security-Policy", CONTENT_SECURITY_POLICY),
    ("X-Frame-Options", "DENY"),
    ("X-Content-Type-Options", "nosniff"),
    ("Referrer-Policy", "no-referrer"),
)

#: Addresses that mean "every interface": the Host a browser sends is then any address of this machine.
_WILDCARDS = ("", "0.0.0.0", "::")


def _split_host(header: str) -> tuple[str, int | None]:
    """(name, port) of a Host header, lower-cased; the port is None when absent or not a number."""
    header = header.strip().lower()
    if header.startswith("["):  # an IPv6 literal: [::1]:5577
        name, _, rest = header[1:].partition("]")
        port_text = rest[1:] if rest.startswith(":") else ""
    else:
        name, _, port_text = header.partition(":")
    if not port_text:
        return name, None
    return name, int(port_text) if port_text.isdigit() else -1


def host_served(header: str | None, bound_host: str, port: int) -> bool:
    """Whether a request's ``Host`` names this dashboard: 127.0.0.1, localhost or ``--host``, on its port.

    Bound to every interface, any IP literal of the right port is taken as well
    (rebinding needs a name the attacker controls; an address cannot be
    rebound) and this machine's own names.
    """
    if not header:
        return False
    name, given_port = _split_host(header)
    if given_port != port and not (given_port is None and port == 80):
        return False
    names = {"127.0.0.1", "localhost", "::1", bound_host.strip("[]").lower()}
    if bound_host in _WILDCARDS:
        names |= {socket.gethostname().lower(), socket.getfqdn().lower()}
        try:
            ipaddress.ip_address(name)
            return True
        except ValueError:
            pass
    return name in names - {""}


class GuardedHandler(BaseHTTPRequestHandler):
    """A request handler that refuses a foreign Host and sends ``SECURITY_HEADERS`` on every response."""

    #: Applied to the connection's socket by StreamRequestHandler.setup: each read waits this long at most.
    timeout = IDLE_TIMEOUT
    server: DashboardServer

    def parse_request(self) -> bool:
        if not super().parse_request():
            return False
        if host_served(self.headers.get("Host"), self.server.bound_host, self.server.server_port):
            return True
        logger.warning("durable.dashboard.host_refused",
                       extra={"event": "durable.dashboard.host_refused",
                              "host": (self.headers.get("Host") or "")[:200]})
        body = (f"refused: this dashboard answers to Host 127.0.0.1:{self.server.server_port} or "
                f"localhost:{self.server.server_port} only\n").encode()
        self.close_connection = True
        self.send_response(HTTPStatus.MISDIRECTED_REQUEST)
        self.send_header("Content-Type", "text/plain; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Connection", "close")
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)
        return False

    def end_headers(self) -> None:
        # Here rather than in each route: the standard library's own error pages (400, 501, ...) carry them too.
        for name, value in SECURITY_HEADERS:
            self.send_header(name, value)
        super().end_headers()


class DashboardServer(ThreadingHTTPServer):
    """A thread per connection, at most ``max_connections`` of them; one past the cap is closed at once."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], handler: type[GuardedHandler], *,
                 max_connections: int = MAX_CONNECTIONS) -> None:
        super().__init__(address, handler)
        self.bound_host = address[0]
        self._slots = threading.BoundedSemaphore(max_connections)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            logger.warning("durable.dashboard.connections_full",
                           extra={"event": "durable.dashboard.connections_full", "client": str(client_address)})
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()  # the thread never started: its slot is not taken
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()
