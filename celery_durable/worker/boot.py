"""Registers ``-P durable`` with Celery and, when a worker boots on it, validates and wires it."""

from __future__ import annotations

import atexit
import logging
import os
from typing import Any

from celery_durable import shared_dir
from celery_durable.compat import worker_controller as controller
from celery_durable.compat.host_check import check_host
from celery_durable.compat.pool_alias import register_pool_alias
from celery_durable.config import DurableConfig, from_celery_conf
from celery_durable.errors import ConfigInvalid, HostIncompatible
from celery_durable.metrics.tasks import set_names_limit
from celery_durable.planning import limit_declarations as declarations
from celery_durable.planning.capacity import cap_above_pool, unsized_pool
from celery_durable.planning.limit_declarations import LimitInvalid, TaskLimits
from celery_durable.worker import cli_options
from celery_durable.worker.signals import connect_boot, connect_task_outcomes, connect_worker_shutdown
from celery_durable.worker.wiring import CommandLine, wire, wiring_for

logger = logging.getLogger(__name__)

POOL_ALIAS = "durable"
POOL_PATH = "celery_durable.worker.prefork:DurablePool"
THREAD_POOL_PATH = "celery_durable.worker.threads:DurableThreadPool"
CONSUMER_PATH = "celery_durable.worker.consumer:DurableConsumer"

_registered = False


def register() -> None:
    """Make ``-P durable`` and ``worker_pool = "durable"`` resolve to the durable pool.

    Called when ``celery_durable`` is imported and from the ``celery.commands``
    entry point, so it works whether or not the app module imports us. Celery
    freezes ``-P``'s choices into a click Choice at import of its worker
    command, so the alias is added there too.
    """
    global _registered
    register_pool_alias(POOL_ALIAS, POOL_PATH)
    if _registered:
        return
    connect_boot(_remember_command_line, _wire_durable_worker)
    _registered = True


def is_durable_pool(pool_cls: Any) -> bool:
    if isinstance(pool_cls, str):
        return pool_cls in (POOL_ALIAS, POOL_PATH, THREAD_POOL_PATH)
    from celery_durable.worker.pool import DurablePoolMixin

    return isinstance(pool_cls, type) and issubclass(pool_cls, DurablePoolMixin)


def _remember_command_line(sender: Any = None, instance: Any = None, conf: Any = None,
                           options: Any = None, **_: Any) -> None:
    if instance is None:
        return
    options = options or {}
    overrides: dict[str, Any] = {}
    refused = None
    try:
        overrides = cli_options.overrides(options)
    except ConfigInvalid as err:
        # Refused at worker_init with the settings, in the same one line.
        refused = cli_options.naming_the_option(err, cli_options.WORKER_FLAGS)
    wire(instance, command_line=CommandLine(
        concurrency_given=bool(options.get("concurrency") or (conf or {}).get("worker_concurrency")),
        autoscale=bool(options.get("autoscale")),
        overrides=overrides,
        refused=refused,
    ))


