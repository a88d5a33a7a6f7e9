"""One execution of a durable run: take its lease (or defer, drop or bury the delivery), run the body, settle it.

Which delivery acks what (docs/durable-tasks.md, "Leases"): the delivery that takes the
run's lease runs the body and is acked when the attempt ends (``acks_late``).
A copy that finds the run settled, or sleeping until a wake-up that exists, is
acked without running. A copy that finds a live attempt is re-sent to look
again just after that attempt's lease would expire, and then acked: if the live
attempt ends, the copy is a no-op; if its process died, the copy takes over.
While the store cannot be reached, a delivery is re-sent with a growing
countdown (same id, same retry count: no attempt spent) and acked, so it is
never lost and never burns the task's retries.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from typing import Any

from celery.exceptions import Ignore, Reject, Retry

from celery_durable import faults
from celery_durable.clock import SYSTEM_CLOCK
from celery_durable.compat.autoretry import max_retries, will_retry
from celery_durable.config import lease_ttl
from celery_durable.errors import LeaseLost, NotDurable, RunExhausted, RunIdInvalid, SleepHandOff, StoreUnavailable
from celery_durable.headers import RESUME_HEADER, STORE_WAITS_HEADER
from celery_durable.leases.keeper import keeper, new_token
from celery_durable.metrics import jobs as metrics
from celery_durable.planning import run_admission
from celery_durable.planning.checkpoints import Ledger, check_run_id
from celery_durable.planning.run_admission import BURY, DUPLICATE, RUN, UNSEEN_OUTCOME, RowView
from celery_durable.store import attempts, outage, runs
from celery_durable.store.clock import store_now
from celery_durable.store.engine import autocommit, ensure_schema, store_url, unavailable_as_error
from celery_durable.store.json_values import encode, from_json
from celery_durable.store.runs import Run
from celery_durable.store.schema import DEAD, FAILED, SETTLED, SLEEPING, SUCCEEDED
from celery_durable.tasks.context import RunContext, _current

logger = logging.getLogger("celery_durable.run")

#: The ``jobs_total`` outcome each settled state counts (the settling path and a recovered settle alike).
OUTCOME_COUNTS = {SUCCEEDED: "succeeded", DEAD: "dead_lettered"}


def header(request: Any, name: str) -> Any:
    """A custom message header as the request carries it (Celery spreads them over the context)."""
    value = getattr(request, name, None)
    if value is None:
        value = (getattr(request, "headers", None) or {}).get(name)
    return value


def execute(task: Any, body: Callable[..., Any], bind: bool, args: tuple[Any, ...],
            kwargs: dict[str, Any]) -> Any:
    request = task.request
    if request.called_directly:
        raise NotDurable(f"{task.name} is a durable task: run it with .delay(), .apply_async() or .apply(), "
                         f"not by calling it (a run needs a task id)")
    url = store_url(task.app)
    try:
        check_run_id(request.id)
    except RunIdInvalid as err:
        return _refuse_id(task, err)
    # Checked before anything is written: a run is stored only if it can be requeued as it came.
    args_json = encode(f"the arguments of {task.name}", list(args))
    kwargs_json = encode(f"the keyword arguments of {task.name}", dict(kwargs))
    resume = header(request, RESUME_HEADER)
    token = new_token()
    ttl = lease_ttl(task.app.conf)
    queue = (request.delivery_info or {}).get("routing_key")
    seen_expires = None
    for look in range(run_admission.MAX_LOOKS_IN_PLACE + 1):
        try:
            engine = ensure_schema(url)
            with unavailable_as_error(url):
                conn = autocommit(engine).connect()
                try:
                    found = attempts.start(conn, run_id=request.id, task_name=task.name, queue=queue,
                                           args=args_json, kwargs=kwargs_json, token=token, lease_seconds=ttl,
                                           resume=resume, retries=int(request.retries or 0))
                    run, started = found.run, found.started
                    ledger = Ledger(stored=found.checkpoints)
                except BaseException:
                    conn.close()
                    raise
        except StoreUnavailable as err:
            return _wait_for_store(task, url, err, resume)
        outage.available(url)

        verdict = run_admission.admit(
            RowView(run.state, run.lease_holder, run.lease_expires_at, run.lost_attempts, run.settled_by),
            started=started, settled_states=SETTLED, sleeping_state=SLEEPING, retries=int(request.retries or 0),
            max_retries=max_retries(task), at=store_now(conn), resume=resume,
        )
        wait = None if request.is_eager else run_admission.wait_in_place(
            verdict, run.lease_expires_at, seen_expires, look, ttl)
        if wait is None:
            break
        # A lease that may be a dead holder's: watched here, since a re-sent copy would queue behind
        # every message sent since.
        conn.close()
        seen_expires = run.lease_expires_at
        time.sleep(wait)
    if verdict.kind != RUN:
        try:
            if verdict.kind == BURY:
                return _bury(task, conn, url, run, verdict.reason)
            if verdict.kind == UNSEEN_OUTCOME and resume is not None:
                return _claim_unseen_outcome(task, conn, url, run, resume)
        finally:
            conn.close()
        if verdict.kind == DUPLICATE:
            return _duplicate(task, run)
        return _defer(task, run, verdict.delay)

    ctx = RunContext(task=task, run=run, ledger=ledger, conn=conn, engine=engine, url=url, token=token,
                     faults=faults.of(task.app))
    token_var = _current.set(ctx)
    keeper().hold(url, run.id, token, ttl)
    try:
        return _attempt(ctx, body, bind, args, kwargs)
    except StoreUnavailable as err:
        # Our own lease goes with the re-sent message: it resumes the run at once, as no lost attempt.
        return _wait_for_store(task, url, err, token)
    finally:
        keeper().release(url, run.id)
        _current.reset(token_var)
        ctx.conn.close()  # the step context may have replaced a connection the store dropped


def _attempt(ctx: RunContext, body: Callable[..., Any], bind: bool, args: tuple[Any, ...],
             kwargs: dict[str, Any]) -> Any:
    task, run = ctx.task, ctx.run
    try:
        value = body(task, *args, **kwargs) if bind else body(*args, **kwargs)
        encoded = encode(f"the result of {task.name}", value)
    except SleepHandOff as handoff:
        # The run is not over and did not fail: this delivery is acked, the wake-up resumes it.
        raise Ignore(str(handoff)) from None
    except LeaseLost as lost:
        # The run is another attempt's now (or cancelled): its outcome, retries and result are the
        # holder's to write. Acked, no retry spent, nothing counted, the result backend untouched.
        logger.warning("durable.run.lease_lost task=%s id=%s step=%s: taken over after this attempt's "
                       "lease expired, or cancelled; the step is not recorded and this attempt ends",
                       task.name, run.id, lost.step,
                       extra={"event": "durable.run.lease_lost", "task": task.name, "run_id": run.id,
                              "step": lost.step})
        raise Ignore(str(lost)) from None
    except (Ignore, Reject, StoreUnavailable):
        # The body's own choice: the run is not over and did not fail.
        # The store being down is no failure of the run either: the caller waits for it.
        raise
    except Retry as exc:
        # task.retry() has already sent the next attempt: an outcome the store
        # cannot take now must not send a second one.
        try:
            if _settle(ctx, FAILED, error=runs.render_error(exc.exc or exc)):
                metrics.count(run.queue, "failed")
        except StoreUnavailable as err:
            outage.failed(ctx.url, err, "durable.run.settle_failed", run_id=run.id)
        raise
    except Exception as exc:
        if will_retry(task, exc):
            if _settle(ctx, FAILED, error=runs.render_error(exc)):
                metrics.count(run.queue, "failed")
        else:
            settled = _settle(ctx, DEAD, error=runs.render_error(exc))
            if settled is not None:
                logger.error("durable.run.dead task=%s id=%s error=%s", task.name, run.id,
                             settled.last_error,
                             extra={"event": "durable.run.dead", "task": task.name, "run_id": run.id,
                                    "error": settled.last_error})
                metrics.count(run.queue, OUTCOME_COUNTS[DEAD])
                call_hook(task, settled)
        raise
    # If the outcome cannot be written (the store went down) the caller re-sends
    # the run under this attempt's lease: it replays every step from its checkpoint.
    settled = _settle(ctx, SUCCEEDED, result=encoded)
    if settled is not None:
        metrics.count(run.queue, OUTCOME_COUNTS[SUCCEEDED])
        call_hook(task, settled)
    return value


def _settle(ctx: RunContext, state: str, *, result: str | None = None, error: str | None = None) -> Run | None:
    """The run as settled by this attempt; None if it no longer holds the run (nothing left to count).

    Raises StoreUnavailable when the store cannot be reached (a settled
    outcome: not within CHECKPOINT_WAIT): the outcome is not written, or not
    known to be, and the run must come back rather than end unrecorded.
    """
    try:
        with unavailable_as_error(ctx.url):
            settled = runs.settle(ctx.conn, ctx.run, state, result=result, error=error)
    except StoreUnavailable as err:
        if state not in SETTLED:
            raise
        # The UPDATE may have committed with only its reply lost. Left to the re-send under this
        # attempt's token, the outcome's count and hook were lost whenever that re-send could not be
        # published either (a broker on the store's own database, cut with it): the message came back
        # without the token, a plain duplicate. So the attempt waits in place, as a step's checkpoint
        # does, then claims the outcome its token wrote, or writes it now.
        outage.failed(ctx.url, err, "durable.run.settle_failed", run_id=ctx.run.id)
        settled = ctx.when_the_store_answers(lambda conn: _claim_or_settle(conn, ctx, state, result, error),
                                             "durable.run.settle_failed", connection_lost=True)
    if settled is None:
        logger.info("durable.run.settled_before id=%s state=%s: cancelled, or taken over after this "
                    "attempt's lease expired", ctx.run.id, state,
                    extra={"event": "durable.run.settled_before", "run_id": ctx.run.id, "state": state})
    return settled


def _claim_or_settle(conn: Any, ctx: RunContext, state: str, result: str | None, error: str | None) -> Run | None:
    """After a settle whose reply was lost: the outcome this attempt's settle wrote, claimed, or written now."""
    claimed = runs.claim_unseen_outcome(conn, ctx.run.id, ctx.token)
    if claimed is not None:
        _log_settle_recovered(ctx.task, claimed, "its attempt, once the store answered again")
        return claimed
    return runs.settle(conn, ctx.run, state, result=result, error=error)


