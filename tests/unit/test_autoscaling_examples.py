"""The autoscaling recipes (examples/autoscaling/): the manifests have what KEDA and the HPA need, all three
carry one query, it parses, and over a made-up scrape it gives the pods the scaler contract asks for."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.promtool import run

AUTOSCALING = Path(__file__).resolve().parents[2] / "examples" / "autoscaling"


def load(name: str) -> Any:
    return yaml.safe_load((AUTOSCALING / name).read_text())


def keda_trigger() -> dict[str, Any]:
    scaled = load("keda-scaledobject.yaml")
    (trigger,) = scaled["spec"]["triggers"]
    return trigger


def keda_query() -> str:
    return str(keda_trigger()["metadata"]["query"])


def adapter_rule() -> dict[str, Any]:
    (rule,) = load("prometheus-adapter-rules.yaml")["rules"]["external"]
    return rule


def words(query: str) -> str:
    return " ".join(query.split())


def test_the_scaled_object_is_a_keda_prometheus_trigger_at_one_pod_per_unit() -> None:
    scaled = load("keda-scaledobject.yaml")
    assert (scaled["apiVersion"], scaled["kind"]) == ("keda.sh/v1alpha1", "ScaledObject")
    spec = scaled["spec"]
    assert spec["scaleTargetRef"]["name"] and scaled["metadata"]["name"]
    # The queue gauges come from the workers: at zero replicas nothing would show a backlog.
    assert 1 <= spec["minReplicaCount"] <= spec["maxReplicaCount"]
    trigger = keda_trigger()
    assert trigger["type"] == "prometheus" and trigger.get("metricType", "AverageValue") == "AverageValue"
    metadata = trigger["metadata"]
    assert metadata["serverAddress"].startswith("http")
    # KEDA reads metadata values as strings; "1" makes the query's value the replica count (rounded up).
    assert metadata["threshold"] == "1"


def test_the_hpa_reads_the_adapters_external_metric_at_one_pod_per_unit() -> None:
    hpa = load("hpa.yaml")
    assert (hpa["apiVersion"], hpa["kind"]) == ("autoscaling/v2", "HorizontalPodAutoscaler")
    spec = hpa["spec"]
    assert spec["scaleTargetRef"]["kind"] == "Deployment" and spec["scaleTargetRef"]["name"]
    assert 1 <= spec["minReplicas"] <= spec["maxReplicas"]
    (metric,) = spec["metrics"]
    assert metric["type"] == "External"
    assert metric["external"]["metric"]["name"] == adapter_rule()["name"]["as"]
    assert metric["external"]["target"] == {"type": "AverageValue", "averageValue": "1"}


def test_keda_and_the_adapter_carry_the_same_query_on_the_scaler_contract() -> None:
    rule = adapter_rule()
    assert words(rule["metricsQuery"]) == words(keda_query())
    assert rule["seriesQuery"].strip("'\"") in keda_query()
    for metric in ("job_queue_depth", "job_worker_in_flight", "job_worker_capacity"):
        assert metric in keda_query()
    # Every worker serves the depth of the queues it consumes: summed raw, a queue counts once per worker.
    assert "max by (queue) (job_queue_depth)" in keda_query()


def series(name: str, samples: dict[str, float]) -> list[dict[str, str]]:
    """One input series per labelled sample, the value held for 10 minutes (``{labels}`` as in a scrape)."""
    return [{"series": f"{name}{labels}", "values": f"{value}x10"} for labels, value in samples.items()]


#: Made-up scrapes: what each process serves, and the pods the contract asks for,
#: ceil((Σ over queues of the queue's depth + Σ in flight) / capacity per worker pod).
SCRAPES: dict[str, dict[str, Any]] = {
    "two full pods, a backlog both report, a beat serving zeros": {
        "depth": {'{queue="orders", pod="w1"}': 20, '{queue="orders", pod="w2"}': 20,
                  '{queue="emails", pod="w1"}': 4},
        "in_flight": {'{pod="w1"}': 8, '{pod="w2"}': 8, '{pod="beat"}': 0},
        "capacity": {'{pod="w1"}': 8, '{pod="w2"}': 8, '{pod="beat"}': 0},
        "value": (24 + 16) / 8, "pods": 5,
    },
    "a quiet fleet shrinks to one pod": {
        "depth": {'{queue="orders", pod="w1"}': 0, '{queue="orders", pod="w2"}': 0},
        "in_flight": {'{pod="w1"}': 3, '{pod="w2"}': 0},
        "capacity": {'{pod="w1"}': 8, '{pod="w2"}': 8},
        "value": 3 / 8, "pods": 1,
    },
    "pods of different sizes: capacity per pod is their mean": {
        "depth": {'{queue="orders", pod="w1"}': 10, '{queue="orders", pod="w2"}': 10},
        "in_flight": {'{pod="w1"}': 4, '{pod="w2"}': 12},
        "capacity": {'{pod="w1"}': 4, '{pod="w2"}': 12},
        "value": (10 + 16) / 8, "pods": 4,
    },
    "the broker unreadable (no depth sample): the runs in flight still count": {
        "depth": {},
        "in_flight": {'{pod="w1"}': 6},
        "capacity": {'{pod="w1"}': 4},
        "value": 6 / 4, "pods": 2,
    },
}


@pytest.mark.parametrize("name", sorted(SCRAPES))
def test_the_query_gives_the_pods_the_contract_asks_for(name: str, tmp_path: Path) -> None:
    scrape = SCRAPES[name]
    assert math.ceil(scrape["value"]) == scrape["pods"]
    query = keda_query()
    # A recording rule of the query: `promtool check rules` parses it as Prometheus would.
    rules = {"groups": [{"name": "autoscaling", "rules": [{"record": "celery_durable:desired_workers",
                                                            "expr": query}]}]}
    (tmp_path / "rules.yml").write_text(yaml.safe_dump(rules))
    run("check", "rules", "rules.yml", cwd=tmp_path)
    inputs = (series("job_queue_depth", scrape["depth"]) + series("job_worker_in_flight", scrape["in_flight"])
              + series("job_worker_capacity", scrape["capacity"]))
    exp = [{"labels": "{}", "value": scrape["value"]}]
    test = {"rule_files": ["rules.yml"], "evaluation_interval": "1m",
            "tests": [{"name": name, "interval": "1m", "input_series": inputs,
                       "promql_expr_test": [{"expr": query, "eval_time": "5m", "exp_samples": exp},
                                            {"expr": "celery_durable:desired_workers", "eval_time": "5m",
                                             "exp_samples": [{"labels": "celery_durable:desired_workers",
                                                              "value": scrape["value"]}]}]}]}
    (tmp_path / "query_test.yml").write_text(yaml.safe_dump(test))
    run("test", "rules", "query_test.yml", cwd=tmp_path)
