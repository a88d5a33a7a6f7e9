"""The console's panels Flower has no data for, on state real processes build: a ``celery beat`` leader, a held
fleet limit with a waiter, a durably sleeping run and an outbox row whose publish failed, shown by the API and
highlighted on the page in a real headless Chromium.

``DASHBOARD_PANELS_SCREENSHOT=path`` saves the page as the test sees it (how docs/dashboard-panels.png is made).
"""

from __future__ import annotations

import json
import os
import socket
import urllib.request
from datetime import datetime, timezone
from typing import Any

import celery_durable
from celery_durable import outbox
from celery_durable.outbox.relay import Relay
from celery_durable.store import outbox as store_outbox
from celery_durable.store.engine import engine_for
from tests.e2e.durable_support import conf, durable_scenario, run_state  # noqa: F401 - a fixture
from tests.e2e.harness import wait_for
from tests.e2e.test_dashboard import browser, on_page, running_dashboard  # noqa: F401 - a fixture

APP = "tests.e2e.consoleapp"
ENTRIES = {"every1": {"every": 1}}
ORG_SCOPE = ("limits.sync_org", "key", "org:acme")
#: A serializer kombu does not have: every relay's publish of the row fails, and the row keeps the error.
POISON_ERROR = "SerializerNotInstalled: No encoder installed for nope"


