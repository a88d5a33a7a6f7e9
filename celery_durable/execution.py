"""One execution of a durable run: start the attempt, run the body with its step context, settle it."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from celery.exceptions import Ignore, Reject, Retry

from . import metrics
from .checkpoints import Ledger, encode, from_json
from .context import RunContext, _current
from .errors import NotDurable
from .store import runs, steps
from .store.engine import autocommit, ensure_schema, store_url, unavailable_as_error
from .store.runs import Run
from .store.schema import DEAD, FAILED, SUCCEEDED

logger = logging.getLogger("celery_durable.run")


def will_retry(task: Any, exc: BaseException) -> bool:
    """Whether Celery's autoretry (the task's retry policy) will send this run again after ``exc``."""
    retry_for = tuple(getattr(task, "autoretry_for", ()) or ())
    never_for = tuple(getattr(task, "dont_autoretry_for", ()) or ())
    if not retry_for or not isinstance(exc, retry_for) or (never_for and isinstance(exc, never_for)):
        return False
    max_retries = getattr(task, "override_max_retries", task.max_retries)
    return max_retries is None or task.request.retries < max_retries


def execute(task: Any, body: Callable[..., Any], bind: bool, args: tuple[Any, ...],
            kwargs: dict[str, Any]) -> Any:
    request = task.request
    if request.called_directly:
        raise NotDurable(f"{task.name} is a durable task: run it with .delay(), .apply_async() or .apply(), "
                         f"not by calling it (a run needs a task id)")
    url = store_url(task.app)
    # Checked before anything is written: a run is stored only if it can be requeued as it came.
    args_json = encode(f"the arguments of {task.name}", list(args))
    kwargs_json = encode(f"the keyword arguments of {task.name}", dict(kwargs))
    engine = ensure_schema(url)
    queue = (request.delivery_info or {}).get("routing_key")
    with unavailable_as_error(url):
        conn = autocommit(engine).connect()
        try:
            run, fresh = runs.begin_attempt(conn, run_id=request.id, task_name=task.name, queue=queue,
                                            args=args_json, kwargs=kwargs_json)
            # attempts == 1 only on the insert that created the run: no step can exist yet,
            # so a new run skips the read (every later attempt counts one more).
            ledger = Ledger(stored=steps.load(conn, run.id)) if fresh and run.attempts > 1 else Ledger()
        except BaseException:
            conn.close()
            raise
    if not fresh:
        conn.close()
        return _duplicate(task, run)

    ctx = RunContext(task=task, run=run, ledger=ledger, conn=conn, engine=engine, url=url)
    token = _current.set(ctx)
    try:
        try:
            value = body(task, *args, **kwargs) if bind else body(*args, **kwargs)
            encoded = encode(f"the result of {task.name}", value)
        except (Ignore, Reject):
            # A durable sleep (or the body's own choice): the run is not over and did not fail.
            raise
        except Retry as exc:
            if _settle(ctx, FAILED, error=runs.render_error(exc.exc or exc), quiet=True):
                metrics.count(run.queue, "failed")
            raise
        except Exception as exc:
            if will_retry(task, exc):
                if _settle(ctx, FAILED, error=runs.render_error(exc), quiet=True):
                    metrics.count(run.queue, "failed")
            else:
                settled = _settle(ctx, DEAD, error=runs.render_error(exc), quiet=True)
                if settled is not None:
                    logger.error("durable.run.dead task=%s id=%s error=%s", task.name, run.id,
                                 settled.last_error,
                                 extra={"event": "durable.run.dead", "task": task.name, "run_id": run.id,
                                        "error": settled.last_error})
                    metrics.count(run.queue, "dead_lettered")
                    call_hook(task, settled)
            raise
        # Not quiet: if the outcome cannot be written the attempt fails and
        # retries, replaying every step, instead of ending unrecorded.
        settled = _settle(ctx, SUCCEEDED, result=encoded, quiet=False)
        if settled is not None:
            metrics.count(run.queue, "succeeded")
            call_hook(task, settled)
        return value
    finally:
        _current.reset(token)
        conn.close()


def _settle(ctx: RunContext, state: str, *, result: str | None = None, error: str | None = None,
            quiet: bool) -> Run | None:
    """The run as settled by this attempt; None if a cancel settled it first (nothing left to count)."""
    try:
        with unavailable_as_error(ctx.url):
            settled = runs.settle(ctx.conn, ctx.run, state, result=result, error=error)
    except Exception:
        if not quiet:
            raise
        # The body's own exception is what Celery must see; the row keeps its last state.
        logger.warning("durable.run.settle_failed id=%s state=%s", ctx.run.id, state, exc_info=True)
        return Run(**{**ctx.run.__dict__, "state": state, "result": result, "last_error": error})
    if settled is None:
        logger.info("durable.run.settled_before id=%s state=%s: cancelled while this attempt ran",
                    ctx.run.id, state,
                    extra={"event": "durable.run.settled_before", "run_id": ctx.run.id, "state": state})
    return settled


def _duplicate(task: Any, run: Run) -> Any:
    logger.info("durable.run.duplicate task=%s id=%s state=%s", task.name, run.id, run.state,
                extra={"event": "durable.run.duplicate", "task": task.name, "run_id": run.id,
                       "state": run.state})
    metrics.count(run.queue, "duplicate")
    if run.state == SUCCEEDED:
        return from_json(run.result)
    # Acked, and nothing marked failed: the run settled before this delivery.
    raise Ignore(f"durable run {run.id} already settled as {run.state}")


def call_hook(task: Any, run: Run) -> None:
    """Hand a settled run to the task's ``on_settled`` hook; a failing hook is logged, never raised."""
    hook = getattr(task, "on_settled", None)
    if hook is None:
        return
    try:
        hook(run)
    except Exception:  # a broken hook must not change the run's outcome
        logger.exception("durable.run.hook_failed task=%s id=%s", task.name, run.id)
