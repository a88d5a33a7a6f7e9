"""py-amqp below kombu: the frames the event loop writes in one round leave in one socket write.

Under ``-P durable`` on RabbitMQ the loop thread writes, per task, an early
ack (``basic.ack``, when the pool says the run started) and the ``basic.get``
that claims the next message: each a ``sendall`` of its own in py-amqp, twice
stock Celery's writes per task (issue 28). When both are made in the same hub
round — the ack is a ``call_soon`` callback, the claim pass the freed slot
kicked another — the ack can go out with the get.

So while corked, a frame the loop thread writes is held, and goes out with the
next write on the connection. Nothing that waits holds one back: a frame is
never held past

- a read of the connection (py-amqp reads a reply, or a delivery): the broker
  must have what the reader waits on;
- the hub's ``on_tick``, which kombu's hub runs last before it polls: an ack
  made with no claim after it leaves before the loop can sleep. A held ack is a
  message the broker still counts unacked; it waits microseconds, never a poll;
- a write from another thread (it carries the held frames ahead of its own);
- :meth:`FrameCork.close` (the claimer stops: the hub may not poll again).

A frame held when the connection dies is lost with it, as one written into a
dead socket is: an ack that never reached the broker means a redelivery, the
at-least-once rule.

Touch points (py-amqp 5.x): ``Connection.frame_writer`` (a settable property
``Channel.send_method`` reads on every call), ``method_framing.frame_writer``
(the encoder, built here on a transport whose ``write`` is ours),
``Transport.write`` and ``Transport.read_frame`` (set on the instance: every
read goes through it, ``Connection.blocking_read`` and
``compat.amqp.pipelined_ready_counts`` alike); kombu's ``Hub.on_tick``.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from amqp.method_framing import frame_writer

logger = logging.getLogger(__name__)


def holds_frame(*, corked: bool, writer_thread: int, loop_thread: int) -> bool:
    """Whether a frame written now is held for the connection's next write.

    Only the loop thread's: it alone runs ``on_tick``, so only its frames are
    sure to be flushed before it sleeps. Another thread's write goes at once.
    """
    return corked and writer_thread == loop_thread


class FrameCork:
    """Holds the loop thread's frames on one py-amqp connection until its next write, read or poll.

    Made on the loop thread, for a connection already open; :meth:`close` sends
    what is held and puts the connection's writer and reader back.
    """

    def __init__(self, connection: Any, hub: Any) -> None:
        self._connection = connection
        self._transport = connection.transport
        self._hub = hub
        self._loop_thread = threading.get_ident()
        self._lock = threading.Lock()
        self._held: list[bytes] = []
        self._corked = True
        #: Socket writes made (held frames and the frame carrying them count as one).
        self.writes = 0
        self._plain_writer = connection.frame_writer
        # The encoder writes through ``transport.write`` bound when it is made: one made on a
        # stand-in transport sends its frames here, encoded exactly as py-amqp encodes them.
        self._corked_writer = frame_writer(connection, _WriteTo(self._write))
        connection.frame_writer = self._corked_writer
        self._read_frame = self._transport.read_frame
        self._transport.read_frame = self._flushing_read_frame
        hub.on_tick.add(self.flush)

    def _write(self, data: Any) -> None:
        with self._lock:
            if holds_frame(corked=self._corked, writer_thread=threading.get_ident(),
                           loop_thread=self._loop_thread):
                # A copy: the encoder hands a view of its own buffer, reused by the next frame.
                self._held.append(bytes(data))
                return
            if self._held:
                self._held.append(bytes(data))
                data = self._take_held()
            self.writes += 1
            self._transport.write(data)

    def _take_held(self) -> bytes:
        held, self._held = self._held, []
        return b"".join(held)

    def flush(self) -> None:
        """Send what is held now (the hub's ``on_tick``: last thing before it polls)."""
        if not self._held:  # unlocked: only the loop thread holds frames, and it is the one here
            return
        with self._lock:
            if self._held:
                data = self._take_held()
                self.writes += 1
                self._transport.write(data)

    def _flushing_read_frame(self, *args: Any, **kwargs: Any) -> Any:
        if self._held:
            self.flush()
        return self._read_frame(*args, **kwargs)

    def close(self) -> None:
        """Send what is held and write uncorked from now on (the claimer stopped; the hub may not poll again)."""
        with self._lock:
            self._corked = False
        self._hub.on_tick.discard(self.flush)
        try:
            self.flush()
        except Exception:
            # A dead connection takes what was held with it, as a write into its socket would have: an
            # ack that never reached the broker is a redelivery. The consumer sees the connection's
            # error on its own and reconnects; the claimer's stop goes on (its idle wait, push, watch).
            logger.debug("durable.cork.flush_failed", exc_info=True, extra={"event": "durable.cork.flush_failed"})
        finally:
            if self._connection.frame_writer is self._corked_writer:
                self._connection.frame_writer = self._plain_writer
            self._transport.__dict__.pop("read_frame", None)


class _WriteTo:
    """A stand-in transport for py-amqp's frame encoder: its only use of a transport is ``write``."""

    def __init__(self, write: Any) -> None:
        self.write = write


def cork_for(kombu_connection: Any, hub: Any) -> FrameCork | None:
    """A cork on ``kombu_connection``'s py-amqp connection, if it is one and there is a hub to flush it."""
    if hub is None or getattr(kombu_connection.transport, "driver_type", None) != "amqp":
        return None
    connection = kombu_connection.connection
    if not hasattr(connection, "frame_writer") or not hasattr(getattr(connection, "transport", None), "read_frame"):
        return None  # librabbitmq, not py-amqp
    return FrameCork(connection, hub)
