"""A real ``celery worker -P durable``: bad settings refuse the boot in one line; the pool resolves however named.

Each way a refusal reaches the user (a bad setting under ``-P durable``, under ``worker_pool = "durable"``, in
an app that never imports celery_durable, a metrics port in use, a missing host internal) is proven once on a
real worker process: its exit status, its one log line, nothing claimed. Every other bad value is checked
in-process on a worker built by Celery's own WorkController, whose ``worker_init`` runs the very receiver that
refuses a real boot (celery_durable.worker.boot), asserting the same line and message: a worker start each
would cost ~4 s of CI for nothing the real process adds.
"""

from __future__ import annotations

import importlib
import logging
import re
from collections.abc import Callable
from typing import Any

import pytest
from celery import Celery

import celery_durable
from tests.e2e.harness import Scenario, WorkerProcess, wait_for
from tests.e2e.metrics_ports import free_port, free_ports, metrics_text
from tests.services import broker_url

NAN = float("nan")
INF = float("inf")


@pytest.fixture
def broker() -> tuple[str, str]:
    # Boot checks happen before any broker traffic: one broker keeps this file fast.
    return "redis", broker_url("redis")


def wait_exit(worker: WorkerProcess, timeout: float = 60.0) -> int:
    wait_for(lambda: worker.process.poll() is not None, timeout=timeout,
             what=f"the worker to exit; log so far:\n{worker.log()[-3000:]}", every=0.05)
    return worker.process.returncode


#: A bad configuration, made from the test's queue names (a per-queue setting names a consumed queue).
Conf = Callable[[dict[str, str]], dict[str, Any]]


def const(conf: dict[str, Any]) -> Conf:
    return lambda queues: conf


REFUSED: list[Any] = [
    pytest.param(const({"durable_max_in_flight": 0}), "durable_max_in_flight", "got 0", id="cap-0"),
    pytest.param(const({"durable_max_in_flight": -1}), "durable_max_in_flight", "got -1", id="cap-negative"),
    pytest.param(const({"durable_max_in_flight": 1.5}), "durable_max_in_flight", "got 1.5", id="cap-fraction"),
    pytest.param(const({"durable_max_in_flight": "4"}), "durable_max_in_flight", "got '4'", id="cap-string"),
    pytest.param(const({"durable_max_in_flight": True}), "durable_max_in_flight", "got True", id="cap-bool"),
    # json.dumps writes NaN and Infinity literals, which the app's json.loads reads back as floats.
    pytest.param(const({"durable_max_in_flight": NAN}), "durable_max_in_flight", "got nan", id="cap-nan"),
    pytest.param(const({"durable_max_in_flight": INF}), "durable_max_in_flight", "got inf", id="cap-inf"),
    pytest.param(const({"durable_queue_concurrency": 0}), "durable_queue_concurrency", "got 0", id="slots-0"),
    pytest.param(lambda q: {"durable_queue_concurrency": {q["a"]: 0}}, "durable_queue_concurrency",
                 "got 0", id="slots-0-for-a-consumed-queue"),
    pytest.param(lambda q: {"durable_queue_concurrency": {q["a"]: "2"}}, "durable_queue_concurrency",
                 "got '2'", id="slots-string-for-a-consumed-queue"),
    pytest.param(const({"durable_drain_timeout": -1}), "durable_drain_timeout", "got -1", id="drain-negative"),
    pytest.param(const({"durable_safety_interval": NAN}), "durable_safety_interval", "got nan",
                 id="safety-interval-nan"),
    pytest.param(const({"durable_execution": "gevent"}), "durable_execution", "'gevent'", id="execution"),
    pytest.param(const({"durable_max_inflight": 4}), "durable_max_inflight", "not a celery_durable setting",
                 id="unknown-setting"),
    # Before: mysql booted and then dropped every durable run; "not a url" died on an
    # ArgumentError naming no setting.
    pytest.param(const({"durable_database_url": "mysql://app:s3cr3t@db/app"}), "durable_database_url",
                 "got a mysql URL: 'mysql://app:***@db/app'", id="database-url-mysql"),
    pytest.param(const({"durable_database_url": "not a url"}), "durable_database_url",
                 "is not a database URL", id="database-url-not-a-url"),
    pytest.param(const({"durable_metrics_port": 9100, "durable_metrics_host": " "}), "durable_metrics_host",
                 "got ' '", id="metrics-host-blank"),
    pytest.param(const({"durable_metrics_port": 9100, "durable_metrics_host": "0"}), "durable_metrics_host",
                 "write '0.0.0.0'", id="metrics-host-zero-shorthand"),
    pytest.param(const({"durable_metrics_port": 9100, "durable_metrics_host": "no-such-host.invalid"}),
                 "durable_metrics_host", "a name that resolves, got 'no-such-host.invalid'",
                 id="metrics-host-unresolvable"),
    pytest.param(const({"durable_metrics_task_names_limit": 0}), "durable_metrics_task_names_limit", "got 0",
                 id="task-names-limit-0"),
]


