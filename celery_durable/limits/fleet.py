"""FleetLimits: one worker's gate and dispatcher, built together, started once, stopped together."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from celery_durable.clock import SYSTEM_CLOCK, Clock
from celery_durable.config import DurableConfig
from celery_durable.limits.dispatcher import LimitDispatcher, limits_waker
from celery_durable.limits.gate import LimitGate
from celery_durable.planning.limit_declarations import TaskLimits
from celery_durable.store.engine import resolve_url


class FleetLimits:
    """The one owner of the fleet-limit parts' lifecycle: the worker starts it before its first claim and
    stops it when it leaves; the claimer and the runtime use :attr:`gate`."""

    def __init__(self, app: Any, limits: Mapping[str, TaskLimits], *, url: str, lease_ttl: float,
                 poll_interval: float, clock: Clock = SYSTEM_CLOCK) -> None:
        self._waker = limits_waker(url)
        self.gate = LimitGate(app, limits, url=url, lease_ttl=lease_ttl, wake=self._waker.wake, clock=clock)
        self.dispatcher = LimitDispatcher(self.gate, self._waker, poll_interval=poll_interval)
        self._started = False
        self._stopped = False

    @classmethod
    def for_worker(cls, app: Any, config: DurableConfig, limits: Mapping[str, TaskLimits],
                   clock: Clock = SYSTEM_CLOCK) -> FleetLimits | None:
        """A worker's fleet limits; None when no task it knows declares one."""
        if not limits:
            return None
        return cls(app, limits, url=resolve_url(config.database_url), lease_ttl=config.lease_ttl,
                   poll_interval=config.relay_poll_interval, clock=clock)

    def start(self) -> None:
        """Before the first claim (again on a reconnect: once is all it does)."""
        if self._started or self._stopped:
            return
        self._started = True
        self.gate.open()
        self.dispatcher.start()

    def stop(self) -> None:
        """The worker is leaving: stop publishing parked messages, give back every lease still held."""
        if self._stopped:
            return
        self._stopped = True
        if not self._started:
            self._waker.close()  # the dispatcher's thread closes it when it ends
            return
        self.dispatcher.stop()
        self.gate.close()
