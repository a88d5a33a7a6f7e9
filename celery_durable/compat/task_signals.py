"""What Celery's task signals carry beyond their documented arguments: ``task_success``'s ``runtime``."""

from __future__ import annotations

import celery

#: The first Celery whose tracer sends ``task_success`` with ``runtime=`` (celery/app/trace.py, ``send_success``).
SUCCESS_RUNTIME_SINCE = (5, 7)


def success_carries_runtime(version: tuple[int, ...] | None = None) -> bool:
    """Whether ``task_success`` hands its receivers the task's runtime (else one must time the run itself)."""
    major_minor = tuple(version if version is not None else celery.VERSION[:2])[:2]
    return major_minor >= SUCCESS_RUNTIME_SINCE