def assert_refused(s: Scenario, worker: WorkerProcess, setting: str, problem: str,
                   *, waiting: int | None = 1) -> None:
    code = wait_exit(worker)
    log = worker.log()
    assert code > 0, f"exit code {code} (negative: killed by a signal, not a refusal)\n{log[-3000:]}"
    assert setting in log, log[-3000:]
    assert problem in log, log[-3000:]
    assert "durable.config.invalid" in log, log[-3000:]
    # One line names the setting (then Celery's own exit message repeats it).
    refusals = [line for line in log.splitlines() if "durable.config.invalid" in line]
    assert len(refusals) == 1 and setting in refusals[0], log[-3000:]
    assert "Traceback" not in log, log[-3000:]
    assert "s3cr3t" not in log, log[-3000:]
    assert " ready." not in log, log[-3000:]
    if waiting is not None:
        # It refused before claiming: what was waiting is still in the broker.
        assert s.broker_depth("a") == waiting


def test_a_bad_setting_refuses_the_boot_naming_it(scenario):
    # The real process for one row of REFUSED (the one whose URL hides a password: Celery's own exit
    # message repeats the refusal, and neither may show it); the in-process test below checks every row.
    (conf, setting, problem), = [row.values for row in REFUSED if row.id == "database-url-mysql"]
    s = scenario(["a", "b"])
    s.send("a", "waiting")
    worker = s.worker(conf=conf(s.by_name))
    assert_refused(s, worker, setting, problem)


@pytest.fixture
def booted_in_process(caplog: pytest.LogCaptureFixture) -> Callable[..., tuple[str, list[str]]]:
    """Builds (does not start) a ``-P durable`` worker of an app with ``conf``, as ``celery worker`` does up to
    ``worker_init``; returns the refusal it exits with and the log lines it wrote."""

    def boot(conf: dict[str, Any], queues: list[str]) -> tuple[str, list[str]]:
        # memory://: building a worker opens no connection; the refusal comes before any would.
        app = celery_durable.install(Celery("boot-refusal", broker="memory://", set_as_current=False))
        app.conf.update(task_default_queue=queues[0], **conf)
        caplog.clear()
        try:
            with caplog.at_level(logging.INFO), pytest.raises(SystemExit) as exited:
                app.WorkController(pool_cls="durable", queues=queues, concurrency=2, hostname="boot-refusal@test")
        finally:
            app.close()
        # What the CLI prints as one line and exits 1 on: a message, not a chained traceback.
        assert type(exited.value) is SystemExit and exited.value.__cause__ is None, exited.value
        assert exited.value.__suppress_context__, "raised `from None`: no traceback of the cause"
        assert not any(record.exc_info for record in caplog.records), caplog.text
        return str(exited.value.code), caplog.text.splitlines()

    return boot


@pytest.mark.parametrize("conf, setting, problem", REFUSED)
def test_a_bad_setting_refuses_a_durable_workers_boot_in_one_line_naming_it(booted_in_process, conf, setting,
                                                                             problem):
    queues = {"a": "a-boot", "b": "b-boot"}
    exit_message, log = booted_in_process(conf(queues), list(queues.values()))
    assert exit_message.startswith("celery_durable: refusing to start: ")
    assert setting in exit_message and problem in exit_message, exit_message
    refusals = [line for line in log if "durable.config.invalid" in line]
    assert len(refusals) == 1 and setting in refusals[0] and problem in refusals[0], log
    assert "s3cr3t" not in exit_message and "s3cr3t" not in "\n".join(log)


