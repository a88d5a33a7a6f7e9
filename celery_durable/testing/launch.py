"""``python -m celery_durable.testing.launch APP CONF_JSON worker ARGS...``: a worker of APP with CONF applied.

The pytest plugin starts a real ``celery worker`` subprocess for a user's app
and must point it at the test's broker and throw-away store. The app module
sets its own conf when imported, so the test's settings are applied after the
import and before Celery reads them: the app is found as ``-A`` finds it, updated,
and its own ``start`` runs the worker command (``worker_main`` would drop the exit code).
"""

from __future__ import annotations

import json
import sys

from celery.app.utils import find_app


def main(argv: list[str]) -> None:
    if len(argv) < 3 or argv[2] != "worker":
        raise SystemExit("usage: python -m celery_durable.testing.launch APP CONF_JSON worker [ARGS...]")
    app_path, conf_json, *worker_argv = argv
    app = find_app(app_path)
    app.conf.update(json.loads(conf_json))
    raise SystemExit(app.start(worker_argv) or 0)


if __name__ == "__main__":
    main(sys.argv[1:])
