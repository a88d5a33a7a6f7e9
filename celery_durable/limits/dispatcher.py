"""The limit dispatcher: publishes parked messages whose turn came, and reclaims leases whose holder died."""

from __future__ import annotations

import logging
import threading
from time import time

from kombu.utils import json as kombu_json

from celery_durable.headers import LIMITS_CHANNEL, SENT_AT_HEADER
from celery_durable.limits.gate import LimitGate
from celery_durable.store import limit_waiting, outage
from celery_durable.store import limits as store
from celery_durable.store.engine import engine_for
from celery_durable.store.notify import Waker


def limits_waker(url: str) -> Waker:
    """The dispatcher's wake-ups: the gate's own, and on PostgreSQL a NOTIFY from any worker's release."""
    engine = engine_for(url)

    def listened(err: BaseException | None) -> None:
        # Its own LISTEN (on the limits channel, for other workers' releases), not the outbox relay's.
        if err is None:
            outage.available(url)
        else:
            outage.failed(url, err, "durable.limit.listen_failed", level=logging.WARNING)

    return Waker(engine if engine.dialect.name == "postgresql" else None, LIMITS_CHANNEL, report=listened)


class LimitDispatcher:
    """One thread per worker over its :class:`LimitGate`.

    Woken at once by this worker's own releases (the gate's ``wake``), by a
    NOTIFY from any worker's (PostgreSQL), and otherwise polls every
    ``poll_interval``; a message booked for a rate turn is published when that
    turn is due. Each round also gives back the leases the gate could not.
    """

    def __init__(self, gate: LimitGate, waker: Waker, *, poll_interval: float, batch_size: int = 100) -> None:
        self.gate = gate
        self.poll_interval = poll_interval
        self.batch_size = batch_size
        self.published = 0
        self._stopping = threading.Event()
        self._waker = waker
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start the thread (once)."""
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="durable-limit-dispatcher", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopping.set()
        self._waker.wake()
        if self._thread is not None:
            self._thread.join(10.0)
        self.gate.give_back_refused()

    def _run(self) -> None:
        gate = self.gate
        next_sweep = 0.0
        try:
            while not self._stopping.is_set():
                self._waker.clear()
                delay = self.poll_interval
                try:
                    gate.give_back_ended()
                    gate.give_back_refused()
                    now = gate.now()
                    if now.timestamp() >= next_sweep:
                        with engine_for(gate.url).begin() as conn:
                            # Declared again each sweep: a worker's declarations outlive a store outage
                            # that let them expire, and a new worker's differing one is noticed here.
                            gate.declare(conn)
                            store.sweep(conn, gate.scope_limits(), gate.lease_ttl, now)
                        next_sweep = now.timestamp() + min(self.poll_interval, gate.lease_ttl / 3.0)
                    more = self.publish_ready()
                    if more:
                        continue
                    with engine_for(gate.url).connect() as conn:
                        due = limit_waiting.next_publish_at(conn)
                    if due is not None:
                        delay = min(delay, max((due - gate.now()).total_seconds(), 0.0))
                except Exception as err:  # noqa: BLE001 - the store or broker is down: the rows stay, try again
                    outage.failed(gate.url, err, "durable.limit.dispatch_failed", level=logging.WARNING)
                else:
                    outage.available(gate.url)
                if delay > 0:
                    self._waker.wait(delay)
        finally:
            self._waker.close()

    def publish_ready(self) -> bool:
        """Publish one batch of due parked messages; True if the batch was full (more may be due)."""
        with engine_for(self.gate.url).begin() as conn:
            ready = limit_waiting.claim_ready(conn, self.batch_size, self.gate.now_in(conn))
            if not ready:
                return False
            with self.gate.app.producer_or_acquire() as producer:
                for row in ready:
                    kept = row.message
                    # Ready again from now: the queue gauges' age counts from this send, not the first.
                    headers = {**kombu_json.loads(kept.headers), SENT_AT_HEADER: time()}
                    producer.publish(
                        kept.body, exchange=kept.exchange, routing_key=kept.routing_key,
                        headers=headers, content_type=kept.content_type,
                        content_encoding=kept.content_encoding, serializer=None, retry=True,
                        **kombu_json.loads(kept.properties),
                    )
            # Published, then forgotten in the same transaction: a crash between the two publishes
            # the message again (at least once), never loses it.
            limit_waiting.forget(conn, [row.id for row in ready])
        self.published += len(ready)
        return len(ready) == self.batch_size
