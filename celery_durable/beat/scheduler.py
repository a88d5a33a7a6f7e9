"""``celery beat -S celery_durable.Scheduler``: run beat on as many hosts as you like; one leads.

Each round (``tick``) a replica takes or renews the beat's lease in the
durable store. The leader plans each entry from its stored watermark
(``planning.beat_ticks``) and fires each due tick in one transaction: the
lease checked (fencing), the tick recorded, the watermark moved, and the task
enqueued through the outbox with an id derived from (beat, entry, tick).
Then it publishes what it enqueued (an outbox relay pass; any worker's relay
would too). A standby asks for the lease four times a second, so it
takes over within a quarter second of one lease TTL after the leader's last renewal.

Nothing is kept on local disk: ``schedule_filename`` is ignored.

SIGTERM or SIGINT (in the main thread): the round in progress finishes — no
fire is cut in half — then the lease is released so a standby takes over at
once, and beat exits 0. SIGHUP: the same, then the replica starts again in
place, reading the app's ``beat_schedule`` as it is configured now (entries
added, removed or changed take effect; reload replicas one after another).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timedelta
from typing import Any

from celery.beat import Scheduler as CeleryScheduler
from sqlalchemy.engine import Connection

from celery_durable import outbox
from celery_durable.beat.entries import BeatEntry, fixed_interval, read_entries
from celery_durable.beat.holder import new_holder
from celery_durable.beat.stored import MergedSchedule
from celery_durable.clock import SYSTEM_CLOCK, Clock
from celery_durable.config import from_celery_conf
from celery_durable.errors import DurableError, SchemaOutdated
from celery_durable.metrics import beat as beat_metrics
from celery_durable.metrics import registry
from celery_durable.outbox.relay import Relay
from celery_durable.planning.beat_ticks import Fire, TickPlan, plan_ticks
from celery_durable.store import beat as store
from celery_durable.store import outage
from celery_durable.store.clock import store_now
from celery_durable.store.engine import ensure_schema, store_url, unavailable_as_error

logger = logging.getLogger("celery_durable.beat")

#: The namespace of the task ids of beat sends: uuid5(namespace, "beat/entry/tick").
TASK_ID_NAMESPACE = uuid.UUID("6f1d3b1e-5b7c-4d4e-9a57-2c0c2f0b7a61")

#: How long a sent tick's row is kept: the audit trail of what was sent, and no more.
FIRES_KEPT = timedelta(days=7)

#: Most seconds between two rounds of a standby (how soon it sees a lease free). A round is one small
#: store read; a quarter second keeps a handover's gap under TTL + 1 s with room for a loaded host
#: (0.5 s left it at 4.07-4.17 s against a 4 s bound twice in CI, beside other tests).
STANDBY_POLL = 0.25


def fire_task_id(beat: str, entry: str, tick: datetime) -> str:
    """The task id of the send of ``entry``'s ``tick``: the same on every replica, for every retry."""
    return str(uuid.uuid5(TASK_ID_NAMESPACE, f"{beat}\x1f{entry}\x1f{tick.isoformat()}"))


