"""Every task a real ``celery worker -P durable`` runs is counted on its metrics port, by name, queue and outcome.

Plain tasks that succeed, fail, retry, reject, expire, are terminated, hit the
hard time limit and lose their pool child, and a durable task: the worker's ``/metrics`` must show each
``celery_task_*`` counter and the runtime histogram's counts exactly (a count
taken twice, or lost in a pool child, would show).
"""

from __future__ import annotations

import re
from datetime import datetime, timedelta, timezone

import pytest

from tests.e2e.durable_support import APP, conf, durable_scenario, free_port, run_state  # noqa: F401
from tests.e2e.harness import wait_for
from tests.e2e.metrics_ports import metrics_text

_SAMPLE = re.compile(r'^(celery_task_\w+)\{([^}]*)\} (\S+)$', re.M)
_LABEL = re.compile(r'(\w+)="([^"]*)"')


def task_samples(port: int, queue: str) -> dict[tuple[str, ...], float]:
    """The endpoint's ``celery_task_*`` samples of ``queue``: (metric, name[, exception | le]) -> value."""
    found = {}
    for metric, labels, value in _SAMPLE.findall(metrics_text(port)):
        by_name = dict(_LABEL.findall(labels))
        if by_name.get("queue_name") != queue:
            continue
        if metric.endswith("_sum"):
            continue  # seconds: not exact, checked apart
        extra = tuple(by_name[k] for k in ("exception", "le") if k in by_name)
        found[(metric, by_name["name"], *extra)] = float(value)
    return found


def runtime_sum(port: int, queue: str, name: str) -> float:
    for metric, labels, value in _SAMPLE.findall(metrics_text(port)):
        by_name = dict(_LABEL.findall(labels))
        if metric == "celery_task_runtime_sum" and by_name.get("queue_name") == queue and by_name["name"] == name:
            return float(value)
    raise AssertionError(f"no runtime sum for {name}")


def expected(outcomes: dict[str, dict[str, int]], failures: dict[str, str]) -> dict[tuple[str, ...], float]:
    """Every sample the endpoint should serve: each name seen gets every counter (0 when none)."""
    samples: dict[tuple[str, ...], float] = {}
    for name, by_outcome in outcomes.items():
        for outcome in ("succeeded", "retried", "revoked"):
            samples[(f"celery_task_{outcome}_total", name)] = float(by_outcome.get(outcome, 0))
        samples[("celery_task_failed_total", name, failures.get(name, ""))] = float(by_outcome.get("failed", 0))
        succeeded = by_outcome.get("succeeded", 0)
        if succeeded:
            samples[("celery_task_runtime_count", name)] = float(succeeded)
            # Every run here takes under 5 s: the last finite buckets and +Inf hold them all.
            for le in ("5.0", "7.5", "10.0", "+Inf"):
                samples[("celery_task_runtime_bucket", name, le)] = float(succeeded)
    return samples


def _without_low_buckets(samples: dict[tuple[str, ...], float]) -> dict[tuple[str, ...], float]:
    # The buckets under 5 s depend on the machine's speed: left out of the exact comparison.
    return {key: value for key, value in samples.items()
            if key[0] != "celery_task_runtime_bucket" or key[2] in ("5.0", "7.5", "10.0", "+Inf")}


@pytest.mark.parametrize("execution", ["prefork", "threads"])
def test_every_plain_and_durable_task_is_counted_by_name_queue_and_outcome(durable_scenario, execution):
    s, url = durable_scenario("sqlite", "redis")
    q = s.by_name["q"]
    port = free_port()
    worker = s.worker(app=APP, conf=conf(url, durable_metrics_port=port, durable_execution=execution),
                      concurrency=2).wait_ready()
    assert task_samples(port, q) == {}, "a count before any task ran"

    for i in range(5):
        s.send_task("q", "durable.plain", [f"ok{i}"])
    for i in range(3):
        s.send_task("q", "durable.plain_fails", [f"bad{i}"])
    for i in range(2):
        s.send_task("q", "durable.plain_retries", [f"again{i}"])
    s.send_task("q", "durable.plain", ["late"], expires=datetime.now(timezone.utc) - timedelta(seconds=5))
    s.send_task("q", "durable.plain_rejects", ["nope"])
    run = s.send_task("q", "durable.quick", ["durable"])
    outcomes = {
        "durable.plain": {"succeeded": 5, "revoked": 1},
        "durable.plain_fails": {"failed": 3},
        "durable.plain_retries": {"retried": 2, "succeeded": 2},
        "durable.plain_rejects": {"failed": 1},
        "durable.quick": {"succeeded": 1},
    }
    failures = {"durable.plain_fails": "ValueError", "durable.plain_rejects": "Reject"}
    if execution == "prefork":
        # What only a pool child can suffer: the hard time limit's kill, and dying under its task.
        s.send_task("q", "durable.plain_overruns", ["slow"])
        s.send_task("q", "durable.plain_dies", ["dies"])
        # Revoked with terminate while it runs: Celery kills its child and announces the revoke.
        blocked = s.send_task("q", "durable.plain_blocks", ["blocked"])
        wait_for(lambda: s.labelled("start", "blocked"), timeout=30, what="the blocking task to start")
        s.producer.control.revoke(blocked, terminate=True, destination=[worker.hostname])
        outcomes["durable.plain_blocks"] = {"revoked": 1}
        outcomes["durable.plain_overruns"] = {"failed": 1}
        outcomes["durable.plain_dies"] = {"failed": 1}
        failures.update({"durable.plain_overruns": "TimeLimitExceeded", "durable.plain_dies": "WorkerLostError"})

    want = expected(outcomes, failures)
    last: dict[tuple[str, ...], float] = {}

    def counted() -> bool:
        nonlocal last
        last = _without_low_buckets(task_samples(port, q))
        return last == want

    try:
        wait_for(counted, timeout=60, what="every task counted once", every=0.2)
    except AssertionError:
        raise AssertionError(f"served {last}\nwanted {want}") from None
    assert run_state(url, run) == "succeeded"
    worker.wait_durable(lambda d: d["in_flight"] == 0, timeout=15, what="nothing held")
    # Settled: nothing counted late (a second signal for one task would show now).
    assert _without_low_buckets(task_samples(port, q)) == want
    assert 0 < runtime_sum(port, q, "durable.plain") < 5 * 5
    assert all(f'hostname="{worker.hostname}"' in line for line in metrics_text(port).splitlines()
               if line.startswith("celery_task_") and f'queue_name="{q}"' in line)
    assert worker.terminate() == 0
