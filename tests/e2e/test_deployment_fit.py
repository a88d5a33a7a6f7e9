"""A real ``celery worker -P durable`` as real deployments run it: shared settings, the worker's options,
remote control resizing the pool and moving queues, a Django-style namespace, a Redis key prefix,
and the types Celery's JSON carries."""

from __future__ import annotations

import datetime as dt
import json
import os
import subprocess
import sys
import uuid
from decimal import Decimal
from typing import Any

import pytest
import redis
from celery import Celery

from celery_durable.store.json_values import from_json
from celery_durable.testing import read_run
from tests.e2e.durable_support import APP as DURABLE_APP
from tests.e2e.durable_support import conf as durable_conf
from tests.e2e.durable_support import durable_scenario, run_row  # noqa: F401 - durable_scenario is a fixture
from tests.e2e.harness import REPO, Scenario, WorkerProcess, wait_for
from tests.e2e.test_boot_refusal import assert_refused
from tests.services import broker_url

DJANGO_APP = "tests.e2e.djangoapp"


@pytest.fixture
def broker() -> tuple[str, str]:
    # Most of what this file checks happens before or beside the claim: one broker keeps it fast.
    return "redis", broker_url("redis")


def control(s: Scenario, worker: WorkerProcess, command: str, **arguments: Any) -> dict[str, Any]:
    """Broadcast a remote-control command to ``worker``; its one reply."""
    replies = s.producer.control.broadcast(command, arguments=arguments, destination=[worker.hostname],
                                           reply=True, timeout=5)
    assert len(replies) == 1, f"{command}: replies {replies}"
    [reply] = replies
    return dict(reply[worker.hostname])


def active_queues(s: Scenario, worker: WorkerProcess) -> list[str]:
    replies = s.producer.control.inspect(destination=[worker.hostname], timeout=5).active_queues() or {}
    return sorted(queue["name"] for queue in replies[worker.hostname])


# -- 1. one settings module, workers with different -Q ---------------------------------------------


def test_slots_named_for_a_queue_this_worker_does_not_consume_are_logged_once_and_apply_once_added(scenario):
    s = scenario(["a", "b"])
    # The project's own layout: {"reports": 2} in the shared settings, a worker started with -Q default,emails.
    worker = s.worker(queues=["a"], conf={"durable_queue_concurrency": {s.by_name["b"]: 1, "elsewhere": 2}})
    worker.wait_ready()
    s.send("a", "ran")
    s.wait_ended(1)
    lines = [line for line in worker.log().splitlines() if "durable.config.queue_not_consumed" in line]
    assert len(lines) == 1 and "INFO" in lines[0], worker.log()[-3000:]
    assert f"queues={s.by_name['b']},elsewhere" in lines[0]
    # Added later by remote control, the named queue gets the slots the settings give it.
    assert control(s, worker, "add_consumer", queue=s.by_name["b"]).get("ok")
    stats = worker.wait_durable(lambda d: s.by_name["b"] in d["queue_slots"], timeout=10,
                                what="the added queue in the stats")
    assert stats["queue_slots"][s.by_name["b"]] == 1
    assert worker.terminate() == 0


# -- 2. --autoscale -------------------------------------------------------------------------------------


def test_autoscale_is_refused_in_one_line(scenario):
    # Before: it booted with capacity 1 and never grew (4 x 3 s tasks took 12 s).
    s = scenario(["a"])
    s.send("a", "waiting")
    worker = s.worker(extra_args=["--autoscale", "4,1"])
    assert_refused(s, worker, "--autoscale", "cannot be used with -P durable")


# -- 3. remote control: pool_grow / pool_shrink, add_consumer / cancel_consumer ---------------------------


@pytest.mark.parametrize("broker", [("redis", broker_url("redis")), ("rabbitmq", broker_url("rabbitmq"))],
                         ids=["redis", "rabbitmq"])
