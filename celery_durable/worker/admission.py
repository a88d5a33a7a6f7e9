"""Admission: what a claim took becomes a held run handed to Celery, or is parked, left to wait, or given back.

The claimer decides what to take from the broker; this decides, message by
message and in order, what each one becomes: an undecodable body is parked; a
run of a limited task asks the fleet-limit gate; a run that finds no slot left
goes back to the broker; the rest take a slot and go to Celery's task handler,
whose strategy makes the request bound here to the slot.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from celery_durable.clock import Clock
from celery_durable.compat.host_types import HostMessage, HostRequest
from celery_durable.compat.request import eta_ahead, waits_for_eta
from celery_durable.limits.gate import Admission, LimitGate
from celery_durable.planning.limits import BACK, RunRoom
from celery_durable.worker.fetchers import give_back_in_place
from celery_durable.worker.held_runs import HeldRun, HeldRuns
from celery_durable.worker.parking import Parker, undecodable

logger = logging.getLogger(__name__)

#: Seconds claiming pauses after the store could not answer the fleet-limit gate.
STORE_PAUSE = 1.0


class Admitter:
    """Admits the messages a claim took, in order; counts the ones given back for want of a slot."""

    def __init__(self, *, held: HeldRuns, gate: LimitGate | None, handle: Callable[[Any], Any],
                 clock: Clock) -> None:
        self._held = held
        self._gate = gate
        self._handle = handle
        self._clock = clock
        #: Set once the claim channel is open (worker/parking.py ``parker_for``).
        self.parker: Parker | None = None
        #: The runs being handed to Celery, innermost last. A stack: a strategy that reads the connection
        #: (a confirm, a synchronous cancel) may dispatch a delivery admitted inside it, and the inner
        #: admission must not clear the outer one's run before its request is bound.
        self._admitting: list[HeldRun] = []
        #: Messages a pass took that could have run but found no slot left: given back to the broker.
        self.handed_back = 0
        #: Set when the store could not answer the gate: no pass until then (a requeued
        #: message would otherwise come straight back and spin while the store is down).
        #: None until the first failure, so a pass reads no clock while the store answers.
        self._paused_until: float | None = None

    def store_paused(self) -> bool:
        """Whether the store failed the gate less than :data:`STORE_PAUSE` ago: claiming waits."""
        return self._paused_until is not None and self._clock.monotonic() < self._paused_until

    def admit(self, queue_name: str, message: HostMessage) -> bool:
        """Hand ``message`` to Celery; False if it was parked, went to wait for a limit, or back (no slot)."""
        return self.admit_all([(queue_name, message)], bounded=False)[0] == 1

    def admit_all(self, taken: list[tuple[str, Any]], bounded: bool) -> tuple[int, int]:
        """Hand each (queue, message) to Celery in order; ``bounded``: as far as the worker's slots go.

        Returns (how many now hold a slot, how many went back to the broker: they could run, but
        the pass took more than its room and none was left).
        """
        readable = []
        for queue_name, message in taken:
            reason = undecodable(message)
            if reason is not None:
                # Stock Celery acks (on_decode_error) or rejects (on_invalid_task)
                # such a message, and it is gone: parked, an operator can see it.
                self._park(queue_name, message, reason)
            else:
                readable.append((queue_name, message))
        held = self._held
        admissions = self._admissions(readable, RunRoom(held.room(), held.free_slots()) if bounded else None)
        back = [message for (_, message), (_, admission) in zip(readable, admissions)
                if admission is not None and admission.verdict == BACK]
        admitted = sum(self._admit_readable(queue_name, message, checked, admission)
                       for (queue_name, message), (checked, admission) in zip(readable, admissions))
        if back:
            self._give_back_unstarted(back)
        return admitted, len(back)

    def bind_request(self, request: HostRequest) -> None:
        """Called as the strategy makes a request for the message being admitted."""
        for run in reversed(self._admitting):
            if request.message is run.message:
                run.request = request
                return

    def _admissions(self, readable: list[tuple[str, Any]],
                    room: RunRoom | None) -> list[tuple[bool, Admission | None]]:
        """(checked, admission) per message: what runs, within ``room`` (None: everything taken fits).

        A message whose ETA is ahead holds no slot until due and is not checked
        now (it takes its leases when due). The rest spend the room in order,
        the runs of unlimited tasks first, then the fleet-limit gate's (one store
        transaction for them all); a message that could run once it is spent is BACK.
        """
        gate = self._gate
        ahead = [eta_ahead(message) for _, message in readable]
        out: list[tuple[bool, Admission | None]] = []
        limited_at: list[int] = []
        for (queue_name, message), later in zip(readable, ahead):
            if later:
                out.append((False, None))
            elif gate is not None and gate.decides(message):
                limited_at.append(len(out))
                out.append((True, None))  # the gate's answer replaces it below
            else:
                fits = room is None or room.take(queue_name)
                out.append((gate is not None, None if fits else Admission(BACK)))
        if gate is None or not limited_at:
            return out
        admissions, store_failed = gate.admit_or_hand_back([readable[i] for i in limited_at], room)
        if store_failed:
            self._paused_until = self._clock.monotonic() + STORE_PAUSE
        for index, admission in zip(limited_at, admissions):
            if admission is None and room is not None and not room.take(readable[index][0]):
                # The gate could not read its arguments (Celery's strategy will park it): it would still
                # take a slot on its way there, and there is none left.
                admission = Admission(BACK)
            out[index] = (True, admission)
        return out

    def _give_back_unstarted(self, messages: list[Any]) -> None:
        """Messages that could run but found no slot go back to the broker, ahead of what came after them.

        They hold nothing (no slot, no lease, no rate turn) and burn no attempt.
        Only a pass that took more than its room has any, and only on a transport
        that puts them back in place (``fetchers.gives_back_in_place``).
        """
        self.handed_back += len(messages)
        give_back_in_place(messages)

    def _admit_readable(self, queue_name: str, message: HostMessage, checked: bool,
                        admission: Admission | None) -> bool:
        grant = None
        if admission is not None:  # not RUN (parked, dropped, failed or BACK) holds no slot
            if not admission.runs:
                return False
            grant = admission.grant
        run = self._held.take(queue_name, message)
        run.limit_grant, run.limit_checked = grant, checked
        self._admitting.append(run)
        try:
            self._handle(message)
        except Exception as exc:
            if run.request is not None or message.acknowledged:
                # Past the content: the strategy made a request (or settled
                # the message) and the failure is the worker's, not the message's.
                raise
            # A body that decodes but that the strategy cannot read (args
            # that are not [args, kwargs, embed], a bad header): the content,
            # not the worker, is at fault.
            logger.warning("durable.message.unreadable queue=%s", queue_name, exc_info=True,
                           extra={"event": "durable.message.unreadable", "queue": queue_name})
            self._park(queue_name, message, f"the task handler raised {exc!r}")
            return False
        finally:
            self._admitting.pop()  # admissions nest: the innermost ends first
            if run.request is None:
                # The strategy dropped it (revoked, expired, unknown task, bad
                # payload): nothing will run, so the count goes back now.
                self._held.give_back(message)
            elif waits_for_eta(run.request, in_pool=run.in_pool):
                # Waiting for its ETA: it frees its slot until it is due.
                self._held.schedule(message)
        return True

    def _park(self, queue_name: str, message: HostMessage, reason: str) -> None:
        if self.parker is None:
            raise RuntimeError("the claimer parks messages only once started")
        self.parker.park(queue_name, message, reason)
