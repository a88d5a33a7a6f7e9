"""Celery's own integration tests of tasks (t/integration/test_tasks.py) against a ``-P durable`` session worker.

Opt-in (``pytest -m celery_suite tests/celery_suite``, about three minutes a broker; CI runs it): the
installed Celery's sdist is downloaded once into a cache, its ``t/`` extracted, and its conftest told which
pool the session worker runs (integration_overrides.py). On each broker the file runs under ``-P durable``:
``test_expired`` must pass, and nothing may fail but the tests that fail on stock too. Which those are is
measured by the comparison with stock's prefork pool on the same broker (``-m soak``: twice as long), whose
rule is the issue's own: every test that passes on stock passes under ``-P durable``.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from pathlib import Path

import celery
import pytest
from kombu import Connection

from tests.services import broker_url, in_ci

pytestmark = [pytest.mark.timeout(3600)]

HERE = Path(__file__).resolve().parent
#: Where the sdist's tests are kept between runs (CELERY_SUITE_CACHE overrides it).
CACHE = Path(os.environ.get("CELERY_SUITE_CACHE", Path.home() / ".cache" / "celery_durable" / "celery-suite"))
#: The test file run, and the test this suite exists for (issue 28: it hung under -P durable on RabbitMQ).
TEST_FILE = "t/integration/test_tasks.py"
EXPIRED = "t.integration.test_tasks.test_tasks::test_expired"
#: What fails on stock prefork too, on Redis and RabbitMQ, with Celery 5.7.0 on this project's machines (the
#: -m soak comparison below measures it: 2026-12-06, stock 57 passed / 3 failed, -P durable 58 / 2 on each broker).
FAILING_ON_STOCK_TOO = frozenset({
    "t.integration.test_tasks.test_trace_log_arguments::test_task_success",
    "t.integration.test_tasks.test_trace_log_arguments::test_task_failed",
    # Stock's only, at its 20 s timeout: allowed here so a slow run of it under durable is not a regression.
    "t.integration.test_tasks.test_tasks::test_revoked_by_headers_complex_canvas",
})
#: Seconds one run of the file may take (stock takes about two minutes on RabbitMQ).
RUN_TIMEOUT = 900

#: Two of Celery's tests reset the flag their ``task_received`` handler sets only *after* ``.delay()`` returns,
#: so a worker that receives the task before the sending thread runs the next line has its True overwritten by
#: the reset, and the test fails whatever the pool. Measured 2026-12-07 (test_replaced_task_nesting_level_0 run
#: 300 times on Redis beside two busy loops, pytest-repeat): stock prefork failed 128, -P durable 113; CI failed
#: on it once. The reset is moved before the send, as the third such test (..._nesting_chain) already has it;
#: nothing the tests assert changes. Named in the cache directory, so a cache made before the patch is not used.
RACE_PATCH = "reset-before-send-1"
RESET_AFTER_SEND = re.compile(
    r"\n(?P<indent>[ ]+)res = (?P<signature>\w+)\.delay\(\)\n(?P=indent)assertion_result = False\n")
RESETS_AFTER_SEND = 2


@pytest.fixture(scope="session")
def celery_tests() -> Path:
    """The installed Celery release's ``t/`` (its sdist's), its conftest running the pool CELERY_SUITE_POOL names."""
    root = CACHE / f"celery-{celery.__version__}-{RACE_PATCH}"
    if (root / "t" / "integration" / "conftest.py").exists():
        return root
    CACHE.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=CACHE) as scratch:
        subprocess.run([sys.executable, "-m", "pip", "download", f"celery=={celery.__version__}",
                        "--no-binary", ":all:", "--no-deps", "-d", scratch], check=True, capture_output=True)
        (sdist,) = Path(scratch).glob("celery-*.tar.gz")
        prefix = f"celery-{celery.__version__}/"
        staged = Path(scratch) / "staged"
        with tarfile.open(sdist) as tar:
            members = [m for m in tar.getmembers() if m.name.startswith(prefix + "t/")]
            for member in members:
                member.name = member.name.removeprefix(prefix)
            tar.extractall(staged, members=members, filter="data")
        conftest = staged / "t" / "integration" / "conftest.py"
        conftest.write_text(conftest.read_text() + "\n\n" + (HERE / "integration_overrides.py").read_text())
        tasks_file = staged / TEST_FILE
        tasks_file.write_text(reset_before_send(tasks_file.read_text()))
        # A rename: a run interrupted half way leaves no cache that looks complete. Two xdist workers fill
        # a cold cache side by side; the one that renames second finds the other's complete copy there.
        try:
            staged.rename(root)
        except OSError:
            if not (root / "t" / "integration" / "conftest.py").exists():
                raise
    return root


def reset_before_send(source: str) -> str:
    """Celery's test_tasks.py with each flag reset moved before the ``.delay()`` it follows (RACE_PATCH)."""
    patched, count = RESET_AFTER_SEND.subn(
        lambda m: f"\n{m['indent']}assertion_result = False\n{m['indent']}res = {m['signature']}.delay()\n", source)
    if count != RESETS_AFTER_SEND:
        # Another Celery release: its tests may have fixed the race or moved it; look before patching blindly.
        raise RuntimeError(f"{TEST_FILE}: expected {RESETS_AFTER_SEND} flag resets after a send, found {count}")
    return patched


