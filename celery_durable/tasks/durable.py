"""``@app.durable_task``: a Celery task whose body runs as a durable run with checkpointed steps."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from celery import Task

from celery_durable.errors import NotDurable, NotJSON, RunExhausted, RunIdInvalid, SchemaOutdated, StepNameInvalid
from celery_durable.tasks.context import current
from celery_durable.tasks.execution import execute

#: Errors no retry can fix: they bury the run at once instead of burning its retries.
FINAL_ERRORS: tuple[type[BaseException], ...] = (
    NotJSON, StepNameInvalid, NotDurable, SchemaOutdated, RunExhausted, RunIdInvalid,
)


class DurableTask(Task):  # type: ignore[misc]
    """Base of every durable task: ``self.step``, ``self.sleep`` and the ``on_settled`` hook."""

    #: ``on_settled(run)`` is called once a run succeeds or goes dead; pass
    #: ``on_settled=fn`` to the decorator or override it in a base class.
    on_settled: Callable[[Any], None] | None = None

    def step(self, name: str, fn: Callable[..., Any], *args: Any, transactional: bool = False,
             **kwargs: Any) -> Any:
        """Run ``fn(*args, **kwargs)`` once per run; see :func:`celery_durable.step`."""
        return current().step(name, fn, args, kwargs, transactional)

    def sleep(self, name: str, seconds: float) -> None:
        """Sleep durably: the run is re-sent to wake after ``seconds``; its slot is freed now.

        In an eager run it returns at once (see :func:`celery_durable.sleep`).
        """
        current().sleep(name, seconds)


_bases: dict[type, type] = {}


def _durable_base(base: type) -> type:
    if issubclass(base, DurableTask):
        return base
    made = _bases.get(base)
    if made is None:
        made = type(f"Durable{base.__name__}", (DurableTask, base), {"__module__": __name__})
        _bases[base] = made
    return made


def durable_task(app: Any, *args: Any, **options: Any) -> Any:
    """``app.durable_task``: takes every option ``app.task`` takes (installed by ``celery_durable.install``).

    Defaults differ where durability needs it: ``acks_late`` and
    ``reject_on_worker_lost`` (a crashed run is redelivered, not lost) and
    ``autoretry_for=(Exception,)`` (a failing step retries under
    ``max_retries``/``retry_backoff``); the run goes dead when retries run out.
    """
    if args:
        if len(args) == 1 and callable(args[0]) and not options:
            return _decorate(app, args[0], {})
        raise TypeError("use @app.durable_task or @app.durable_task(**options)")
    return lambda fun: _decorate(app, fun, options)


def _decorate(app: Any, fun: Callable[..., Any], options: dict[str, Any]) -> Any:
    options = dict(options)
    bind = bool(options.pop("bind", False))
    options["base"] = _durable_base(options.get("base") or app.Task)
    hook = options.pop("on_settled", None)
    if hook is not None:
        options["on_settled"] = staticmethod(hook)
    options.setdefault("acks_late", True)
    options.setdefault("reject_on_worker_lost", True)
    options.setdefault("autoretry_for", (Exception,))
    options.setdefault("dont_autoretry_for", FINAL_ERRORS)

    @functools.wraps(fun)
    def run(self: Any, *a: Any, **kw: Any) -> Any:
        return execute(self, fun, bind, a, kw)

    return app.task(bind=True, **options)(run)
