"""What a test asks a running worker over its remote-control mailbox: ping, ``inspect stats``, the durable section."""

from __future__ import annotations

import socket
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from celery import Celery
from kombu.exceptions import OperationalError

from tests.e2e.waiting import wait_for

if TYPE_CHECKING:
    from tests.e2e.harness import Scenario


class RemoteControlled:
    """The remote-control side of a test's worker process (tests/e2e/harness.py's ``WorkerProcess``)."""

    #: The worker's ``-n`` (``%h`` for this host), its test's scenario, the broker it was started on and that
    #: broker's transport options (a ``global_keyprefix`` moves its mailbox too).
    name: str
    scenario: Scenario
    _broker_url: str
    _transport_options: dict[str, Any] | None
    _own_control: Celery | None

    @property
    def hostname(self) -> str:
        """The node name the worker answers remote control as (``-n`` with ``%h`` expanded)."""
        return self.name.replace("%h", socket.gethostname())

    def stats(self, timeout: float = 2.0) -> dict[str, Any] | None:
        """This worker's ``celery inspect stats`` reply; None if it did not answer within ``timeout``."""
        replies = self._broadcast(lambda control: control.inspect(destination=[self.hostname], timeout=timeout,
                                                                  limit=1).stats()) or {}
        return replies.get(self.hostname)

    def durable_stats(self, timeout: float = 2.0) -> dict[str, Any]:
        """The ``durable`` section of ``inspect stats``; fails if the worker does not answer."""
        reply = self.stats(timeout)
        if reply is None:
            raise AssertionError(f"{self.hostname} did not answer inspect stats within {timeout}s")
        return dict(reply["durable"])

    def wait_durable(self, condition: Callable[[dict[str, Any]], Any], *, timeout: float,
                     what: str) -> dict[str, Any]:
        """Poll the ``durable`` stats until ``condition(stats)``; fail naming the last stats seen."""
        seen: list[dict[str, Any]] = []

        def check() -> dict[str, Any] | None:
            reply = self.stats()
            if reply is None:  # a missed reply is one more poll, not the answer; the deadline still holds
                return None
            stats = dict(reply["durable"])
            seen[:] = [stats]
            return stats if condition(stats) else None

        try:
            return wait_for(check, timeout=timeout, what=what, every=0.1)
        except AssertionError as err:
            raise AssertionError(f"{err}; last durable stats: {seen[-1] if seen else None}") from None

    @property
    def has_remote_control(self) -> bool:
        """kombu's SQLAlchemy transport keeps fanout bindings in each process, and the PostgreSQL broker has
        no fan-out yet (issue 26): no broadcast reaches a worker."""
        return not self._broker_url.startswith(("sqla", "durable+"))

    def control_app(self) -> Celery:
        """An app whose broadcasts reach this worker: the scenario's (on the broker itself, even when the
        worker goes through a fault proxy), unless the worker's keys have a ``global_keyprefix`` (its
        mailbox's keys have it too)."""
        options = self._transport_options or {}
        if not options.get("global_keyprefix"):
            return self.scenario.producer
        if self._own_control is None:
            self._own_control = Celery("e2e-control", broker=self.scenario.broker_url, set_as_current=False)
            self._own_control.conf.broker_transport_options = options
        return self._own_control

    def _broadcast(self, ask: Callable[[Any], Any]) -> Any:
        """``ask(control)`` on the app whose broadcasts reach this worker, on a fresh connection if need be.

        kombu pools connections process-wide by URL, so a broadcast may be handed a pooled connection an
        earlier test of this process left idle and the broker has since dropped (stop 22's CI: "connection
        reset" on a ping's first write). Celery's broadcast does not retry: the pools are reset and the
        broadcast is sent once more, on a new connection.
        """
        try:
            return ask(self.control_app().control)
        except (ConnectionError, OSError, OperationalError):
            self.scenario.reconnect_producer()
            self._close_control()
            return ask(self.control_app().control)

    def answers_ping(self, timeout: float = 1.0) -> bool:
        """Whether this worker's remote-control mailbox answered a ``ping`` within ``timeout``."""
        replies = self._broadcast(lambda control: control.ping(destination=[self.hostname], timeout=timeout,
                                                               limit=1))
        return any(self.hostname in reply for reply in replies or [])

    def _close_control(self) -> None:
        if self._own_control is not None:
            self._own_control.close()
            self._own_control = None