def _log_settle_recovered(task: Any, run: Run, by: str) -> None:
    logger.info("durable.run.settle_recovered task=%s id=%s state=%s by=%s: the settle's reply was lost; "
                "the outcome is reported now", task.name, run.id, run.state, by,
                extra={"event": "durable.run.settle_recovered", "task": task.name, "run_id": run.id,
                       "state": run.state, "by": by})


def _resend(task: Any, countdown: float, headers: dict[str, Any]) -> None:
    """Send the delivered run again, same id, arguments and retry count, to arrive after ``countdown``."""
    request = task.request
    merged = {**(getattr(request, "headers", None) or {}), **headers}
    task.signature_from_request(request, countdown=countdown, retries=request.retries,
                                headers=merged).apply_async()


def _wait_for_store(task: Any, url: str, err: StoreUnavailable, resume: str | None) -> Any:
    """The store did not answer: send the run again after a backoff and ack this delivery.

    Not Celery's retry: a store outage is not the run failing, and must not
    spend its retries. If even the re-send fails (the broker is down too) the
    delivery goes back to the broker unacked.
    """
    request = task.request
    outage.failed(url, err, "durable.run.store_failed", run_id=request.id)
    if request.is_eager:
        raise err
    waits = int(header(request, STORE_WAITS_HEADER) or 0)
    delay = run_admission.store_wait_delay(waits, random.random())
    headers: dict[str, Any] = {STORE_WAITS_HEADER: waits + 1}
    if resume is not None:
        headers[RESUME_HEADER] = resume
    try:
        _resend(task, delay, headers)
    except Exception as send_err:  # noqa: BLE001 - whatever stops the re-send, the message goes back, never lost
        logger.error("durable.run.store_wait_failed id=%s: could not re-send while the store is down (%s); "
                     "handing the message back to the broker", request.id, send_err,
                     extra={"event": "durable.run.store_wait_failed", "run_id": request.id})
        raise Reject(f"durable store unavailable and re-send failed: {send_err}", requeue=True) from err
    logger.info("durable.run.store_wait id=%s wait=%.2fs", request.id, delay,
                extra={"event": "durable.run.store_wait", "run_id": request.id, "wait": delay})
    raise Ignore(f"durable store unavailable: run {request.id} re-sent to try again in {delay:.2f}s")