class Scheduler(CeleryScheduler):  # type: ignore[misc]
    """A beat scheduler whose replicas elect one leader through the durable store."""

    def __init__(self, app: Any, *args: Any, lazy: bool = False, clock: Clock = SYSTEM_CLOCK, **kwargs: Any) -> None:
        kwargs.pop("schedule_filename", None)  # no local state
        try:
            self.config = from_celery_conf(app.conf)
        except DurableError as err:
            raise SystemExit(f"celery_durable beat refused to start: {err}") from None
        self.url = store_url(app)
        self.beat = self.config.beat_name or app.main or "celery"
        self.ttl = self.config.beat_lease_ttl
        #: Seconds late a tick is still sent as due (a handover is not an outage): a standby sees the
        #: lease free at most ``STANDBY_POLL`` after it expires, one TTL after the last renewal.
        self.grace = self.ttl + 2 * STANDBY_POLL
        #: host:pid:nonce, so the operator's views can say which process leads (beat/holder.py).
        self.holder = new_holder()
        #: Ticks are planned in wall time, the lease renewed by monotonic time, both read here.
        self._clock = clock
        self.term: int | None = None
        #: Monotonic time until which this replica's lease is surely live (renewed before, less a margin).
        self._leads_until = 0.0
        self._renew_at = 0.0
        self._next_prune = 0.0
        self._stopping = False
        #: SIGHUP: once stopped (round finished, lease released), start again in place.
        self._reloading = False
        self._in_round = False
        self.entries: dict[str, BeatEntry] = {}
        #: beat_schedule and the entries stored at run time, read again each round (beat.stored).
        self.merged: MergedSchedule | None = None
        self.relay: Relay | None = None
        self.fired = 0
        super().__init__(app, *args, lazy=lazy, **kwargs)
        if not lazy:
            self._install_stop_handlers()
            self._serve_metrics()

    # -- celery.beat.Scheduler -------------------------------------------------------------
    def setup_schedule(self) -> None:
        self.app.loader.import_default_modules()
        try:
            self.entries = read_entries(self.app, self.app.conf.beat_schedule or {})
        except DurableError as err:
            # One line naming the entry, exit status 1 (beat starts nothing; a supervisor sees it).
            raise SystemExit(f"celery_durable beat refused to start: {err}") from None
        try:
            ensure_schema(self.url)
        except SchemaOutdated as err:
            # The worker's refusal, one line naming the migrate command: beat would log the exception
            # chained through celery's own handler as a traceback and still exit 1.
            raise SystemExit(f"celery_durable beat refused to start: {err}") from None
        self.relay = Relay(self.app, url=self.url, listen=False)
        self.merged = MergedSchedule(self.app, self.beat, self.entries)
        logger.info("durable.beat.started beat=%s holder=%s entries=%s lease_ttl=%s", self.beat, self.holder,
                    ",".join(sorted(self.entries)) or "-", self.ttl,
                    extra={"event": "durable.beat.started", "beat": self.beat, "holder": self.holder,
                           "entries": sorted(self.entries), "lease_ttl": self.ttl})

    def tick(self, *args: Any, **kwargs: Any) -> float:
        """One round; returns the seconds to sleep before the next."""
        self._in_round = True
        try:
            return self._round()
        finally:
            self._in_round = False
            if self._stopping:
                raise SystemExit()  # the round is done: beat's own shutdown releases the lease (close)

    def sync(self) -> None:
        pass  # the store is the state; nothing to write

    def close(self) -> None:
        if self._in_round:
            self._stopping = True  # released once the round finishes (tick raises SystemExit then)
            return
        self._release()
        if self._reloading:
            self._exec_again()

    def _exec_again(self) -> None:
        """SIGHUP: this replica starts again in place (same pid), reading the app's schedule anew —
        how Celery's own worker takes SIGHUP. The lease went back first: another replica may lead."""
        logger.info("durable.beat.reloading beat=%s: starting again with the schedule as configured now",
                    self.beat, extra={"event": "durable.beat.reloading", "beat": self.beat})
        for handler in logging.getLogger().handlers:
            handler.flush()
        argv = sys.argv[1:] if sys.argv[0].endswith(os.path.join("celery", "__main__.py")) else None
        if argv is not None:
            os.execv(sys.executable, [sys.executable, "-m", "celery", *argv])
        os.execv(sys.executable, [sys.executable, *sys.argv])

    @property
    def info(self) -> str:
        return f"    . durable beat {self.beat!r} (lease {self.ttl:g} s, store {self.url.split('@')[-1]})"

    # -- a round ---------------------------------------------------------------------------
    def _round(self) -> float:
        try:
            self._renew()
        except Exception as err:  # noqa: BLE001 - the store is down: lead nothing, try again shortly
            outage.failed(self.url, err, "durable.beat.renew_failed", level=logging.WARNING,
                          then="leading nothing; tried again next round")
            self._lost("store_unavailable", err)
            return STANDBY_POLL
        if self.term is None:
            return STANDBY_POLL
        try:
            states = self._entry_states()
            self._maybe_prune()
        except Exception as err:  # noqa: BLE001 - reported; the next round tries again
            outage.failed(self.url, err, "durable.beat.round_failed", level=logging.WARNING,
                          then="tried again next round")
            return STANDBY_POLL
        due: list[datetime] = []
        for entry in list(self.entries.values()):
            if self._stopping or not self._still_leads():
                break
            try:
                next_due = self._run_entry(entry, states[entry.name])
            except Exception as err:  # noqa: BLE001 - reported; the entry is tried again next round
                outage.failed(self.url, err, "durable.beat.entry_failed", level=logging.WARNING,
                              then="tried again next round", entry=entry.name)
                next_due = self._clock.now() + timedelta(seconds=STANDBY_POLL)
            if next_due is not None:
                due.append(next_due)
        self._publish()
        renew_in = self.ttl / 3.0
        until_due = min(((d - self._clock.now()).total_seconds() for d in due), default=renew_in)
        return max(0.0, min(until_due, renew_in, float(self.max_interval)))

    @contextmanager
    def _transaction(self) -> Iterator[Connection]:
        """A store transaction of this replica. PostgreSQL: one the server ends if this process stops
        inside it (SIGSTOP, a frozen VM) for a lease TTL, so a fire's lock on the lease row cannot keep
        a standby from taking over."""
        with unavailable_as_error(self.url), ensure_schema(self.url).begin() as conn:
            if conn.dialect.name == "postgresql":
                conn.exec_driver_sql(f"SET LOCAL idle_in_transaction_session_timeout = {int(self.ttl * 1000)}")
            yield conn

    def _entry_states(self) -> dict[str, store.EntryState]:
        """Each entry's stored state; an entry seen for the first time is tracked from now (nothing
        before its first sight is due). The entries are read again first: beat_schedule with the ones
        added, edited or removed at run time (``beat.stored``), so a change runs from this round on."""
        with self._transaction() as conn:
            if self.merged is not None:
                self.entries = self.merged.entries(conn)
            states = store.entry_states(conn, self.beat)
            new = [name for name in self.entries if name not in states]
            for name in new:
                store.add_entry(conn, self.beat, name, self._clock.now())
            if new:
                states = store.entry_states(conn, self.beat)
        return states

    def _maybe_prune(self) -> None:
        """Forget sent ticks older than FIRES_KEPT, once an hour (the watermarks keep their place)."""
        if self._clock.monotonic() < self._next_prune:
            return
        self._next_prune = self._clock.monotonic() + 3600.0
        with self._transaction() as conn:
            if store.still_leads(conn, self.beat, self.holder, self.term or 0, store_now(conn, self._clock)):
                store.prune_fires(conn, self._clock.now() - FIRES_KEPT)

    def _run_entry(self, entry: BeatEntry, state: store.EntryState) -> datetime | None:
        if state.paused:
            return None
        plan = plan_ticks(entry.schedule, state.watermark, self._clock.now(), catch_up=entry.catch_up, grace=self.grace,
                          max_catch_up=self.config.beat_max_catch_up, every=fixed_interval(entry.schedule))
        if plan.missed_from is not None:
            missed_from, missed_to = plan.missed_from.isoformat(), (plan.missed_to or plan.missed_from).isoformat()
            logger.info("durable.beat.caught_up entry=%s policy=%s missed_from=%s missed_to=%s", entry.name,
                        entry.catch_up, missed_from, missed_to,
                        extra={"event": "durable.beat.caught_up", "entry": entry.name, "policy": entry.catch_up,
                               "missed_from": missed_from, "missed_to": missed_to})
        if plan.cut:
            sent = sum(1 for f in plan.fires if f.covers_from is None)
            logger.warning("durable.beat.catch_up_cut entry=%s sent=%d cut=%s%d: durable_beat_max_catch_up bounds "
                           "a catch-up", entry.name, sent, "" if plan.cut_exact else "at least ", plan.cut,
                           extra={"event": "durable.beat.catch_up_cut", "entry": entry.name, "sent": sent,
                                  "cut": plan.cut, "cut_exact": plan.cut_exact})
        for fire in plan.fires:
            if self._stopping or not self._still_leads() or not self._fire(entry, fire):
                return None
        if plan.watermark > state.watermark and (not plan.fires or plan.fires[-1].watermark < plan.watermark):
            self._advance(entry, plan)
        return plan.next_due

    def _fire(self, entry: BeatEntry, fire: Fire) -> bool:
        """Send one tick; False when this replica no longer leads (it stops firing)."""
        assert self.term is not None
        task_id = fire_task_id(self.beat, entry.name, fire.tick)
        headers = dict(entry.options.get("headers") or {})
        headers.update(celery_beat_task=True, durable_beat_entry=entry.name, durable_beat_tick=fire.tick.isoformat())
        if fire.covers_from is not None and fire.covers_to is not None:
            headers.update(durable_beat_missed_from=fire.covers_from.isoformat(),
                           durable_beat_missed_to=fire.covers_to.isoformat())
        options = {**entry.options, "headers": headers}
        now = self._clock.now()
        with self._transaction() as conn:
            if not store.still_leads(conn, self.beat, self.holder, self.term, store_now(conn, self._clock)):
                self._lost("lease_moved", None)
                return False
            if store.fire(conn, self.beat, entry.name, fire.tick, fire.watermark, task_id, self.term, now):
                outbox.enqueue(conn, self.app.signature(entry.task, entry.args, entry.kwargs), task_id=task_id,
                               **options)
                fired = True
            else:
                fired = False
        if fired:
            self.fired += 1
            beat_metrics.fired(self.beat, entry.name, fire.tick, now)
            lag = (now - fire.tick).total_seconds()
            logger.info("durable.beat.fired entry=%s tick=%s id=%s lag=%.3f", entry.name, fire.tick.isoformat(),
                        task_id, lag, extra={"event": "durable.beat.fired", "entry": entry.name,
                                             "tick": fire.tick.isoformat(), "task_id": task_id, "lag": lag})
        return True

    def _advance(self, entry: BeatEntry, plan: TickPlan) -> None:
        assert self.term is not None
        with self._transaction() as conn:
            if store.still_leads(conn, self.beat, self.holder, self.term, store_now(conn, self._clock)):
                store.advance(conn, self.beat, entry.name, plan.watermark)

    def _publish(self) -> None:
        if self.relay is None:
            return
        try:
            while self.relay.run_pass().published == self.relay.batch_size:
                pass
        except Exception as err:  # noqa: BLE001 - the rows stay in the outbox: any relay publishes them
            outage.failed(self.url, err, "durable.beat.publish_failed", level=logging.WARNING,
                          then="the sends wait in the outbox")

    # -- the lease -------------------------------------------------------------------------
    def _renew(self) -> None:
        started = self._clock.monotonic()
        with self._transaction() as conn:
            # The lease is written and compared in the store's clock, as every replica reads it.
            term = store.lead(conn, self.beat, self.holder, self.ttl, store_now(conn, self._clock))
        outage.available(self.url)
        if term is None:
            if self.term is not None:
                self._lost("lease_taken", None)
            return
        beat_metrics.leading(self.beat, True)
        if term != self.term:
            logger.info("durable.beat.leading beat=%s holder=%s term=%d", self.beat, self.holder, term,
                        extra={"event": "durable.beat.leading", "beat": self.beat, "holder": self.holder, "term": term})
        self.term = term
        # Live for a TTL from ``now``; count from before the round trip, and keep a margin.
        self._leads_until = started + self.ttl * 0.8
        self._renew_at = started + self.ttl / 3.0

    def _still_leads(self) -> bool:
        """Asked before every send: answered from memory while the lease is young; a round long
        enough to use a third of it (a big catch-up) renews it first."""
        if self.term is None:
            return False
        if self._clock.monotonic() >= self._renew_at:
            try:
                self._renew()
            except Exception as err:  # noqa: BLE001 - cannot vouch for the lease: stop sending
                outage.failed(self.url, err, "durable.beat.renew_failed", level=logging.WARNING,
                              then="no send until the lease is renewed")
                self._lost("store_unavailable", err)
        return self.term is not None and self._clock.monotonic() < self._leads_until

    def _lost(self, why: str, err: BaseException | None) -> None:
        if self.term is not None:
            logger.warning("durable.beat.not_leading beat=%s holder=%s why=%s%s", self.beat, self.holder, why,
                           f" error={err!r}" if err is not None else "",
                           extra={"event": "durable.beat.not_leading", "beat": self.beat, "holder": self.holder,
                                  "why": why, "error": repr(err) if err is not None else None})
        self.term = None
        self._leads_until = 0.0
        beat_metrics.leading(self.beat, False)

    def _release(self) -> None:
        if self.term is None:
            return
        try:
            with self._transaction() as conn:
                store.release(conn, self.beat, self.holder)
            logger.info("durable.beat.released beat=%s holder=%s", self.beat, self.holder,
                        extra={"event": "durable.beat.released", "beat": self.beat, "holder": self.holder})
        except Exception as err:  # noqa: BLE001 - the lease expires one TTL after the last renewal
            outage.failed(self.url, err, "durable.beat.release_failed", level=logging.WARNING,
                          then="a standby takes over when it expires")
        self.term = None
        beat_metrics.leading(self.beat, False)

    def _serve_metrics(self) -> None:
        if self.config.metrics_port is None:
            return
        try:
            port = registry.serve(self.config.metrics_host, self.config.metrics_port)
        except DurableError as err:
            raise SystemExit(f"celery_durable beat refused to start: {err}") from None
        beat_metrics.leading(self.beat, False)
        logger.info("durable.beat.metrics port=%s", port, extra={"event": "durable.beat.metrics", "port": port})

    def _install_stop_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # embedded (worker -B): the worker's own shutdown stops it

        def stop(signum: int, frame: Any) -> None:
            self._reloading = self._reloading or signum == signal.SIGHUP
            if self._in_round:
                self._stopping = True  # tick raises SystemExit when the round is done
                return
            raise SystemExit()

        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(signum, stop)
