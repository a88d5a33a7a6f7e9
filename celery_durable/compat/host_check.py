"""At worker boot: is every host internal compat relies on present, and is each host release one we tested?

Each entry names a module and an attribute path the compat modules use, so a
Celery or kombu upgrade that drops one refuses the boot in one line naming it
instead of raising AttributeError deep in the claim loop. Attributes that only
exist on instances are checked on a throwaway instance where making one does no
I/O (``INSTANCE_TOUCH_POINTS``), on the live worker (compat.worker_controller),
or else (``Message._raw``, ``Producer._batch_local``, ``_chain._use_link``,
``Channel._queue_cycle``, ``Task.override_max_retries``) pinned by tests/compat/.
"""

from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass
from importlib import metadata

from celery_durable.errors import HostIncompatible

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TouchPoint:
    """A host name compat relies on: ``module``'s ``attribute`` (dotted), used by ``user``."""

    module: str
    attribute: str
    user: str

    @property
    def name(self) -> str:
        return f"{self.module}.{self.attribute}"


def _points(user: str, module: str, *attributes: str) -> list[TouchPoint]:
    return [TouchPoint(module, attribute, user) for attribute in attributes]


#: Every host name a compat module looks up on a class or module.
TOUCH_POINTS: tuple[TouchPoint, ...] = (
    *_points("compat.pool_alias", "celery.concurrency", "ALIASES"),
    *_points("compat.pool_alias", "celery.bin.worker", "WORKERS_POOL.choices"),
    *_points("compat.transport_alias", "kombu.transport", "TRANSPORT_ALIASES"),
    # Also relies on Channel._get, Channel._put, Channel._inplace_augment_message and Transport._deliver,
    # each named once above or below for its first user (a name listed twice is reported twice).
    *_points("compat.virtual_rows", "kombu.transport.virtual",
             "Channel._size", "Channel._purge", "Channel._delete",
             "Channel._new_queue", "Channel._has_queue", "Channel._restore", "Channel._restore_at_beginning",
             "Channel._get_message_priority", "Channel._lookup", "Transport.drain_events",
             "QoS.can_consume_max_estimate", "Transport.register_with_event_loop"),
    # In Celery's event loop: the hub polls the backend's wake-up fds (as kombu's Redis transport's sockets).
    *_points("compat.virtual_rows", "kombu.asynchronous", "Hub.add_reader", "Hub.remove_reader",
             "Hub.call_repeatedly"),
    *_points("compat.consumer", "celery.worker.consumer.consumer",
             "Consumer._limit_post_eta", "Consumer._restore_prefetch_count_after_connection_restart",
             "Consumer._update_prefetch_count",
             "Consumer.apply_eta_task", "Consumer.loop_args", "Consumer.create_task_handler",
             "Consumer.perform_pending_operations", "Consumer.on_ready", "Consumer.on_close"),
    *_points("compat.consumer", "celery.worker.loops", "asynloop"),
    *_points("compat.worker_state", "celery.worker.state", "should_stop", "should_terminate", "maybe_shutdown"),
    *_points("compat.request", "celery.worker.request",
             "Request._context", "Request.on_success", "Request.on_failure"),
    *_points("compat.asynpool", "celery.concurrency.asynpool",
             "AsynPool._event_process_exit", "AsynPool.maintain_pool"),
    *_points("compat.asynpool", "billiard.pool", "RUN"),
    *_points("compat.canvas", "celery.canvas", "_chain.prepare_steps", "_chord", "Signature._merge"),
    *_points("compat.redis_claim", "kombu.transport.redis",
             "Channel._q_for_pri", "Channel.priority_steps", "Channel.priority",
             "QoS.unacked_key", "QoS.unacked_index_key", "QoS.restore_visible"),
    *_points("compat.redis_claim", "kombu.transport.virtual", "QoS.append"),
    *_points("compat.redis_acks", "kombu.transport.virtual", "Channel.basic_ack", "QoS.ack"),
    *_points("compat.kombu_publish", "kombu.transport.redis", "Channel._inplace_augment_message"),
    *_points("compat.redis_claim", "kombu.transport.redis", "Channel.unacked_restore_limit"),
    *_points("compat.redis_channel", "kombu.transport.redis", "Channel.visibility_timeout",
             "Channel.conn_or_acquire"),
    *_points("compat.redis_channel", "kombu.transport.virtual", "Channel.qos"),
    # Channel._queue_cycle is an instance's (made in Channel.__init__ by cycle_by_name(queue_order_strategy)):
    # what makes it is checked here, the attribute by tests/compat/test_transport_guards.py.
    *_points("compat.transport_guards", "kombu.transport.redis", "Channel.queue_order_strategy"),
    *_points("compat.transport_guards", "kombu.utils.scheduling", "cycle_by_name", "round_robin_cycle.rotate"),
    *_points("compat.consumer", "celery.worker.consumer.consumer", "Consumer.Blueprint.default_steps"),
    *_points("compat.request", "celery.worker.request", "Request.acknowledged"),
    # Task.override_max_retries is set on the instance by Task.retry: tests/compat/test_autoretry.py pins it.
    *_points("compat.autoretry", "celery.app.autoretry", "add_autoretry_behaviour"),
    *_points("compat.autoretry", "celery.app.task", "Task.retry", "Task.max_retries"),
    *_points("compat.transport_guards", "kombu.transport.redis", "Channel._brpop_read", "Channel._in_poll",
             "Channel.sep", "Channel.client"),
    *_points("compat.transport_guards", "kombu.transport.virtual", "Transport._deliver", "Channel._put"),
    *_points("compat.transport_guards", "kombu.transport.sqlalchemy", "Channel._get", "Channel._get_or_create",
             "Channel.session", "Channel.message_cls"),
    *_points("compat.kombu_publish", "kombu.messaging", "Producer._publish"),
    *_points("compat.amqp", "amqp.channel",
             "Channel.send_method", "Channel.wait", "Channel._on_get_ok", "Channel._basic_publish"),
    *_points("compat.amqp", "amqp.spec", "Basic.Get", "Basic.GetOk", "Basic.GetEmpty", "Queue.Declare",
             "Queue.DeclareOk"),
    # Also sets read_frame on the transport instance, and relies on Hub.on_tick (a hub's, made in Hub.reset):
    # both pinned by tests/integration/test_amqp_cork.py.
    *_points("compat.amqp_cork", "amqp.connection", "Connection.frame_writer"),
    *_points("compat.amqp_cork", "amqp.method_framing", "frame_writer"),
    *_points("compat.amqp_cork", "amqp.transport", "_AbstractTransport.read_frame", "_AbstractTransport.write"),
    # Its arguments are pinned by tests/compat/test_sqlalchemy_errors.py.
    *_points("compat.sqlalchemy_errors", "sqlalchemy.engine.base", "Connection._handle_dbapi_exception"),
)