def _wire_durable_worker(sender: Any = None, **_: Any) -> None:
    worker = sender
    if worker is None:
        return
    if not is_durable_pool(controller.pool_of(worker)):
        _refuse_limits_unchecked(worker)
        return
    try:
        check_host()
        controller.check_worker(worker)
    except HostIncompatible as err:
        logger.error("durable.host.incompatible: %s", err,
                     extra={"event": "durable.host.incompatible", "error": str(err)})
        raise SystemExit(f"celery_durable: refusing to start: {err}") from None
    try:
        config = _validated_config(worker)
        if config.metrics_port is not None:
            from celery_durable.metrics.registry import bind

            # Bound here, not when the consumer starts: a port in use or a host that does
            # not resolve refuses the boot in one line like any other bad setting.
            bind(config.metrics_host, config.metrics_port)
        limits = declarations.of_app(worker.app)
        if limits:
            _check_store_for_limits(limits, config)
    except (ConfigInvalid, LimitInvalid) as err:
        # One clear line, no traceback wall: the worker refuses to boot.
        logger.error("durable.config.invalid: %s", err,
                     extra={"event": "durable.config.invalid", "setting": err.setting, "error": str(err)})
        raise SystemExit(f"celery_durable: refusing to start: {err}") from None
    command_line = wire(worker, config=config, limits=limits).command_line
    set_names_limit(config.metrics_task_names_limit)
    # Before the pool forks: its children count the tasks they run with these receivers.
    connect_task_outcomes()
    controller.use_pool(worker, THREAD_POOL_PATH if config.execution == "threads" else POOL_PATH)
    if config.execution == "prefork":
        _share_counts(worker)
    controller.use_consumer(worker, CONSUMER_PATH)
    if not command_line.concurrency_given:
        # With no -c the pool is sized to what the worker may hold: the claimer's capacity rule.
        slots = [config.slots_for(q) for q in worker.app.amqp.queues.consume_from]
        controller.size_pool(worker, unsized_pool(config.max_in_flight, controller.pool_size(worker), slots))
    elif cap_above_pool(config.max_in_flight, controller.pool_size(worker)):
        logger.warning(
            "durable.boot.cap_above_pool: durable_max_in_flight=%s exceeds the pool size %s; "
            "the worker holds at most %s (it never buffers runs the pool cannot start)",
            config.max_in_flight, controller.pool_size(worker), controller.pool_size(worker),
            extra={"event": "durable.boot.cap_above_pool", "max_in_flight": config.max_in_flight,
                   "pool_size": controller.pool_size(worker)},
        )


def _refuse_limits_unchecked(worker: Any) -> None:
    """A worker on another pool would run a limited task with no limit: it refuses to boot, naming it."""
    try:
        limits = declarations.of_app(worker.app)
    except LimitInvalid as err:
        raise SystemExit(f"celery_durable: refusing to start: {err}") from None
    for name, task_limits in limits.items():
        option = declarations.first_option(task_limits)
        pool_cls = controller.pool_of(worker)
        pool = pool_cls if isinstance(pool_cls, str) else pool_cls.__module__.rsplit(".", 1)[-1]
        message = (f"task {name!r} declares {option}, which only a -P durable worker enforces; "
                   f"this worker (-P {pool}) would run it unchecked")
        logger.error("durable.limit.unenforced: %s", message,
                     extra={"event": "durable.limit.unenforced", "task": name, "option": option})
        raise SystemExit(f"celery_durable: refusing to start: {message}")


def _check_store_for_limits(limits: dict[str, TaskLimits], config: DurableConfig) -> None:
    from celery_durable.store.engine import ensure_schema, resolve_url, unavailable_as_error
    from celery_durable.store.urls import shown_url

    url = resolve_url(config.database_url)
    try:
        with unavailable_as_error(url):
            ensure_schema(url)
    except Exception as err:  # noqa: BLE001 - any failure to reach or migrate the store refuses, named
        name, task_limits = next(iter(limits.items()))
        raise LimitInvalid(f"task {name!r} declares {declarations.first_option(task_limits)}, which needs the "
                           f"durable store, and {shown_url(url)} cannot be used: "
                           f"{str(err).strip().splitlines()[0]}") from None


def _share_counts(worker: Any) -> None:
    # worker_init comes before the pool forks: every child inherits the
    # directory's name, so the parent's metrics endpoint sums their run counts.
    directory = shared_dir.share()
    owner = os.getpid()

    def remove(sender: Any = None, **_: Any) -> None:
        # A forked child inherits atexit handlers: only the worker removes it.
        if os.getpid() == owner and sender in (None, worker):
            shared_dir.unshare(directory)

    # Sent after a warm shutdown has joined the pool: no child counts after it.
    connect_worker_shutdown(remove)
    # A cold shutdown sends no worker_shutdown.
    atexit.register(remove)


def _validated_config(worker: Any) -> DurableConfig:
    command_line = wiring_for(worker).command_line
    if command_line.autoscale or getattr(worker, "autoscale", None):
        raise ConfigInvalid("--autoscale", "cannot be used with -P durable: size the pool with -c "
                                           "(pool_grow and pool_shrink move the capacity with it) and scale "
                                           "the number of workers instead (examples/autoscaling/)")
    if command_line.refused is not None:
        raise command_line.refused
    overrides = command_line.overrides
    try:
        config = from_celery_conf(worker.app.conf, overrides)
    except ConfigInvalid as err:
        raise cli_options.naming_the_option(err, overrides) from None
    return config
