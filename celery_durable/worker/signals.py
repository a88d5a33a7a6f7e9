"""Every Celery signal celery_durable listens to, connected (and disconnected) here and nowhere else."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from celery import signals

from celery_durable.compat.task_expiry import keep_expiry_in_headers
from celery_durable.compat.task_signals import success_carries_runtime
from celery_durable.tasks.revocation import on_task_revoked
from celery_durable.tasks.sent_stamp import stamp

Receiver = Callable[..., Any]


def connect_install() -> None:
    """What ``install(app)`` adds to every process: a revoke cancels its run; each message sent is stamped
    and keeps its expiry in its headers (an expired task ends REVOKED, not dropped by RabbitMQ unseen).

    Once per process, however many apps install celery_durable (the dispatch uids).
    """
    signals.task_revoked.connect(on_task_revoked, weak=False, dispatch_uid="celery_durable.task_revoked")
    signals.before_task_publish.connect(stamp, weak=False, dispatch_uid="celery_durable.sent_stamp")
    signals.before_task_publish.connect(keep_expiry_in_headers, weak=False,
                                        dispatch_uid="celery_durable.keep_expiry_in_headers")


def connect_task_outcomes() -> None:
    """A ``-P durable`` worker counts every task it runs (``worker/task_outcomes.py``); once per process.

    ``task_prerun`` only where ``task_success`` lacks the runtime (Celery before 5.7): Celery's tracer sends a
    signal only if it has receivers, and a send cost each task ~2.5 us in the pool child for a start time
    Celery 5.7 measures itself.
    """
    from celery_durable.worker import task_outcomes as outcomes

    receivers: list[tuple[Any, Receiver]] = [
        (signals.task_success, outcomes.on_success), (signals.task_retry, outcomes.on_retry),
        (signals.task_failure, outcomes.on_failure), (signals.task_revoked, outcomes.on_revoked)]
    if not success_carries_runtime():
        receivers.append((signals.task_prerun, outcomes.on_prerun))
    for signal, receiver in receivers:
        signal.connect(receiver, weak=False, dispatch_uid=f"celery_durable.task_outcomes.{receiver.__name__}")


def connect_boot(on_celeryd_init: Receiver, on_worker_init: Receiver) -> None:
    """A worker's boot: its command line read at ``celeryd_init``, ``-P durable`` wired at ``worker_init``."""
    signals.celeryd_init.connect(on_celeryd_init, weak=False, dispatch_uid="celery_durable.celeryd_init")
    signals.worker_init.connect(on_worker_init, weak=False, dispatch_uid="celery_durable.worker_init")


def connect_worker_shutdown(receiver: Receiver) -> None:
    """Called after a warm shutdown has joined the pool (a cold shutdown sends nothing)."""
    signals.worker_shutdown.connect(receiver, weak=False)


def connect_consumer(consumer: Any, on_received: Receiver, on_revoked: Receiver) -> None:
    """The durable consumer's receivers: each request the strategy made (its own), each revoke."""
    signals.task_received.connect(on_received, sender=consumer, weak=False)
    signals.task_revoked.connect(on_revoked, weak=False)


def disconnect_consumer(consumer: Any, on_received: Receiver, on_revoked: Receiver) -> None:
    """A stopped consumer's receivers go with it: connected with weak=False, they would keep it alive and called."""
    signals.task_received.disconnect(on_received, sender=consumer)
    signals.task_revoked.disconnect(on_revoked)