def _defer(task: Any, run: Run, delay: float) -> Any:
    """A live attempt holds the run: look again once its lease would have expired."""
    request = task.request
    if request.is_eager:
        raise NotDurable(f"durable run {run.id} is being executed elsewhere (its lease is live)")
    logger.info("durable.run.deferred task=%s id=%s: a live attempt holds it; looking again in %.2fs",
                task.name, run.id, delay,
                extra={"event": "durable.run.deferred", "task": task.name, "run_id": run.id, "delay": delay})
    carried: dict[str, Any] = {}
    for name in (RESUME_HEADER, STORE_WAITS_HEADER):
        value = header(request, name)
        if value is not None:
            carried[name] = value
    try:
        _resend(task, delay, carried)
    except Exception as send_err:
        raise Reject(f"could not defer a copy of live run {run.id}: {send_err}", requeue=True) from send_err
    raise Ignore(f"durable run {run.id} is live elsewhere: this copy looks again in {delay:.2f}s")


def _bury(task: Any, conn: Any, url: str, run: Run, reason: str) -> Any:
    """Settle a run whose attempts keep dying as dead, and fail this delivery without a retry."""
    error = f"RunExhausted: {reason}"
    try:
        with unavailable_as_error(url):
            settled = runs.settle(conn, run, DEAD, error=error)
    except StoreUnavailable as err:
        return _wait_for_store(task, url, err, run.lease_holder)
    if settled is not None:
        logger.error("durable.run.exhausted task=%s id=%s attempts=%s: %s", task.name, run.id, run.attempts,
                     reason, extra={"event": "durable.run.exhausted", "task": task.name, "run_id": run.id,
                                    "attempts": run.attempts})
        metrics.count(run.queue, "dead_lettered")
        call_hook(task, settled)
    raise RunExhausted(f"durable run {run.id} of {task.name} {reason}; buried as dead "
                       f"(celery_durable.runs.requeue brings it back)")