def _state(port: int) -> dict[str, Any]:
    return dict(json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/api/state", timeout=5).read()))


def _failing(url: str) -> list[dict[str, Any]]:
    with engine_for(url).connect() as conn:
        return store_outbox.failing(conn, 10)


def test_the_page_shows_the_beat_leader_a_held_limit_a_sleeping_run_and_a_stuck_outbox_with_its_cause(
        durable_scenario, browser):
    s, url = durable_scenario("postgresql", "redis")
    beat = s.beat(conf=conf(url, durable_beat_lease_ttl=2.0), entries=ENTRIES, app=APP).wait_started()
    s.worker(app=APP, conf=conf(url), concurrency=2).wait_ready()

    # A limit held (one run per org) and a second run of the org waiting its turn.
    s.send_task("q", "limits.sync_org", ["acme", "hold", 120])
    wait_for(lambda: s.labelled("start", "hold"), timeout=30, what="the org's first run to start")
    waiter = s.send_task("q", "limits.sync_org", ["acme", "wait", 0])
    # A durable run asleep for an hour.
    nap = s.send_task("q", "console.nap", ["nap", 3600])
    wait_for(lambda: run_state(url, nap) == "sleeping", timeout=30, what="the run to sleep")
    # An outbox row no relay can publish; the relay keeps the error in the row.
    s.producer.conf.durable_database_url = url
    celery_durable.install(s.producer)
    with engine_for(url).begin() as conn:
        poison = outbox.enqueue(conn, s.producer.signature("e2e.record", ("poison",)), serializer="nope").id
    Relay(s.producer, url=url, listen=False).run_pass()
    wait_for(lambda: any(row["task_id"] == poison for row in _failing(url)), timeout=10,
             what="the row's failed publish in the store")

    with running_dashboard(s, url, None, app=APP, E2E_BEAT=json.dumps(ENTRIES)) as port:
        # The API the page reads.
        def panels() -> dict[str, Any] | None:
            found = _state(port)["panels"]
            beat_panel = found.get("beat") or {}
            ready = (beat_panel.get("leader") and beat_panel.get("last_fire")
                     and any(s_["key"] == "org:acme" and s_["waiting"] for s_ in found.get("limits", [])))
            return found if ready else None

        found = wait_for(panels, timeout=30, what="the panels to show the beat's leader and fire, and the waiter",
                         every=0.25)
        leader = found["beat"]["leader"]
        assert leader["pid"] == beat.process.pid and socket.gethostname().startswith(leader["host"]), leader
        assert leader["holder"] == beat.holder
        (every1,) = found["beat"]["entries"]
        assert every1["name"] == "every1" and every1["task"] == "beat.tick" and every1["paused"] is False
        assert every1["last_fire_at"] is not None and 0 <= every1["lag_seconds"] < 5, every1
        assert datetime.fromisoformat(every1["next_due"]) > datetime.fromisoformat(every1["last_tick"])
        scope = next(s_ for s_ in found["limits"] if (s_["task"], s_["kind"], s_["key"]) == ORG_SCOPE)
        assert (scope["held"], scope["waiting"], scope["limit"], scope["full"]) == (1, 1, 1, True), scope
        assert scope["problem"] is None  # a full scope with a waiter is the limit working
        (sleeping,) = [r for r in found["sleeping"] if r["id"] == nap]
        assert 3500 < sleeping["wakes_in_seconds"] <= 3600 and sleeping["problem"] is None, sleeping
        assert datetime.fromisoformat(sleeping["wake_at"]) > datetime.now(timezone.utc)
        (stuck,) = [r for r in found["outbox"]["failing"] if r["task_id"] == poison]
        assert stuck["error"] == POISON_ERROR and stuck["attempts"] >= 1
        assert stuck["problem"] == f"publish failed {stuck['attempts']} time(s): {POISON_ERROR}"
        assert any(poison in line and POISON_ERROR in line for line in found["problems"]), found["problems"]
        assert waiter not in {r["id"] for r in found["sleeping"]}  # waiting for a turn is not waiting for a time

        # The page.
        browser.get(f"http://127.0.0.1:{port}/")
        pid = str(beat.process.pid)
        wait_for(lambda: on_page(browser, "#beat-leader", lambda e: e.get_attribute("data-pid") == pid
                                 and f"pid {pid}" in e.text and leader["host"] in e.text),
                 timeout=10, what="the beat leader as host and pid")
        wait_for(lambda: on_page(browser, "#beat-last", lambda e: e.text.startswith("last fire: every1 at")),
                 timeout=10, what="the beat's last fire")
        wait_for(lambda: on_page(browser, '#beat-entries tr[data-entry="every1"]',
                                 lambda e: "beat.tick" in e.text and "paused" not in e.text), timeout=10,
                 what="the beat entry")
        scope_row = '#limits tr[data-scope="limits.sync_org/key/org:acme"]'
        wait_for(lambda: on_page(browser, scope_row, lambda e: e.get_attribute("data-full") == "1"
                                 and "1 / 1" in e.text and "problem" not in (e.get_attribute("class") or "")),
                 timeout=10, what="the held limit with its waiter")
        wait_for(lambda: on_page(browser, f'#sleeping tr[data-run-id="{nap}"]', lambda e: "console.nap" in e.text),
                 timeout=10, what="the sleeping run")
        stuck_row = f'#outbox-failing tr.problem[data-task-id="{poison}"]'
        wait_for(lambda: on_page(browser, stuck_row, lambda e: POISON_ERROR in e.text), timeout=10,
                 what="the stuck outbox row, highlighted, with its error")
        # Highlighted as the style sheet says, not only classed: the cell's background is the problem colour.
        assert on_page(browser, f"{stuck_row} td.cause", lambda e: e.value_of_css_property("background-color")) == \
            "rgba(253, 236, 234, 1)"
        wait_for(lambda: on_page(browser, "#outbox", lambda e: "problem" in (e.get_attribute("class") or "")
                                 and "failed to publish" in e.text), timeout=10, what="the outbox line flagged")
        wait_for(lambda: on_page(browser, "#problems", lambda e: poison in e.text), timeout=10,
                 what="the stuck row in the problems summary")
        if os.environ.get("DASHBOARD_PANELS_SCREENSHOT"):
            browser.set_window_size(1400, 1900)  # the whole page: the panels sit below the charts
            wait_for(lambda: on_page(browser, stuck_row, lambda e: True), timeout=10, what="the page redrawn")
            browser.save_screenshot(os.environ["DASHBOARD_PANELS_SCREENSHOT"])
        refused = [entry["message"] for entry in browser.get_log("browser")
                   if "Content Security Policy" in entry["message"]]
        assert refused == [], refused
