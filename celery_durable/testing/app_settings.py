"""The settings a test's worker and the test's own app run with, applied to the app and taken back after.

``settings_for_test`` is the pure plan; ``TestAppSettings`` applies it to the
app in the test process (which sends the test's tasks and reads their results)
and restores what the app had at teardown, dropping the connections the app
cached for the test's broker and result backend either way: without that, the
next test with another ``broker_url`` would send to this test's broker.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from celery_durable.compat.app_connections import forget_connections

#: The result backend a test gets when its app configures none: results come back over the test's own
#: broker to the process that sent the task (what ``AsyncResult.get()`` in a test needs), no server, no file.
DEFAULT_RESULT_BACKEND = "rpc://"


def settings_for_test(app_conf: Mapping[str, Any], *, broker_url: str, store_url: str,
                      conf: Mapping[str, Any], in_process: bool) -> dict[str, Any]:
    """What the test's worker and app are configured with; ``conf`` (the test's own) wins over every default."""
    settings: dict[str, Any] = {"broker_url": broker_url, "durable_database_url": store_url}
    if not app_conf.get("result_backend"):
        settings["result_backend"] = DEFAULT_RESULT_BACKEND
    if in_process:
        # The tasks run on the test process's threads: forking the test runner is what a test avoids.
        settings["durable_execution"] = "threads"
        # Celery would take the root logger's handlers, pytest's caplog and live logging among them.
        settings["worker_hijack_root_logger"] = False
    settings.update(conf)
    return settings


class TestAppSettings:
    """``settings`` applied to ``app`` until ``restore()``."""

    __test__ = False  # not a pytest test class

    def __init__(self, app: Any, settings: Mapping[str, Any]) -> None:
        self.app = app
        conf = app.conf
        self.had = {key: conf[key] for key in settings if key in conf}
        self.added = [key for key in settings if key not in conf]
        conf.update(settings)
        forget_connections(app)

    def restore(self) -> None:
        conf = self.app.conf
        conf.update(self.had)
        for key in self.added:
            conf.pop(key, None)
        forget_connections(self.app)
