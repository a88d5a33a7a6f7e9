"""The beat lease's holder token: names the leading replica's host and process, and reads them back.

The lease row's ``holder`` column (64 characters) is the only place the
leader is recorded, so the token carries ``host:pid:nonce`` there rather than
a new column. The nonce keeps two processes apart that share a host name and
a pid (containers on one host network are each pid 1) and a replica that
SIGHUP restarted in place (same pid, a new lease holder). A token an older
replica wrote (a bare uuid hex) still works as a lease holder; it just names
no host or pid.
"""

from __future__ import annotations

import os
import re
import socket
import uuid
from dataclasses import dataclass

#: The lease row's holder column holds this many characters (``schema.beat_leader``).
HOLDER_CHARS = 64
NONCE_CHARS = 12

_NONCE = re.compile(rf"[0-9a-f]{{{NONCE_CHARS}}}")


@dataclass(frozen=True)
class HolderParts:
    host: str
    pid: int


def new_holder(host: str | None = None, pid: int | None = None) -> str:
    """A fresh holder token for this process (``host``/``pid`` given: for tests); a long host name is cut
    so the whole token fits the column."""
    host = socket.gethostname() if host is None else host
    pid = os.getpid() if pid is None else pid
    tail = f":{pid}:{uuid.uuid4().hex[:NONCE_CHARS]}"
    return host[:HOLDER_CHARS - len(tail)] + tail


def holder_parts(token: str) -> HolderParts | None:
    """The host and pid ``token`` names; None for a token that names none (an older replica's)."""
    parts = token.rsplit(":", 2)
    if len(parts) != 3:
        return None
    host, pid_text, nonce = parts
    if not host or not pid_text.isdigit() or not _NONCE.fullmatch(nonce):
        return None
    return HolderParts(host, int(pid_text))