def test_pool_shrink_lowers_the_capacity_so_nothing_waits_for_a_process_and_pool_grow_raises_it(scenario):
    s = scenario(["a"])
    worker = s.worker(concurrency=4).wait_ready()
    assert worker.durable_stats()["capacity"] == 4
    assert control(s, worker, "pool_shrink", n=1).get("ok")
    stats = worker.wait_durable(lambda d: d["capacity"] == 3, timeout=10, what="capacity 3 after pool_shrink")
    assert stats["pool_size"] == 3
    # Flower and inspect stats read prefetch_count: the most the worker holds to run at once.
    assert worker.stats()["prefetch_count"] == 3

    for i in range(5):
        s.send_waiting("a", f"w{i}")
    wait_for(lambda: len(s.started()) == 3, timeout=30, what="three runs started")
    # Before: the worker held 4 runs with 3 running (one buffered behind them).
    stats = worker.durable_stats()
    assert stats["in_flight"] == 3, stats
    assert s.broker_depth("a") == 2

    assert control(s, worker, "pool_grow", n=2).get("ok")
    stats = worker.wait_durable(lambda d: d["capacity"] == 5 and d["in_flight"] == 5, timeout=30,
                                what="capacity 5 and the two waiting runs taken after pool_grow")
    assert worker.stats()["prefetch_count"] == 5
    # The two new children are forked at once (billiard's grow alone waits for Celery's 5 s
    # maintain_pool timer): both new runs start while the first three still wait on their gate.
    wait_for(lambda: len(s.started()) == 5, timeout=3, what="all five runs started after pool_grow")
    s.open_gate(count=5)
    s.wait_ended(5)
    assert s.max_concurrency() == 5
    assert worker.terminate() == 0


def test_inspect_active_queues_follows_add_consumer_and_cancel_consumer(scenario):
    # Before: active_queues (Flower's Queues tab) kept reporting the boot-time queues.
    s = scenario(["a", "b"])
    a, b = s.by_name["a"], s.by_name["b"]
    worker = s.worker(queues=["a"]).wait_ready()
    assert active_queues(s, worker) == [a]
    # Celery's add_consumer and cancel_consumer reply "ok" at once and change the queues on the
    # worker's next loop turn (Consumer.call_soon): the reply does not wait for the change.
    assert control(s, worker, "add_consumer", queue=b).get("ok")
    wait_for(lambda: active_queues(s, worker) == sorted([a, b]), timeout=10, what="b among the active queues",
             every=0.2)
    s.send("b", "on-b")
    s.wait_ended(1)
    assert control(s, worker, "cancel_consumer", queue=a).get("ok")
    wait_for(lambda: active_queues(s, worker) == [b], timeout=10, what="a gone from the active queues",
             every=0.2)
    s.send("a", "left-on-a")
    s.send("b", "second-on-b")
    wait_for(lambda: [e["label"] for e in s.ended()] == ["on-b", "second-on-b"], timeout=30,
             what="the second task on b")
    assert s.broker_depth("a") == 1
    assert worker.terminate() == 0


# -- 4. what Celery's JSON carries ---------------------------------------------------------------------------


def test_a_durable_task_takes_datetime_uuid_decimal_and_bytes_and_a_step_returns_a_datetime(durable_scenario):
    # Before: NotJSON at run time, never retried.
    s, url = durable_scenario("sqlite")
    worker = s.worker(app=DURABLE_APP, conf=durable_conf(url)).wait_ready()
    when = dt.datetime(2026, 12, 3, 9, 30, tzinfo=dt.timezone.utc)
    ident = uuid.UUID("12345678-1234-5678-1234-567812345678")
    run_id = s.send_task("q", "durable.typed", [when, ident, Decimal("10.10"), b"\x00raw"])
    wait_for(lambda: s.labelled("settled", run_id), timeout=30, what="the run to settle")
    [settled] = s.labelled("settled", run_id)
    assert settled["state"] == "succeeded", settled
    [seen] = s.labelled("typed", run_id)
    assert seen["types"] == ["datetime", "UUID", "Decimal", "bytes", "datetime"]
    # Read back as a user's test would, with the package's pytest plugin helper.
    run = read_run(url, run_id)
    assert run is not None and run.state == "succeeded"
    assert [(step.name, step.result) for step in run.steps] == [("next day", when + dt.timedelta(days=1))]
    assert run.result == {"later": when + dt.timedelta(days=1), "ident": ident, "amount": Decimal("10.10"),
                          "blob": b"\x00raw"}
    assert from_json(run_row(url, run_id).args) == [when, ident, Decimal("10.10"), b"\x00raw"]
    assert worker.terminate() == 0


