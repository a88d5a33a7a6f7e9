"""The Grafana dashboard, the alert rules (and their tests), the autoscaling recipes and the manual's metric table
(docs/metrics.md) name only exported metrics."""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

# Every module that registers a metric on the package's registry.
from celery_durable.metrics import beat, jobs, limits, outbox, queues, tasks, worker_gauges  # noqa: F401
from celery_durable.metrics.registry import REGISTRY

ROOT = Path(__file__).resolve().parents[2]
MONITORING = ROOT / "examples" / "monitoring"
METRIC = re.compile(r"\b(?:job_|jobs_|durable_|celery_task_)[a-z_]+\b")
#: The series a histogram family is scraped as; a query names these, the table the family.
HISTOGRAM_SERIES = re.compile(r"_(?:bucket|sum|count)$")


def exported() -> set[str]:
    """The names a scrape of the package's registry can show (a counter as ``<name>_total``)."""
    names = set()
    for family in REGISTRY.collect():
        names.add(f"{family.name}_total" if family.type == "counter" else family.name)
    return names


def histograms() -> set[str]:
    return {family.name for family in REGISTRY.collect() if family.type == "histogram"}


def named_in(expressions: list[str]) -> set[str]:
    """Metric names in the expressions, a histogram's ``_bucket``/``_sum``/``_count`` as the histogram."""
    # Label names (durable_sent_at is a header, not a metric) never appear in these expressions.
    names = {name for expr in expressions for name in METRIC.findall(expr)}
    return {HISTOGRAM_SERIES.sub("", name) if HISTOGRAM_SERIES.sub("", name) in histograms() else name
            for name in names}


def test_every_metric_the_dashboard_queries_is_exported():
    dashboard = json.loads((MONITORING / "grafana-dashboard.json").read_text())
    exprs = [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]
    named = named_in(exprs)
    assert named, "the dashboard queries no metric"
    assert named <= exported(), f"not exported: {sorted(named - exported())}"
    # What an operator looks at first: capacity, queues, dead runs, the outbox.
    assert {"job_worker_in_flight", "job_worker_capacity", "job_queue_depth", "job_queue_oldest_ready_seconds",
            "job_queue_dead_runs", "durable_outbox_backlog", "celery_task_succeeded_total",
            "celery_task_failed_total", "celery_task_runtime"} <= named


def test_every_alert_rule_names_exported_metrics_and_the_four_asked_for_are_there():
    rules = [rule for group in yaml.safe_load((MONITORING / "alerts.yml").read_text())["groups"]
             for rule in group["rules"]]
    for rule in rules:
        named = named_in([rule["expr"]])
        assert named and named <= exported(), f"{rule['alert']}: {sorted(named - exported())} not exported"
        assert rule["annotations"]["summary"], rule["alert"]
    by_metric = {name: rule["alert"] for rule in rules for name in named_in([rule["expr"]])}
    for metric in ("job_queue_oldest_ready_seconds", "job_queue_dead_runs", "durable_outbox_oldest_age_seconds",
                   "job_worker_capacity", "durable_outbox_publish_failures_total", "durable_beat_leader"):
        assert metric in by_metric, f"no alert on {metric}"


def test_the_alert_rules_unit_tests_feed_only_exported_metrics():
    # A series named wrong in alerts_test.yml would leave a rule silent for the wrong reason.
    tests = yaml.safe_load((MONITORING / "alerts_test.yml").read_text())["tests"]
    series = [s["series"] for test in tests for s in test["input_series"]]
    named = named_in(series)
    assert named and named <= exported(), f"not exported: {sorted(named - exported())}"


def test_the_manuals_table_lists_every_exported_metric_and_nothing_else():
    page = (ROOT / "docs" / "metrics.md").read_text()
    section = page[page.index("## Every metric"):]
    section = section[:section.index("\n## ", 1)]
    table = set(re.findall(r"^\| `([a-z_]+)` \|", section, re.M))
    assert table == exported(), f"missing: {sorted(exported() - table)}, not exported: {sorted(table - exported())}"


def test_the_autoscaling_recipes_query_only_exported_metrics():
    recipes = ROOT / "examples" / "autoscaling"
    (trigger,) = yaml.safe_load((recipes / "keda-scaledobject.yaml").read_text())["spec"]["triggers"]
    (rule,) = yaml.safe_load((recipes / "prometheus-adapter-rules.yaml").read_text())["rules"]["external"]
    named = named_in([trigger["metadata"]["query"], rule["metricsQuery"], rule["seriesQuery"]])
    assert {"job_queue_depth", "job_worker_in_flight", "job_worker_capacity"} <= named
    assert named <= exported(), f"not exported: {sorted(named - exported())}"