def _refuse_id(task: Any, err: RunIdInvalid) -> Any:
    """A task id the runs table cannot hold: a dead letter that names it, never a retry or a silent loss.

    No row can carry the id, so the dead letter is the log line, the
    ``dead_lettered`` count, the ``on_settled`` hook (handed a run that was
    never stored) and the task's FAILURE in the result backend.
    """
    request = task.request
    queue = (request.delivery_info or {}).get("routing_key")
    logger.error("durable.run.id_invalid task=%s queue=%s: %s", task.name, queue, err,
                 extra={"event": "durable.run.id_invalid", "task": task.name, "queue": queue})
    metrics.count(queue, "dead_lettered")
    at = SYSTEM_CLOCK.now()
    call_hook(task, Run(id=str(request.id), task_name=task.name, queue=queue, state=DEAD, attempts=0,
                        args="[]", kwargs="{}", result=None, last_error=f"RunIdInvalid: {err}",
                        started_at=at, updated_at=at, finished_at=at))
    raise err


def _claim_unseen_outcome(task: Any, conn: Any, url: str, run: Run, settler: str) -> Any:
    """Report the outcome of a settle whose COMMIT landed while its reply was lost, as its settler would have.

    This delivery is the settler's own re-send (it carries the settler's token):
    the store stayed away past the settler's wait in place. Only the copy whose
    claim matched the row counts the outcome and calls the hook; any other copy
    of the re-send is a plain duplicate.
    """
    try:
        with unavailable_as_error(url):
            claimed = runs.claim_unseen_outcome(conn, run.id, settler)
    except StoreUnavailable as err:
        return _wait_for_store(task, url, err, settler)
    if claimed is None:
        return _duplicate(task, run)
    _log_settle_recovered(task, claimed, "its re-send")
    metrics.count(claimed.queue, OUTCOME_COUNTS[claimed.state])
    call_hook(task, claimed)
    return _settled_answer(claimed)


def _duplicate(task: Any, run: Run) -> Any:
    logger.info("durable.run.duplicate task=%s id=%s state=%s", task.name, run.id, run.state,
                extra={"event": "durable.run.duplicate", "task": task.name, "run_id": run.id,
                       "state": run.state})
    metrics.count(run.queue, "duplicate")
    return _settled_answer(run)


def _settled_answer(run: Run) -> Any:
    """What a delivery that does not run the body answers: a succeeded run's result, or Ignore."""
    if run.state == SUCCEEDED:
        return from_json(run.result)
    # Acked, and nothing marked failed: the run settled before this delivery, or
    # sleeps until a wake-up message that exists.
    raise Ignore(f"durable run {run.id} is {run.state}: this copy does not run it")


def call_hook(task: Any, run: Run) -> None:
    """Hand a settled run to the task's ``on_settled`` hook; a failing hook is logged, never raised."""
    hook = getattr(task, "on_settled", None)
    if hook is None:
        return
    try:
        hook(run)
    except Exception:  # a broken hook must not change the run's outcome
        logger.exception("durable.run.hook_failed task=%s id=%s", task.name, run.id,
                         extra={"event": "durable.run.hook_failed", "task": task.name, "run_id": run.id})