# -- 5. Django: config_from_object(settings, namespace="CELERY") --------------------------------------------


def test_a_typo_under_the_celery_namespace_is_refused_naming_it(scenario):
    # Before: CELERY_DURABLE_MAX_INFLIGHT was accepted silently (the same typo without a namespace was refused).
    s = scenario(["a"])
    s.send("a", "waiting")
    worker = s.worker(app=DJANGO_APP, conf={"CELERY_DURABLE_MAX_INFLIGHT": 4})
    assert_refused(s, worker, "CELERY_DURABLE_MAX_INFLIGHT", "is not a celery_durable setting")


def test_settings_under_the_celery_namespace_are_read_and_checked(scenario):
    s = scenario(["a"])
    worker = s.worker(app=DJANGO_APP, conf={"CELERY_DURABLE_MAX_IN_FLIGHT": 1}).wait_ready()
    s.send("a", "ran")
    s.wait_ended(1)
    assert "durable.worker.capacity capacity=1 max_in_flight=1" in worker.log()
    assert worker.terminate() == 0
    refused = s.worker(app=DJANGO_APP, conf={"CELERY_DURABLE_MAX_IN_FLIGHT": 0})
    assert_refused(s, refused, "durable_max_in_flight", "got 0", waiting=None)


# -- 6. broker_transport_options={"global_keyprefix": ...} on Redis ---------------------------------------------


def test_claim_passes_take_messages_under_a_global_keyprefix(scenario):
    # Before: the pass read unprefixed keys and took nothing; every message came one at a time
    # through the idle wait.
    s = scenario(["a"])
    prefix = f"e2e-{uuid.uuid4().hex[:8]}:"
    options = {"broker_transport_options": {"global_keyprefix": prefix}}
    producer = Celery("e2e-prefixed-producer", broker=s.broker_url)
    producer.conf.update(options)
    try:
        for i in range(20):
            producer.send_task("e2e.record", [f"p{i}"], queue=s.by_name["a"])
        worker = s.worker(conf=options, concurrency=4).wait_ready()
        s.wait_ended(20)
        # Remote control goes through the prefixed keys too: ask with the prefixed app.
        replies = producer.control.inspect(destination=[worker.hostname], timeout=5).stats() or {}
        stats = replies[worker.hostname]["durable"]
        assert stats["claimed_by_passes"] >= 15, stats
        assert worker.terminate() == 0
    finally:
        producer.close()
        client = redis.Redis.from_url(s.broker_url)
        leftover = list(client.scan_iter(match=f"{prefix}*"))
        if leftover:
            client.delete(*leftover)


# -- 7. the worker's own options -------------------------------------------------------------------------------


def test_worker_options_override_the_settings(scenario):
    s = scenario(["a", "b"])
    a, b = s.by_name["a"], s.by_name["b"]
    worker = s.worker(concurrency=4, conf={"durable_max_in_flight": 4},
                      extra_args=["--max-in-flight", "3", "--queue-concurrency", f"{a}=1,{b}=2",
                                  "--drain-timeout", "5"]).wait_ready()
    stats = worker.durable_stats()
    assert (stats["max_in_flight"], stats["capacity"]) == (3, 3)
    assert stats["queue_slots"] == {a: 1, b: 2}
    assert worker.terminate() == 0


REFUSED_OPTIONS = [
    pytest.param(["--max-in-flight", "0"], "--max-in-flight", "got 0", id="cap-0"),
    pytest.param(["--max-in-flight", "four"], "--max-in-flight", "got 'four'", id="cap-not-a-number"),
    pytest.param(["--queue-concurrency", "reports"], "--queue-concurrency", "got 'reports'", id="slots-no-count"),
    pytest.param(["--queue-concurrency", "a=1,=2"], "--queue-concurrency", "queue=N,queue=N", id="slots-no-name"),
    pytest.param(["--metrics-port", "99999"], "--metrics-port", "got 99999", id="port-out-of-range"),
]