def test_a_bad_setting_refuses_the_boot_when_worker_pool_names_the_pool(scenario):
    s = scenario(["a"])
    s.send("a", "waiting")
    worker = s.worker(conf={"worker_pool": "durable", "durable_max_in_flight": 0}, pool=None)
    assert_refused(s, worker, "durable_max_in_flight", "got 0")


def test_a_bad_setting_refuses_the_boot_of_an_app_that_never_imports_celery_durable(scenario):
    s = scenario(["a"])
    s.send("a", "waiting")
    worker = s.worker(conf={"durable_max_in_flight": 0}, app="tests.e2e.plainapp")
    assert_refused(s, worker, "durable_max_in_flight", "got 0")


def test_bad_settings_do_not_refuse_a_worker_on_another_pool(scenario):
    # durable_* settings are ours to check only on -P durable: a prefork worker of the
    # same app must not be refused over them.
    s = scenario(["a"])
    s.send("a", "ran")
    worker = s.worker(conf={"durable_max_in_flight": 0}, pool="solo").wait_ready()
    s.wait_ended(1)
    assert "durable.config.invalid" not in worker.log()
    assert "durable.worker.capacity" not in worker.log()
    assert worker.terminate() == 0


def assert_durable_and_working(s: Scenario, worker: WorkerProcess) -> None:
    worker.wait_ready()
    wait_for(lambda: "durable.worker.capacity" in worker.log(), timeout=30,
             what="the durable capacity line")
    for i in range(3):
        s.send("a", f"t{i}")
    ended = s.wait_ended(3, timeout=60)
    assert sorted(e["label"] for e in ended) == ["t0", "t1", "t2"]
    log = worker.log()
    assert "Traceback" not in log, log[-3000:]
    assert worker.terminate() == 0


def test_worker_pool_durable_in_the_conf_boots_the_durable_pool_without_dash_p(scenario):
    s = scenario(["a"])
    worker = s.worker(conf={"worker_pool": "durable", "durable_max_in_flight": 1}, pool=None)
    assert_durable_and_working(s, worker)
    assert "durable.worker.capacity capacity=1 max_in_flight=1" in worker.log()


def test_dash_p_durable_works_for_an_app_that_never_imports_celery_durable(scenario):
    s = scenario(["a"])
    worker = s.worker(conf={"durable_max_in_flight": 1}, app="tests.e2e.plainapp")
    assert_durable_and_working(s, worker)
    assert "durable.worker.capacity capacity=1 max_in_flight=1" in worker.log()


# -- the metrics endpoint: two workers on one host ------------------------------------------------------------


def serving_port(worker: WorkerProcess) -> int:
    """The port the worker logged serving its metrics on."""
    found = wait_for(lambda: re.search(r"durable\.metrics\.serving host=\S+ port=(\d+)", worker.log()),
                     timeout=30, what="the durable.metrics.serving line")
    return int(found.group(1))


def test_a_second_worker_on_the_same_metrics_port_refuses_to_boot_naming_it(scenario):
    s = scenario(["a"])
    port = free_port()
    first = s.worker(conf={"durable_metrics_port": port}).wait_ready()
    assert serving_port(first) == port
    second = s.worker(conf={"durable_metrics_port": port})
    # Before: the second worker died on a raw OSError traceback.
    assert_refused(s, second, "durable_metrics_port", f"cannot be served on 127.0.0.1:{port}", waiting=None)
    # The first is untouched, still serving.
    assert "job_worker_capacity" in metrics_text(port)
    assert first.terminate() == 0