@dataclass(frozen=True)
class InstanceTouchPoint:
    """A host name only an instance has: ``attribute`` of ``module.factory()`` (a constructor doing no I/O)."""

    module: str
    factory: str
    attribute: str
    user: str

    @property
    def name(self) -> str:
        return f"{self.module}.{self.factory}().{self.attribute}"


#: Names set in a host constructor that a cheap instance shows (about 30 µs for both, measured).
INSTANCE_TOUCH_POINTS: tuple[InstanceTouchPoint, ...] = (
    InstanceTouchPoint("redis.connection", "Connection", "_sock", "compat.redis_claim"),
    InstanceTouchPoint("celery.concurrency.thread", "TaskPool", "executor", "compat.thread_pool"),
)


#: Names compat uses when the installed release has them, and does without otherwise
#: (each such use says what an older release lacks): never a reason to refuse a boot.
OPTIONAL_TOUCH_POINTS: tuple[TouchPoint, ...] = (
    *_points("compat.request", "celery.worker.request", "Request._eta_timer_entry"),          # celery 5.7
    *_points("compat.redis_claim", "kombu.transport.redis", "Channel._maybe_update_queues_expire"),  # kombu 5.7
    *_points("compat.kombu_publish", "kombu.transport.redis", "Channel.create_publish_batch",  # kombu 5.7
             "Channel.supports_batch_publish"),
)

#: The releases compat was tested on: (first, first release past the range).
TESTED: dict[str, tuple[tuple[int, int], tuple[int, int]]] = {
    "celery": ((5, 5), (5, 8)),
    "kombu": ((5, 5), (5, 8)),
}


def missing(points: tuple[TouchPoint, ...] = TOUCH_POINTS) -> list[TouchPoint]:
    """The touch points the installed packages do not have."""
    absent: list[TouchPoint] = []
    for point in points:
        try:
            obj: object = importlib.import_module(point.module)
        except ImportError:
            absent.append(point)
            continue
        for part in point.attribute.split("."):
            if not hasattr(obj, part):
                absent.append(point)
                break
            obj = getattr(obj, part)
    return absent


def missing_on_instances(
    points: tuple[InstanceTouchPoint, ...] = INSTANCE_TOUCH_POINTS,
) -> list[InstanceTouchPoint]:
    """The instance touch points a freshly made host object does not have."""
    absent = []
    for point in points:
        try:
            instance = getattr(importlib.import_module(point.module), point.factory)()
        except (ImportError, AttributeError, TypeError):
            absent.append(point)
            continue
        if not hasattr(instance, point.attribute):
            absent.append(point)
        executor = getattr(instance, "executor", None)
        if executor is not None:
            executor.shutdown(wait=False)  # the thread pool's: no thread was started, none is left
    return absent


def installed_version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "not installed"


def untested_releases() -> list[str]:
    """``"celery 5.8.0"`` for each host package installed outside the range compat was tested on."""
    out = []
    for package, (first, past) in TESTED.items():
        version = installed_version(package)
        release = _release(version)
        if release is None or not first <= release < past:
            out.append(f"{package} {version}")
    return out


def check_host() -> None:
    """Refuse (HostIncompatible, one line) if an internal is missing; warn once for an untested release."""
    absent: list[TouchPoint | InstanceTouchPoint] = [*missing(), *missing_on_instances()]
    versions = ", ".join(f"{name} {installed_version(name)}" for name in ("celery", "kombu", "billiard", "amqp"))
    if absent:
        names = ", ".join(point.name for point in absent)
        raise HostIncompatible(
            f"the installed host ({versions}) lacks {names}, which -P durable relies on "
            f"(celery_durable.{absent[0].user}); tested with {_tested_range()}"
        )
    untested = untested_releases()
    if untested:
        logger.warning("durable.compat.untested_release: %s is outside the range celery_durable was tested "
                       "on (%s); every internal it relies on is present", ", ".join(untested), _tested_range(),
                       extra={"event": "durable.compat.untested_release"})


def _tested_range() -> str:
    return ", ".join(f"{package} {first[0]}.{first[1]} to {past[0]}.{past[1] - 1}"
                     for package, (first, past) in TESTED.items())


def _release(version: str) -> tuple[int, int] | None:
    parts = version.split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return None
