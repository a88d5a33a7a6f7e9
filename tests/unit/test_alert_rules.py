"""The shipped alert rules load in Prometheus and pass their own unit tests (examples/monitoring/alerts_test.yml)."""

from __future__ import annotations

from pathlib import Path

import yaml

from tests.promtool import run

MONITORING = Path(__file__).resolve().parents[2] / "examples" / "monitoring"


def alerts() -> set[str]:
    groups = yaml.safe_load((MONITORING / "alerts.yml").read_text())["groups"]
    return {rule["alert"] for group in groups for rule in group["rules"]}


def test_promtool_checks_the_rules() -> None:
    output = run("check", "rules", "alerts.yml", cwd=MONITORING)
    assert f"SUCCESS: {len(alerts())} rules found" in output, output


def test_the_rules_pass_their_unit_tests() -> None:
    output = run("test", "rules", "alerts_test.yml", cwd=MONITORING)
    assert "SUCCESS" in output, output


def test_every_alert_is_tested_firing_and_silent() -> None:
    """Each alert has a case where it fires and one where it stays silent; no case names an alert that is gone."""
    cases = [case for test in yaml.safe_load((MONITORING / "alerts_test.yml").read_text())["tests"]
             for case in test["alert_rule_test"]]
    fires = {case["alertname"] for case in cases if case.get("exp_alerts")}
    silent = {case["alertname"] for case in cases if not case.get("exp_alerts")}
    rules = alerts()
    assert fires == rules, f"never seen firing: {sorted(rules - fires)}, not a rule: {sorted(fires - rules)}"
    assert silent == rules, f"never seen silent: {sorted(rules - silent)}, not a rule: {sorted(silent - rules)}"