def outcomes(junit: Path) -> dict[str, str]:
    """``classname::name`` -> passed / failed / skipped, from pytest's JUnit XML."""
    found: dict[str, str] = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        kinds = {child.tag for child in case}
        outcome = "failed" if kinds & {"failure", "error"} else "skipped" if "skipped" in kinds else "passed"
        found[f"{case.get('classname')}::{case.get('name')}"] = outcome
    return found


def run_suite(root: Path, pool: str, broker: str, backend: str, out: Path) -> dict[str, str]:
    with Connection(broker) as conn:
        # Celery's suite uses the queue ``celery``: what an interrupted run left there would run in this one.
        # On a broker that never had it (a fresh RabbitMQ says 404), there is nothing to purge.
        try:
            conn.default_channel.queue_purge("celery")
        except conn.channel_errors:
            pass
    junit = out / f"{pool}.xml"
    # Celery's tasks.get_redis_connection (the channels it lists, the keys its tasks write) reads REDIS_HOST/PORT.
    backend_host, backend_port = backend.removeprefix("redis://").split("/")[0].split(":")
    env = dict(os.environ, CELERY_SUITE_POOL=pool, TEST_BROKER=broker, TEST_BACKEND=backend,
               REDIS_HOST=backend_host, REDIS_PORT=backend_port)
    done = subprocess.run(
        [sys.executable, "-m", "pytest", TEST_FILE, "-p", "no:cacheprovider", "-p", "celery.contrib.pytest",
         "-q", "-o", "addopts=", "-o", "python_classes=test_*", "-W", "ignore::pytest.PytestUnknownMarkWarning",
         f"--junitxml={junit}"],
        cwd=root, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT)
    (out / f"{pool}.log").write_text(done.stdout + done.stderr)
    assert junit.exists(), f"{pool}: pytest wrote no report:\n{done.stdout[-3000:]}{done.stderr[-3000:]}"
    return outcomes(junit)


@pytest.fixture(params=["redis", "rabbitmq"])
def suite_broker(request: pytest.FixtureRequest) -> Iterator[str]:
    yield broker_url(request.param)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.fixture
def suite_backend(tmp_path: Path) -> Iterator[str]:
    """A Redis server of this run's own, for its results.

    Celery's test_asyncresult_*_cancels_subscription compare the server's PUBSUB CHANNELS before and after a
    task; pub/sub is server-wide (not per database), so the other broker's run, side by side under -n 2, showed
    up in them (CI failed once on it). The server is this test's, never the developer's shared one.
    """
    server = shutil.which("redis-server")
    if server is None:
        if in_ci():
            pytest.fail("redis-server is not installed (CI needs it for the suite's own result backend)")
        pytest.skip("redis-server is not installed")
    port = free_port()
    process = subprocess.Popen(
        [server, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--dir", str(tmp_path)], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    url = f"redis://127.0.0.1:{port}/0"
    try:
        wait_for_redis(url, process)
        yield url
    finally:
        process.terminate()
        process.wait(timeout=30)


def wait_for_redis(url: str, process: subprocess.Popen[bytes], seconds: float = 30.0) -> None:
    deadline = time.monotonic() + seconds
    while True:
        try:
            with Connection(url) as conn:
                conn.ensure_connection(max_retries=1)
            return
        except Exception as problem:  # polled until the deadline, then reported
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the suite's own redis-server at {url} did not come up: {problem}") from problem
            time.sleep(0.05)


@pytest.mark.celery_suite
def test_celerys_task_tests_pass_under_durable_but_for_what_fails_on_stock(
        celery_tests: Path, suite_broker: str, suite_backend: str, tmp_path: Path) -> None:
    durable = run_suite(celery_tests, "durable", suite_broker, suite_backend, tmp_path)
    print(f"\n{suite_broker}: durable {summary(durable)}")
    assert durable.get(EXPIRED) == "passed", (tmp_path / "durable.log").read_text()[-5000:]
    failed = sorted(name for name, outcome in durable.items() if outcome == "failed")
    assert set(failed) <= FAILING_ON_STOCK_TOO, f"failed under -P durable: {failed} (log: {tmp_path / 'durable.log'})"


@pytest.mark.soak
def test_celerys_task_tests_pass_under_durable_wherever_they_pass_on_stock(
        celery_tests: Path, suite_broker: str, suite_backend: str, tmp_path: Path) -> None:
    stock = run_suite(celery_tests, "prefork", suite_broker, suite_backend, tmp_path)
    durable = run_suite(celery_tests, "durable", suite_broker, suite_backend, tmp_path)
    print(f"\n{suite_broker}: stock {summary(stock)}; durable {summary(durable)}")
    assert durable.get(EXPIRED) == "passed", (tmp_path / "durable.log").read_text()[-5000:]
    regressed = sorted(name for name, outcome in stock.items() if outcome == "passed" and durable.get(name) != "passed")
    assert not regressed, f"pass on stock, not under -P durable: {regressed} (logs: {tmp_path})"


def summary(found: dict[str, str]) -> str:
    counts = {kind: sum(1 for o in found.values() if o == kind) for kind in ("passed", "failed", "skipped")}
    return ", ".join(f"{n} {kind}" for kind, n in counts.items())
