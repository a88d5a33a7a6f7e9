"""The heartbeat of the leases this process holds — run leases and fleet-limit leases — from one thread."""

from __future__ import annotations

import logging
import os
import threading
import uuid
from collections.abc import Callable
from time import monotonic
from typing import Any

from celery_durable.store import limits, outage, runs
from celery_durable.store.clock import store_now
from celery_durable.store.engine import autocommit, engine_for, unavailable_as_error

logger = logging.getLogger("celery_durable.run")


def new_token() -> str:
    """A lease token: names one attempt (or one hand-off message) of a run, unique across the fleet."""
    return uuid.uuid4().hex


class LeaseKeeper:
    """Renews every held lease each third of its time to live, from a daemon thread.

    An attempt holds its run's lease from its start to its end; if this process
    dies (SIGKILL, OOM, a lost host) the renewals stop and, one TTL later,
    another delivery of the run may take it over. A renewal that finds the
    lease gone (the store was out longer than the TTL and another attempt
    took the run) stops renewing it and says so: that attempt's outcome will
    not be written (``settle`` checks the holder).
    """

    def __init__(self) -> None:
        self._held: dict[str, dict[str, tuple[str, float]]] = {}  # url -> run id -> (token, ttl)
        #: Fleet-limit leases: url -> holder (a worker process's token) -> ttl. One
        #: statement renews every limit lease a holder has, however many.
        self._limit_holders: dict[str, dict[str, float]] = {}
        #: Other renewals on the same beat (the PostgreSQL broker's held rows): key -> (renew, ttl).
        self._beats: dict[str, tuple[Callable[[], Any], float]] = {}
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        #: When the thread beats next (monotonic); None while it waits for a first hold (or is starting).
        self._next_due: float | None = None

    def hold(self, url: str, run_id: str, token: str, ttl: float) -> None:
        with self._cond:
            self._held.setdefault(url, {})[run_id] = (token, ttl)
            self._start(ttl)

    def hold_limits(self, url: str, holder: str, ttl: float) -> None:
        """Renew every fleet-limit lease ``holder`` takes in ``url``'s store until :meth:`release_limits`."""
        with self._cond:
            self._limit_holders.setdefault(url, {})[holder] = ttl
            self._start(ttl)

    def release_limits(self, url: str, holder: str) -> None:
        with self._cond:
            holders = self._limit_holders.get(url)
            if holders is not None:
                holders.pop(holder, None)
                if not holders:
                    del self._limit_holders[url]

    def hold_beat(self, key: str, renew: Callable[[], Any], ttl: float) -> None:
        """Call ``renew()`` on this heartbeat (each third of the shortest TTL held) until :meth:`release_beat`:
        one thread renews a worker's runs, limits and broker rows."""
        with self._cond:
            self._beats[key] = (renew, ttl)
            self._start(ttl)

    def release_beat(self, key: str) -> None:
        with self._cond:
            self._beats.pop(key, None)

    def _start(self, ttl: float) -> None:
        """Make sure a beat comes within a third of ``ttl`` from now (under ``self._cond``)."""
        if self._thread is None or not self._thread.is_alive():
            self._next_due = None
            self._thread = threading.Thread(target=self._run, name="durable-lease-keeper", daemon=True)
            self._thread.start()
        elif self._next_due is not None:
            due = monotonic() + ttl / 3.0
            if due >= self._next_due:
                # The beat already set comes in time and renews whatever is held then: waking the
                # thread on every run's hold (a thread switch a run) would change nothing.
                return
            # A shorter TTL than the cadence was set for (a run lease beside a broker's longer one):
            # the beat comes earlier, or the new lease would lapse before its first renewal.
            self._next_due = due
        self._cond.notify()

    def release(self, url: str, run_id: str) -> None:
        with self._cond:
            held = self._held.get(url)
            if held is not None:
                held.pop(run_id, None)
                if not held:
                    del self._held[url]

    def held(self) -> dict[str, dict[str, str]]:
        with self._cond:
            return {url: {run_id: token for run_id, (token, _) in leases.items()}
                    for url, leases in self._held.items()}

    def _interval(self) -> float | None:
        ttls = [ttl for leases in self._held.values() for _, ttl in leases.values()]
        ttls += [ttl for holders in self._limit_holders.values() for ttl in holders.values()]
        ttls += [ttl for _, ttl in self._beats.values()]
        return min(ttls) / 3.0 if ttls else None

    def _run(self) -> None:
        # Beats on a fixed cadence from the first hold, not on each hold: a run
        # shorter than a third of the TTL (most of them) costs no renewal at all.
        while True:
            with self._cond:
                interval = self._interval()
                if interval is None:
                    self._next_due = None
                    self._cond.wait()
                    continue
                at = monotonic()
                if self._next_due is None:
                    self._next_due = at + interval
                if at < self._next_due:
                    self._cond.wait(timeout=self._next_due - at)
                    continue
                self._next_due = at + interval
                snapshot = {url: dict(leases) for url, leases in self._held.items()}
                limit_snapshot = {url: dict(holders) for url, holders in self._limit_holders.items()}
                beats = list(self._beats.values())
            for renew, _ in beats:
                try:
                    renew()
                except Exception as err:  # noqa: BLE001 - the next beat tries again; a lease covers two misses
                    logger.warning("durable.lease.beat_failed: %s", err, extra={"event": "durable.lease.beat_failed"})
            for url, leases in snapshot.items():
                self._renew(url, leases)
            for url, holders in limit_snapshot.items():
                self._renew_limits(url, holders)

    def _renew(self, url: str, leases: dict[str, tuple[str, float]]) -> None:
        tokens = {run_id: token for run_id, (token, _) in leases.items()}
        ttl = max(ttl for _, ttl in leases.values())
        try:
            with unavailable_as_error(url), autocommit(engine_for(url)).connect() as conn:
                renewed = runs.renew(conn, tokens, ttl)
                missed = sorted(set(tokens) - renewed)
                # Not renewed is not yet lost: the attempt may have just settled (no holder
                # now) and not released it here yet. Lost is another attempt's token.
                now_held = runs.holders(conn, missed) if missed else {}
        except Exception as err:  # noqa: BLE001 - the next beat tries again; the steps will see it too
            outage.failed(url, err, "durable.lease.renew_failed", runs=len(tokens))
            return
        outage.available(url)
        for run_id in missed:
            holder = now_held.get(run_id)
            if holder is None or holder == tokens[run_id]:
                continue
            with self._cond:
                current = self._held.get(url, {}).get(run_id)
                if current is None or current[0] != tokens[run_id]:
                    continue  # released meanwhile: the attempt ended
                self._held[url].pop(run_id, None)
            logger.warning("durable.lease.lost id=%s: another attempt holds the run now; this attempt's "
                           "outcome will not be recorded", run_id,
                           extra={"event": "durable.lease.lost", "run_id": run_id})


    def _renew_limits(self, url: str, holders: dict[str, float]) -> None:
        try:
            with unavailable_as_error(url), autocommit(engine_for(url)).connect() as conn:
                for holder, ttl in holders.items():
                    limits.renew(conn, holder, ttl, store_now(conn))
        except Exception as err:  # noqa: BLE001 - the next beat tries again; a lease outlives a few missed beats
            outage.failed(url, err, "durable.limit.renew_failed")
            return
        outage.available(url)


_keeper = LeaseKeeper()


def _reset_after_fork() -> None:
    # A forked pool child holds none of its parent's leases, and threads do not survive a fork.
    global _keeper
    _keeper = LeaseKeeper()


os.register_at_fork(after_in_child=_reset_after_fork)


def keeper() -> LeaseKeeper:
    return _keeper
