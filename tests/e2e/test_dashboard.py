"""``celery durable dashboard`` in a real headless Chromium, beside a real worker, broker and store.

The browser is Debian's ``chromium`` driven through ``chromedriver`` (``.ci/run`` installs both).
``DASHBOARD_SCREENSHOT=path`` saves the page as the test sees it (how docs/dashboard.png is made).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

import celery_durable
from tests.e2e.durable_support import APP, conf, durable_scenario, free_port, run_state  # noqa: F401 - a fixture
from tests.e2e.harness import REPO, Scenario, wait_for

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
TOKEN = "e2e-dashboard-token"


@pytest.fixture
def browser() -> Iterator[Any]:
    if not (shutil.which(CHROMIUM) and shutil.which(CHROMEDRIVER)):
        if os.environ.get("CI") == "true":
            pytest.fail("Chromium and ChromeDriver are missing (.ci/run installs Debian's chromium, chromium-driver)")
        pytest.skip("no Chromium here: apt-get install chromium chromium-driver")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1400,1100"):
        options.add_argument(argument)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})  # CSP violations are console errors
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    yield driver
    driver.quit()


def _env(s: Scenario, url: str, token: str | None, **extra: str) -> dict[str, str]:
    settings = conf(url, **({"durable_dashboard_token": token} if token else {}))
    return {**os.environ, "PYTHONPATH": str(REPO), "E2E_BROKER": s.broker_url, "E2E_QUEUES": ",".join(s.queues),
            "E2E_CONF": json.dumps(settings), "E2E_KEY": s.key, **extra}


@contextmanager
def running_dashboard(s: Scenario, url: str, token: str | None, app: str = APP, **env: str) -> Iterator[int]:
    """``celery durable dashboard`` of ``app`` (``env``: more environment) on a free port, sampling every half
    second; yields the port."""
    port = free_port()
    log = open(os.path.join(os.environ.get("E2E_LOG_DIR", "/tmp"), f"dashboard-{port}.log"), "wb")
    process = subprocess.Popen([sys.executable, "-m", "celery", "-A", app, "durable", "dashboard", "--port", str(port),
                                "--interval", "0.5"], cwd=REPO, env=_env(s, url, token, **env), stdout=log,
                               stderr=subprocess.STDOUT)

    def answers() -> bool:
        assert process.poll() is None, f"the dashboard exited with {process.returncode}"
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/api/state", timeout=1).read()
            return True
        except (urllib.error.URLError, ConnectionError):
            return False

    try:
        wait_for(answers, timeout=30, what="the dashboard to answer", every=0.1)
        yield port
    finally:
        process.kill()
        process.wait(timeout=10)
        log.close()


def post(port: int, path: str, token: str | None) -> tuple[int, dict[str, Any]]:
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", method="POST",
                                     headers={"X-Durable-Token": token} if token else {})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def on_page(browser: Any, selector: str, read: Any) -> Any:
    """``read(element)`` of the element ``selector`` finds now, None when there is none. The page redraws
    its tables and charts every two seconds: an element found before a redraw is gone after it, so each
    read finds the element again, and a read that lost that race counts as not yet."""
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.common.by import By

    try:
        found = browser.find_elements(By.CSS_SELECTOR, selector)
        return read(found[0]) if found else None
    except StaleElementReferenceException:
        return None


def click(browser: Any, selector: str) -> None:
    wait_for(lambda: on_page(browser, selector, lambda e: e.click() or True), timeout=10, what=f"a click on {selector}")


@pytest.mark.parametrize("broker_kind", ["redis", "postgresql"])
def test_the_page_shows_the_fleet_live_and_requeues_a_dead_run_with_the_token(durable_scenario, browser, broker_kind):
    from selenium.webdriver.common.by import By

    s, url = durable_scenario("postgresql", broker_kind)
    celery_durable.install(s.producer)
    worker = s.worker(app=APP, conf=conf(url), concurrency=2).wait_ready()
    doomed = s.send_task("q", "durable.doomed", ["doomed"])
    wait_for(lambda: run_state(url, doomed) == "dead", timeout=30, what="the doomed run to die")
    with running_dashboard(s, url, TOKEN) as port:
        steps = 30 if os.environ.get("DASHBOARD_SCREENSHOT") else 16  # the picture wants a longer history
        for i in range(2):
            s.send_task("q", "durable.long_steps", [f"hold{i}", steps, 0.5])  # both slots, for about 8 s
        for i in range(3):
            s.send_task("q", "durable.quick", [f"wait{i}"])
        browser.get(f"http://127.0.0.1:{port}/")

        in_flight = f'polyline[data-series="in_flight:{worker.hostname}"]'

        def in_flight_drawn() -> bool:
            return bool(on_page(browser, in_flight, lambda e: float(e.get_attribute("data-last") or 0) > 0))

        wait_for(in_flight_drawn, timeout=20, what="the chart to draw a non-zero in-flight series", every=0.2)
        wait_for(lambda: on_page(browser, in_flight, lambda e: len(e.get_attribute("points").split()) >= 2),
                 timeout=10, what="an in-flight series over time, not one point")
        q = s.by_name["q"]
        wait_for(lambda: on_page(browser, f'polyline[data-series="depth:{q}"]', lambda e: True), timeout=10,
                 what="the queue depth chart")
        dead_row = f'#dead tr[data-run-id="{doomed}"]'
        wait_for(lambda: on_page(browser, dead_row, lambda e: "carrier rejected the parcel" in e.text), timeout=10,
                 what="the dead run with its error")
        if os.environ.get("DASHBOARD_SCREENSHOT"):
            # A few seconds of history, so the picture shows lines over time.
            wait_for(lambda: len(json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/api/state", timeout=5)
                                            .read())["history"]["t"]) >= 12, timeout=20, what="6 s of history")
            browser.save_screenshot(os.environ["DASHBOARD_SCREENSHOT"])

        # Without the token the button is refused; with it the run is requeued, runs and leaves the list.
        s.observer.set(f"{s.key}:carrier-fixed", "1")
        requeue = f'#dead button[data-action="requeue"][data-run-id="{doomed}"]'
        click(browser, requeue)
        wait_for(lambda: browser.find_element(By.ID, "notice").get_attribute("data-status") == "403", timeout=10,
                 what="a refusal without the token")
        assert run_state(url, doomed) == "dead"
        browser.find_element(By.ID, "token").send_keys(TOKEN)
        click(browser, requeue)
        wait_for(lambda: browser.find_element(By.ID, "notice").text == f"{doomed}: requeued", timeout=10,
                 what="the requeue to be confirmed")
        wait_for(lambda: run_state(url, doomed) == "succeeded", timeout=30, what="the requeued run to succeed")
        wait_for(lambda: not browser.find_elements(By.CSS_SELECTOR, dead_row), timeout=10,
                 what="the run to leave the dead list")
        # The page ran under its Content-Security-Policy without breaking one of its rules.
        refused = [entry["message"] for entry in browser.get_log("browser")
                   if "Content Security Policy" in entry["message"]]
        assert refused == [], refused


def test_without_a_token_the_dashboard_is_read_only(durable_scenario):
    s, url = durable_scenario("sqlite", "redis")
    with running_dashboard(s, url, None) as port:
        state = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/api/state", timeout=5).read())
        assert state["read_only"] is True and state["latest"]["problems"] == []
        status, body = post(port, "/api/runs/any/requeue", "whatever")
        assert status == 403 and "read-only" in body["error"]


def test_a_wrong_token_or_an_unknown_run_is_refused_by_name(durable_scenario):
    s, url = durable_scenario("sqlite", "redis")
    with running_dashboard(s, url, TOKEN) as port:
        assert post(port, "/api/runs/any/requeue", "wrong-token")[0] == 403
        assert post(port, "/api/runs/any/requeue", None)[0] == 403
        status, body = post(port, "/api/runs/nope/cancel", TOKEN)
        assert status == 409 and body["error"] == "no durable run has id 'nope'"


def test_a_token_too_short_refuses_to_start_naming_the_setting(durable_scenario):
    s, url = durable_scenario("sqlite", "redis")
    done = subprocess.run([sys.executable, "-m", "celery", "-A", APP, "durable", "dashboard", "--port",
                           str(free_port())], cwd=REPO, env=_env(s, url, "short"), capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 1 and "durable_dashboard_token" in done.stderr and "short" not in done.stderr
    assert "Traceback" not in done.stderr


def _request(port: int, method: str, path: str, host: str | None = None) -> tuple[int, dict[str, str], bytes]:
    """One request through http.client, with ``host`` as the Host header when given."""
    import http.client

    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        connection.request(method, path, headers={"Host": host} if host else {})
        response = connection.getresponse()
        return response.status, {k.lower(): v for k, v in response.getheaders()}, response.read()
    finally:
        connection.close()


def test_every_response_forbids_framing_and_sniffing_and_allows_only_the_pages_own_script(durable_scenario):
    from celery_durable.cli.dashboard_http import CONTENT_SECURITY_POLICY

    s, url = durable_scenario("sqlite", "redis")
    with running_dashboard(s, url, None) as port:
        routes = [("GET", "/", 200, "text/html"), ("GET", "/index.html", 200, "text/html"),
                  ("GET", "/dashboard.js", 200, "text/javascript"), ("GET", "/dashboard.css", 200, "text/css"),
                  ("GET", "/api/state", 200, "application/json"), ("GET", "/nope", 404, "application/json"),
                  ("POST", "/api/runs/any/requeue", 403, "application/json"), ("PUT", "/", 501, "text/html")]
        for method, path, status, content_type in routes:
            got, headers, body = _request(port, method, path)
            assert got == status and headers["content-type"].startswith(content_type), (method, path, got, headers)
            assert headers.get("x-frame-options") == "DENY", (method, path, headers)
            assert headers.get("x-content-type-options") == "nosniff", (method, path, headers)
            assert headers.get("content-security-policy") == CONTENT_SECURITY_POLICY, (method, path, headers)
        assert "frame-ancestors 'none'" in CONTENT_SECURITY_POLICY and "unsafe-inline" not in CONTENT_SECURITY_POLICY
        page = _request(port, "GET", "/")[2].decode()
        # Under a policy without 'unsafe-inline' an inline script or style would not run: the page has none.
        assert "<script>" not in page and "<style>" not in page and 'src="/dashboard.js"' in page


@pytest.mark.parametrize("host", ["evil.example:{port}", "127.0.0.1.nip.io:{port}", "127.0.0.1:{other}",
                                  "localhost", "localhost:{port}.evil.example", ""])
def test_a_request_naming_another_host_is_refused_in_one_line(durable_scenario, host):
    s, url = durable_scenario("sqlite", "redis")
    with running_dashboard(s, url, TOKEN) as port:
        given = host.format(port=port, other=port + 1)
        if given:
            status, _, body = _request(port, "GET", "/api/state", host=given)
        else:  # no Host at all: an HTTP/1.0 request written by hand
            import http.client

            connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
            connection.putrequest("GET", "/api/state", skip_host=True)
            connection.endheaders()
            response = connection.getresponse()
            status, body = response.status, response.read()
            connection.close()
        assert status == 421, (given, status, body)
        assert body.decode().count("\n") == 1 and body.decode().startswith("refused: this dashboard answers to"), body
        assert b"latest" not in body
        # Actions are refused the same way before the token is looked at.
        assert _request(port, "POST", "/api/runs/any/requeue", host=given or "evil.example")[0] == 421
        for served in (f"127.0.0.1:{port}", f"localhost:{port}", f"LOCALHOST:{port}"):
            assert _request(port, "GET", "/api/state", host=served)[0] == 200, served


def _closed_by_server(sock: Any) -> bool:
    """True once the server closed ``sock`` (EOF or reset); False while it is still open."""
    import socket as socket_module

    try:
        return sock.recv(1024, socket_module.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False
    except ConnectionError:
        return True


def test_idle_partial_requests_are_closed_within_the_timeout_while_the_page_is_served(durable_scenario):
    import socket
    import time

    from celery_durable.cli.dashboard_http import IDLE_TIMEOUT, MAX_CONNECTIONS

    s, url = durable_scenario("sqlite", "redis")
    with running_dashboard(s, url, None) as port:
        idle = []
        try:
            for _ in range(MAX_CONNECTIONS - 8):  # room left for the requests below
                sock = socket.create_connection(("127.0.0.1", port), timeout=5)
                sock.sendall(f"GET /api/state HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n".encode())  # never finished
                idle.append(sock)
            opened = time.monotonic()
            assert _request(port, "GET", "/")[0] == 200, "the page while idle connections are held"
            assert _request(port, "GET", "/api/state")[0] == 200
            wait_for(lambda: all(_closed_by_server(sock) for sock in idle), timeout=IDLE_TIMEOUT + 10,
                     what="the server to close every idle connection", every=0.1)
            assert time.monotonic() - opened < IDLE_TIMEOUT + 10
            assert _request(port, "GET", "/")[0] == 200
        finally:
            for sock in idle:
                sock.close()


def test_connections_past_the_cap_are_closed_at_once_and_the_page_is_served_after_the_idle_ones(durable_scenario):
    import socket

    from celery_durable.cli.dashboard_http import IDLE_TIMEOUT, MAX_CONNECTIONS

    s, url = durable_scenario("sqlite", "redis")
    with running_dashboard(s, url, None) as port:
        held = []
        try:
            for _ in range(MAX_CONNECTIONS + 20):
                sock = socket.create_connection(("127.0.0.1", port), timeout=5)
                sock.sendall(b"GET / HTTP/1.1\r\n")  # never finished
                held.append(sock)
            # Those past the cap are closed long before the idle timeout would close them.
            wait_for(lambda: sum(_closed_by_server(sock) for sock in held) >= 20, timeout=IDLE_TIMEOUT / 2,
                     what="the connections past the cap to be closed", every=0.05)
            wait_for(lambda: all(_closed_by_server(sock) for sock in held), timeout=IDLE_TIMEOUT + 10,
                     what="the idle ones to time out", every=0.1)
            assert _request(port, "GET", "/")[0] == 200
        finally:
            for sock in held:
                sock.close()
