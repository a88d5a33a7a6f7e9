"""``celery durable dashboard``: the fleet on one live page, served from the data ``status`` reads.

One process: a sampler thread takes a snapshot (``cli/status.py``) every
``--interval`` seconds and keeps the last ``--window`` of them
(``cli/dashboard_history.py``); a small HTTP server (the standard library's,
guarded by ``cli/dashboard_http.py``) serves the page (``dashboard.html`` with
its ``dashboard.js`` and ``dashboard.css``, no build step: it draws its own
charts) and ``/api/state``, which the page polls. Read-only unless
``durable_dashboard_token`` is set: then ``POST /api/runs/<id>/requeue`` and
``/cancel`` act, for a request that carries the token in ``X-Durable-Token``.
Binds 127.0.0.1 unless told otherwise.
"""

from __future__ import annotations

import hmac
import json
import logging
import threading
from http import HTTPStatus
from importlib import resources
from time import time
from typing import Any
from urllib.parse import unquote

import click
from celery.bin.base import CeleryCommand

from celery_durable.cli.dashboard_history import History
from celery_durable.cli.dashboard_http import DashboardServer, GuardedHandler
from celery_durable.cli.dashboard_reads import read_panels
from celery_durable.cli.group import durable, store_url_of
from celery_durable.cli.options import Seconds
from celery_durable.cli.status import fleet_snapshot
from celery_durable.config import DurableConfig, from_celery_conf
from celery_durable.errors import ConfigInvalid, DurableError
from celery_durable.headers import DASHBOARD_TOKEN_HEADER

logger = logging.getLogger(__name__)

#: The files the page is made of: path -> (file in this package, Content-Type).
PAGE_FILES = {
    "/": ("dashboard.html", "text/html; charset=utf-8"),
    "/index.html": ("dashboard.html", "text/html; charset=utf-8"),
    "/dashboard.js": ("dashboard.js", "text/javascript; charset=utf-8"),
    "/dashboard.css": ("dashboard.css", "text/css; charset=utf-8"),
}


class Dashboard:
    """The sampled state and the actions the page may ask for."""

    def __init__(self, app: Any, url: str, config: DurableConfig, *, interval: float, window: float) -> None:
        self.app = app
        self.url = url
        self.config = config
        self.token = config.dashboard_token
        self.interval = interval
        self.history = History(window)
        self._state: dict[str, Any] = {"latest": None, "dead_runs": [], "panels": {"problems": []},
                                       "history": self.history.series()}
        self._lock = threading.Lock()
        self._stopping = threading.Event()

    # -- sampling -------------------------------------------------------------------------
    def sample(self) -> None:
        snapshot = fleet_snapshot(self.app, self.url, timeout=min(1.0, self.interval / 2))
        try:
            found = self._panels()
        except Exception as err:  # noqa: BLE001 - shown on the page with the rest of what could not be read
            found = {"problems": [f"the beat, limits, sleeping runs and outbox could not be read: "
                                  f"{str(err).splitlines()[0]}"]}
        now = time()
        with self._lock:
            self.history.add(now, snapshot)
            self._state = {"latest": snapshot.as_json(), "dead_runs": found.pop("dead_runs", []), "panels": found,
                           "history": self.history.series(), "sampled_at": now}

    def _panels(self) -> dict[str, Any]:
        from celery_durable.store.engine import ensure_schema, unavailable_as_error

        with unavailable_as_error(self.url), ensure_schema(self.url).connect() as conn:
            return read_panels(conn, self.app, self.config)

    def run_sampler(self) -> None:
        """Sample every ``interval`` until stopped (the first sample is taken before the server starts)."""
        while not self._stopping.wait(self.interval):
            try:
                self.sample()
            except Exception:  # the next round tries again; the page shows the last state
                logger.warning("durable.dashboard.sample_failed", exc_info=True,
                               extra={"event": "durable.dashboard.sample_failed"})

    def stop(self) -> None:
        self._stopping.set()

    def state(self) -> dict[str, Any]:
        with self._lock:
            return {**self._state, "read_only": self.token is None}

    # -- actions --------------------------------------------------------------------------
    def allows(self, given: str | None) -> bool:
        return self.token is not None and given is not None and hmac.compare_digest(given, self.token)

    def act(self, verb: str, run_id: str) -> str:
        """Requeue or cancel ``run_id``; the line the page shows. Raises DurableError when refused."""
        from celery_durable.tasks import runs as run_actions

        if verb == "requeue":
            run_actions.requeue(run_id, app=self.app)
            return f"{run_id}: requeued"
        run_actions.cancel(run_id, app=self.app, reason="cancelled by an operator (celery durable dashboard)")
        return f"{run_id}: cancelled"


