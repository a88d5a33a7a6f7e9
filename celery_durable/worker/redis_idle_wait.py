"""The idle wait on Redis: a blocking peek per list that takes nothing, so a killed worker loses nothing.

kombu's push consumer waits with ``BRPOP``, which takes the message off its
list the moment it arrives; the worker records it unacked only after its loop
reads the reply. A worker killed in between (SIGKILL, OOM, a lost host) takes
the only copy with it: nothing in Redis says it ever existed. A SIGKILLed
process keeps its sockets open while the kernel tears it down, long enough for
Redis to hand it the next message, and under load the reply can wait in a
busy loop's socket for as long as the loop is busy.

So the idle wait only watches. Each list it waits on (a queue's priority
lists) has a connection blocked in ``BLMOVE key key RIGHT RIGHT``: Redis
answers when the list has an item and leaves the list as it was. The answer
kicks a claim pass, whose script takes the message and records it unacked in
one step (``compat/redis_claim.py``). Every idle worker waiting on the list is
woken and runs a pass; one takes the message, the others find the list empty
and wait again. That costs a pass per idle worker per message, only while
workers are idle, and loses nothing.

Each connection stays blocked until Redis answers: an answer that comes when
the worker is no longer waiting (it filled up, the queue was cancelled) only
kicks a pass that finds no room, and took nothing from anyone.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

import redis

from celery_durable.compat.host_types import HostChannel, RedisChannel
from celery_durable.compat.redis_channel import is_redis
from celery_durable.compat.redis_claim import open_blocking_connection, prefixed_priority_lists, send_peek, socket_fd

logger = logging.getLogger(__name__)

#: Seconds a peek blocks before Redis answers nil and it is sent again: a
#: connection that died without a reset (a half-open socket) is replaced this soon.
PEEK_TIMEOUT = 10

#: The most lists one worker watches with a connection each (four per queue, kombu's priority
#: steps: 16 queues). A worker waiting on more waits with kombu's BRPOP instead, which needs one
#: connection for them all but keeps its gap; it says so once.
MAX_PEEK_LISTS = 64


class RedisIdleWait:
    """Watches a worker's waitable queues on Redis and calls ``on_wake`` when one has a message."""

    def __init__(self, channel: RedisChannel, hub: Any, on_wake: Callable[[], None]) -> None:
        self._channel = channel
        self._hub = hub
        self._on_wake = on_wake
        self._errors = tuple(channel.connection_errors)
        #: list name -> (its connection, the socket's fd); a list is in ``_blocked`` while its peek waits.
        self._connections: dict[str, tuple[Any, int]] = {}
        self._blocked: set[str] = set()
        #: The queues the worker now waits on, and their lists.
        self._queues: set[str] = set()
        self._wanted: set[str] = set()
        #: False once Redis refused BLMOVE (older than 6.2): the claimer waits with kombu's consumer.
        self.supported = True
        self.wakes = 0
        self._said_too_many = False
        self._lists: dict[str, list[str]] = {}

    @classmethod
    def for_channel(cls, channel: HostChannel, hub: Any, on_wake: Callable[[], None]) -> RedisIdleWait | None:
        """The wait for a Redis ``channel`` in a loop with a hub; None elsewhere (kombu's consumer waits)."""
        if hub is None or not is_redis(channel):
            return None
        return cls(channel, hub, on_wake)

    @property
    def waiting_on(self) -> set[str]:
        return set(self._queues)

    def arm(self, queues: Iterable[str]) -> bool:
        """Wait on ``queues``: a peek on each of their lists that is not already waiting for an answer.

        False, and nothing armed, when Redis refused BLMOVE or the lists are more than
        :data:`MAX_PEEK_LISTS` (a connection each): the claimer waits with kombu's consumer.
        """
        if not self.supported:
            return False
        queues = set(queues)
        wanted = {key for queue in queues for key in self._lists_of(queue)}
        if len(wanted) > MAX_PEEK_LISTS:
            if not self._said_too_many:
                self._said_too_many = True
                logger.warning("durable.idle.redis_too_many_lists lists=%d max=%d: waiting with kombu's BRPOP "
                               "(one connection; a worker killed as a message arrives can lose it)",
                               len(wanted), MAX_PEEK_LISTS,
                               extra={"event": "durable.idle.redis_too_many_lists", "lists": len(wanted),
                                      "max": MAX_PEEK_LISTS})
            return False
        self._queues, self._wanted = queues, wanted
        for key in sorted(wanted - self._blocked):
            self._peek(key)
        return True

    def _lists_of(self, queue: str) -> list[str]:
        # Asked at the end of every pass that leaves room: each queue's names are made once.
        lists = self._lists.get(queue)
        if lists is None:
            lists = self._lists[queue] = prefixed_priority_lists(self._channel, queue)
        return lists

    def disarm(self) -> None:
        """Stop waiting. Peeks already sent stay until Redis answers: an answer then is a harmless kick."""
        self._queues = set()
        self._wanted = set()

    def close(self) -> None:
        self.disarm()
        for key in list(self._connections):
            self._drop(key)

    def _peek(self, key: str) -> None:
        try:
            entry = self._connections.get(key)
            if entry is None:
                connection = open_blocking_connection(self._channel)
                entry = self._connections[key] = (connection, socket_fd(connection))
                self._hub.add_reader(entry[1], self._answered, key)
            send_peek(entry[0], key, PEEK_TIMEOUT)
        except self._errors:
            # The claimer's passes go on (they are what takes messages); the next arm tries again.
            logger.warning("durable.idle.redis_peek_failed list=%s", key, exc_info=True,
                           extra={"event": "durable.idle.redis_peek_failed", "list": key})
            self._drop(key)
            return
        self._blocked.add(key)

    def _answered(self, key: str) -> None:
        entry = self._connections.get(key)
        if entry is None:
            return
        self._blocked.discard(key)
        try:
            item = entry[0].read_response()
        except self._errors:
            logger.warning("durable.idle.redis_peek_lost list=%s", key, exc_info=True,
                           extra={"event": "durable.idle.redis_peek_lost", "list": key})
            self._drop(key)
            self._on_wake()  # the pass it kicks arms again, on a new connection
            return
        except redis.ResponseError as exc:
            if "unknown command" not in str(exc).lower():
                raise
            logger.warning("durable.idle.redis_without_blmove: waiting with kombu's BRPOP instead "
                           "(Redis >= 6.2 keeps a killed worker from taking the message it was handed)",
                           extra={"event": "durable.idle.redis_without_blmove"})
            self.supported = False
            self.close()
            self._on_wake()
            return
        if item is None:
            if key in self._wanted:
                self._peek(key)  # timed out while still waiting: wait again
            return
        # A message is there (still on its list): a pass takes it, and arms again if room is left.
        # Not sent again here: a pass that cannot run now (paused on a store outage) would
        # otherwise be woken at once, over and over, by the message still on the list.
        self.wakes += 1
        self._on_wake()

    def _drop(self, key: str) -> None:
        self._blocked.discard(key)
        entry = self._connections.pop(key, None)
        if entry is None:
            return
        connection, fd = entry
        try:
            # Before the socket closes: its number may be reused by the next socket opened.
            self._hub.remove_reader(fd)
        except Exception:  # a hub already closed polls nothing
            logger.debug("durable.idle.redis_remove_reader_failed", exc_info=True,
                         extra={"event": "durable.idle.redis_remove_reader_failed"})
        try:
            connection.disconnect()
        except Exception:  # closing on the way out; the server drops the peek with it
            logger.debug("durable.idle.redis_disconnect_failed", exc_info=True,
                         extra={"event": "durable.idle.redis_disconnect_failed"})
