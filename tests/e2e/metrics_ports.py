"""Free ports for workers' metrics endpoints, and reading an endpoint over HTTP."""

from __future__ import annotations

import random
import socket
import urllib.request


def free_port() -> int:
    """A port nothing listens on now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _is_free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def free_ports(count: int, attempts: int = 200) -> list[int]:
    """``count`` consecutive ports nothing listens on now (a metrics port range)."""
    for _ in range(attempts):
        # Below Linux's ephemeral range (32768+): no outgoing connection takes one meanwhile.
        first = random.randrange(20000, 32000 - count)
        ports = list(range(first, first + count))
        if all(_is_free(p) for p in ports):
            return ports
    raise RuntimeError(f"no {count} consecutive free ports found")


def metrics_text(port: int, host: str = "127.0.0.1") -> str:
    """The Prometheus text the endpoint serves."""
    return urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=5).read().decode()