@pytest.mark.parametrize("args, option, problem", REFUSED_OPTIONS)
def test_a_bad_worker_option_refuses_the_boot_naming_the_option(scenario, args, option, problem):
    s = scenario(["a"])
    s.send("a", "waiting")
    worker = s.worker(extra_args=args)
    assert_refused(s, worker, option, problem)


# -- the operator commands' bad input ------------------------------------------------------------------------


def durable_command(*args: str, conf: dict[str, Any] | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "E2E_BROKER": broker_url("redis"),
           "E2E_CONF": json.dumps(conf or {})}
    return subprocess.run([sys.executable, "-m", "celery", "-A", "tests.e2e.e2eapp", "durable", *args],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("args, conf, expected", [
    # Before: a batch size of 0 silently became 500.
    pytest.param(["relay", "--batch-size", "0"], {}, "Error: --batch-size must be a whole number >= 1, got 0",
                 id="relay-batch-size-0"),
    pytest.param(["relay", "--poll-interval", "0"], {}, "Error: --poll-interval must be > 0 seconds, got 0.0",
                 id="relay-poll-interval-0"),
    # Before: a 53-line traceback.
    pytest.param(["migrate"], {"durable_database_url": "not a url"},
                 "Error: durable_database_url is not a database URL", id="migrate-store-url-not-a-url"),
    pytest.param(["relay"], {"durable_database_url": "not a url"},
                 "Error: durable_database_url is not a database URL", id="relay-store-url-not-a-url"),
])
def test_a_bad_operator_command_input_is_one_line_naming_it(args, conf, expected):
    done = durable_command(*args, conf=conf)
    assert done.returncode != 0
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(expected), done.stderr
    assert "Traceback" not in done.stderr + done.stdout


@pytest.mark.parametrize("args, expected", [
    # Before: NaN was taken; the status then named "the broker could not be read" and exited 1.
    pytest.param(["status", "--timeout", "nan"], "Error: Invalid value for '--timeout': 'nan'", id="status-nan"),
    pytest.param(["status", "--timeout", "inf"], "Error: Invalid value for '--timeout': inf", id="status-inf"),
    # Before: the dashboard started and never sampled (NaN) or its sampler died in a traceback (inf).
    pytest.param(["dashboard", "--interval", "nan"], "Error: Invalid value for '--interval': 'nan'",
                 id="dashboard-interval-nan"),
    pytest.param(["dashboard", "--interval", "inf"], "Error: Invalid value for '--interval': inf",
                 id="dashboard-interval-inf"),
    pytest.param(["dashboard", "--window", "inf"], "Error: Invalid value for '--window': inf",
                 id="dashboard-window-inf"),
    pytest.param(["dashboard", "--window", "nan"], "Error: Invalid value for '--window': 'nan'",
                 id="dashboard-window-nan"),
    # Before: the relay ran, and each pass was an OverflowError's traceback (an SQL LIMIT, a select timeout).
    pytest.param(["relay", "--batch-size", "99999999999999999999"],
                 "Error: --batch-size must be a whole number <= 9223372036854775807", id="relay-batch-size-huge"),
    pytest.param(["relay", "--poll-interval", "1e300"], "Error: --poll-interval must be <= 3600 seconds",
                 id="relay-poll-interval-huge"),
    # Before: refused, but with exit status 1, as if the store had failed.
    pytest.param(["relay", "--poll-interval", "nan"], "Error: --poll-interval must be a finite number of seconds",
                 id="relay-poll-interval-nan"),
    pytest.param(["relay", "--batch-size", "0"], "Error: --batch-size must be a whole number >= 1, got 0",
                 id="relay-batch-size-0"),
])
def test_a_bad_numeric_option_is_refused_naming_it_with_exit_2(args, expected):
    done = subprocess.run([sys.executable, "-m", "celery", "-A", "tests.e2e.e2eapp", "durable", *args], cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO), "E2E_BROKER": broker_url("redis"),
                               "E2E_CONF": "{}"}, capture_output=True, text=True, timeout=20)
    errors = [line for line in done.stderr.splitlines() if line.startswith("Error:")]
    assert done.returncode == 2, done.stdout + done.stderr
    assert len(errors) == 1 and errors[0].startswith(expected), done.stderr
    assert "Traceback" not in done.stderr + done.stdout
