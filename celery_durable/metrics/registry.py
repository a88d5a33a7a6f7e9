"""celery_durable's registry and the one HTTP endpoint per process that serves it (``durable_metrics_port``)."""

from __future__ import annotations

import errno
import ipaddress
import logging
import socket
import threading

from prometheus_client import CollectorRegistry, start_http_server

from celery_durable.config import MetricsPort
from celery_durable.errors import ConfigInvalid

logger = logging.getLogger(__name__)

#: The registry celery_durable serves; a user may also register it elsewhere.
REGISTRY = CollectorRegistry(auto_describe=True)

_server_lock = threading.Lock()
_served_on: tuple[str, int] | None = None
_announced = False


def serve(host: str, port: MetricsPort) -> int:
    """Serve REGISTRY (see :func:`bind`) and log where, once per process; returns the port served."""
    global _announced
    served = bind(host, port)
    with _server_lock:
        if _announced:
            return served
        _announced = True
    if _is_wildcard(host):
        logger.warning("durable.metrics.all_interfaces host=%s port=%s: metrics are exposed on every "
                       "interface of this host; set durable_metrics_host to one address to narrow it",
                       host, served,
                       extra={"event": "durable.metrics.all_interfaces", "host": host, "port": served})
    logger.info("durable.metrics.serving host=%s port=%s", host, served,
                extra={"event": "durable.metrics.serving", "host": host, "port": served})
    return served


def bind(host: str, port: MetricsPort) -> int:
    """Start serving REGISTRY on host and the first free port of ``port`` (one, or (first, last)), once per process.

    Returns the port bound. A port in use, or a host that cannot be bound,
    raises ConfigInvalid naming the setting, so the worker refuses to boot in
    one line. Logs nothing: the worker binds at ``worker_init``, before
    Celery has set up logging; :func:`serve` tells where once it has.
    """
    global _served_on
    first, last = (port, port) if isinstance(port, int) else port
    with _server_lock:
        if _served_on is not None:
            return _served_on[1]
        for candidate in range(first, last + 1):
            try:
                start_http_server(candidate, addr=host, registry=REGISTRY)
            except socket.gaierror as err:
                raise ConfigInvalid("durable_metrics_host",
                                    f"must be an IP address or a name that resolves, got {host!r} ({err})") from None
            except OSError as err:
                if err.errno == errno.EADDRINUSE and candidate < last:
                    continue  # another worker on this host took it: try the next port of the range
                if err.errno == errno.EADDRNOTAVAIL:
                    raise ConfigInvalid("durable_metrics_host",
                                        f"must be an address of this host, got {host!r} ({err.strerror})") from None
                raise ConfigInvalid("durable_metrics_port", _bind_failed(host, first, last, candidate, err)) from None
            _served_on = (host, candidate)
            return candidate
    raise AssertionError("unreachable: a range holds at least one port")  # pragma: no cover


def served_port() -> int | None:
    """The port this process serves its metrics on (the one a range gave it), or None when it serves none."""
    with _server_lock:
        return None if _served_on is None else _served_on[1]


def _bind_failed(host: str, first: int, last: int, port: int, err: OSError) -> str:
    reason = err.strerror or str(err)
    if first == last:
        return f"cannot be served on {host}:{port}: {reason} (another worker on this host? give each its " \
               f"own port, or a range such as \"{port}-{min(port + 9, 65535)}\")"
    if err.errno == errno.EADDRINUSE:
        return f"has no free port in {first}-{last} on {host}: every one is in use (widen the range)"
    return f"cannot be served on {host}:{port} (range {first}-{last}): {reason}"


def _is_wildcard(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_unspecified
    except ValueError:
        return False