def _handler(dashboard: Dashboard, files: dict[str, tuple[bytes, str]]) -> type[GuardedHandler]:
    class Handler(GuardedHandler):
        def do_GET(self) -> None:  # the standard library's name
            if self.path in files:
                self._send(HTTPStatus.OK, *files[self.path])
            elif self.path == "/api/state":
                self._json(HTTPStatus.OK, dashboard.state())
            else:
                self._json(HTTPStatus.NOT_FOUND, {"error": f"no such page: {self.path}"})

        def do_POST(self) -> None:  # the standard library's name
            from celery_durable.errors import RunNotDead, RunNotFound, RunSettled

            parts = self.path.strip("/").split("/")
            if len(parts) != 4 or parts[:2] != ["api", "runs"] or parts[3] not in ("requeue", "cancel"):
                self._json(HTTPStatus.NOT_FOUND, {"error": f"no such action: {self.path}"})
                return
            if dashboard.token is None:
                self._json(HTTPStatus.FORBIDDEN, {"error": "read-only: set durable_dashboard_token to allow actions"})
                return
            if not dashboard.allows(self.headers.get(DASHBOARD_TOKEN_HEADER)):
                self._json(HTTPStatus.FORBIDDEN, {"error": "the token is missing or wrong"})
                return
            run_id, verb = unquote(parts[2]), parts[3]
            try:
                done = dashboard.act(verb, run_id)
            except (RunNotFound, RunNotDead, RunSettled) as err:
                self._json(HTTPStatus.CONFLICT, {"error": str(err)})
                return
            except DurableError as err:
                self._json(HTTPStatus.SERVICE_UNAVAILABLE, {"error": str(err).splitlines()[0]})
                return
            logger.info("durable.dashboard.%s run=%s", verb, run_id,
                        extra={"event": f"durable.dashboard.{verb}", "run_id": run_id})
            self._json(HTTPStatus.OK, {"done": done})

        def _json(self, status: HTTPStatus, body: dict[str, Any]) -> None:
            self._send(status, json.dumps(body).encode(), "application/json")

        def _send(self, status: HTTPStatus, body: bytes, content_type: str) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:  # the standard library's name
            logger.debug("durable.dashboard.request " + format, *args, extra={"event": "durable.dashboard.request"})

    return Handler


def dashboard_config(app: Any) -> DurableConfig:
    """The app's ``durable_*`` settings (the token, the lease TTLs the panels judge lateness by), validated
    as a worker would; one line naming a setting that is not valid."""
    try:
        return from_celery_conf(app.conf)
    except ConfigInvalid as err:
        raise click.ClickException(str(err)) from None


@durable.command(cls=CeleryCommand, name="dashboard")
@click.option("--port", default=5577, show_default=True, type=click.IntRange(1, 65535))
@click.option("--host", default="127.0.0.1", show_default=True, help="the address to listen on")
@click.option("--interval", default=2.0, show_default=True, type=Seconds(0.2, 3600),
              help="seconds between samples")
@click.option("--window", default=600.0, show_default=True, type=Seconds(10, 86400),
              help="seconds of history the charts show")
@click.pass_context
def dashboard(ctx: click.Context, port: int, host: str, interval: float, window: float) -> None:
    """A live page: workers, queues, runs, the beat, fleet limits, sleeping runs, the outbox, dead runs
    (requeue and cancel with durable_dashboard_token)."""
    app = ctx.find_root().obj.app
    config = dashboard_config(app)
    app.loader.import_default_modules()  # the tasks its beat_schedule names, as beat imports them
    board = Dashboard(app, store_url_of(app), config, interval=interval, window=window)
    package = resources.files("celery_durable.cli")
    files = {path: (package.joinpath(name).read_bytes(), content_type)
             for path, (name, content_type) in PAGE_FILES.items()}
    try:
        server = DashboardServer((host, port), _handler(board, files))
    except OSError as err:
        raise click.ClickException(f"cannot listen on {host}:{port}: {err.strerror or err}") from None
    board.sample()  # the first page load has data
    threading.Thread(target=board.run_sampler, name="durable-dashboard-sampler", daemon=True).start()
    mode = "read-only" if board.token is None else "requeue and cancel need the token"
    click.echo(f"durable dashboard on http://{host}:{port}/ ({mode})", err=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        board.stop()
        server.server_close()