def test_two_workers_given_one_port_range_each_serve_metrics_on_a_port_of_it(scenario):
    s = scenario(["a"])
    ports = free_ports(3)
    span = f"{ports[0]}-{ports[-1]}"
    first = s.worker(conf={"durable_metrics_port": span, "durable_max_in_flight": 1}).wait_ready()
    second = s.worker(conf={"durable_metrics_port": span, "durable_max_in_flight": 2}).wait_ready()
    served = {serving_port(first), serving_port(second)}
    assert served == {ports[0], ports[1]}
    # The port each node took is in its inspect stats (and so in durable status), not only in its INFO log.
    for worker in (first, second):
        assert worker.durable_stats()["metrics_port"] == serving_port(worker)
    # Each endpoint is its own worker's: capacities 1 and 2.
    capacities = sorted(re.search(r"^job_worker_capacity (\S+)$", metrics_text(p), re.MULTILINE).group(1)
                        for p in served)
    assert capacities == ["1.0", "2.0"]
    for worker in (first, second):
        assert "Traceback" not in worker.log()
        assert worker.terminate() == 0


def test_a_wildcard_metrics_host_is_served_with_one_warning(scenario):
    s = scenario(["a"])
    port = free_port()
    worker = s.worker(conf={"durable_metrics_port": port, "durable_metrics_host": "0.0.0.0"}).wait_ready()
    assert serving_port(worker) == port
    assert "job_worker_capacity" in metrics_text(port)
    warnings = [line for line in worker.log().splitlines() if "durable.metrics.all_interfaces" in line]
    assert len(warnings) == 1 and "WARNING" in warnings[0] and "every interface" in warnings[0], warnings
    assert worker.terminate() == 0


HOST_INTERNALS_REMOVED = [
    pytest.param("kombu.transport.redis:Channel._q_for_pri", "kombu.transport.redis.Channel._q_for_pri",
                 id="kombu-redis-priority-lists"),
    pytest.param("amqp.channel:Channel._on_get_ok", "amqp.channel.Channel._on_get_ok", id="py-amqp-get-ok"),
    pytest.param("celery.worker.consumer.consumer:Consumer._limit_post_eta",
                 "celery.worker.consumer.consumer.Consumer._limit_post_eta", id="celery-consumer-rate-limit-eta"),
]


def test_a_missing_host_internal_refuses_the_boot_in_one_line_naming_it(scenario, monkeypatch):
    # What a Celery or kombu release that drops an internal would do: refused at boot,
    # by name, not an AttributeError deep in the claim loop once a task arrives.
    # The real process for the first of HOST_INTERNALS_REMOVED; the in-process test below checks each.
    (removed, named), = [row.values for row in HOST_INTERNALS_REMOVED if row.id == "kombu-redis-priority-lists"]
    monkeypatch.setenv("E2E_REMOVE_HOST_NAME", removed)
    s = scenario(["a"])
    s.send("a", "waiting")
    worker = s.worker(app="tests.e2e.hostless_app")
    code = wait_exit(worker)
    log = worker.log()
    assert code > 0, f"exit code {code}\n{log[-3000:]}"
    refusals = [line for line in log.splitlines() if "durable.host.incompatible" in line]
    assert len(refusals) == 1 and named in refusals[0], log[-3000:]
    assert "Traceback" not in log and "AttributeError" not in log, log[-3000:]
    assert " ready." not in log, log[-3000:]
    assert s.broker_depth("a") == 1


@pytest.mark.parametrize("removed, named", HOST_INTERNALS_REMOVED)
def test_a_missing_host_internal_refuses_a_durable_workers_boot_in_one_line_naming_it(booted_in_process,
                                                                                      monkeypatch, removed, named):
    # As tests/e2e/hostless_app.py removes it in the real worker's process.
    module_name, _, path = removed.partition(":")
    owner_path, _, attribute = path.rpartition(".")
    owner: object = importlib.import_module(module_name)
    for part in filter(None, owner_path.split(".")):
        owner = getattr(owner, part)
    monkeypatch.delattr(owner, attribute)
    exit_message, log = booted_in_process({}, ["a-boot"])
    assert exit_message.startswith("celery_durable: refusing to start: ") and named in exit_message, exit_message
    refusals = [line for line in log if "durable.host.incompatible" in line]
    assert len(refusals) == 1 and named in refusals[0], log
    assert not any("AttributeError" in line for line in log), log
