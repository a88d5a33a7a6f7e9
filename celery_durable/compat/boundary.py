"""The rule tests/unit/test_host_boundary.py enforces: host internals are touched in compat/ only.

Outside ``celery_durable/compat/`` no module may read or write an attribute
whose name starts with ``_`` on an object that is not its own (``self``/``cls``),
look one up by string (``getattr(x, "_y")``), override or use a private name
of a Celery/kombu/billiard/py-amqp base class, or name one of the
undocumented host names below, or assign one of the host attributes whose
writes are compat's. The allow-lists say why each exception is not a host internal.
"""

from __future__ import annotations

#: The host packages whose internals are compat's alone.
HOST_PACKAGES = ("celery", "kombu", "billiard", "amqp", "vine")

#: Undocumented (public-looking) host names: only compat may use them.
UNDOCUMENTED_HOST_NAMES = frozenset({
    "ALIASES", "WORKERS_POOL",                            # celery's pool table and -P choices
    "TRANSPORT_ALIASES",                                  # kombu's transport table (alias+url)
    "should_stop", "should_terminate", "maybe_shutdown",  # celery.worker.state globals
    "asynloop", "synloop", "loop_args",                   # the consumer's loop protocol
    "prepare_steps",                                      # canvas internals
    "send_method", "returns_tuple",                       # py-amqp frames
    "unacked_key", "unacked_index_key", "restore_visible", "unacked_restore_limit",
    "priority_steps",                                     # kombu's Redis layout
    "conn_or_acquire", "qos", "visibility_timeout",       # kombu's Redis channel (compat.redis_channel)
    "pool_cls", "consumer_cls",                           # the WorkController (compat.worker_controller)
    "default_steps",                                      # a Blueprint's steps (compat.consumer)
    "executor",                                           # the thread pool's (compat.thread_pool)
    "override_max_retries",                               # Task.retry's override (compat.autoretry)
})

#: Host attributes whose reads are public but whose writes are not: only compat may assign them.
HOST_NAMES_NOT_WRITTEN = {
    "concurrency": "WorkController.concurrency sizes the pool (compat.worker_controller.size_pool)",
    "acknowledged": "Request.acknowledged skips the late ack (compat.request.skip_ack)",
}

#: ``_``-names that are documented public API of a non-host library, allowed anywhere.
PRIVATE_NAMES_ALLOWED = {
    "_mapping": "SQLAlchemy Row._mapping is documented public API (a Row as a mapping)",
    "_exit": "os._exit, the standard library's immediate exit (crash tests and forked children)",
    "_asdict": "namedtuple._asdict, documented standard library API",
    "_replace": "namedtuple/dataclass-style _replace, documented standard library API",
}
