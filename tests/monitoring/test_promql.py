"""Every PromQL expression shipped (dashboard panels, alert rules) parses with the real
Prometheus tooling (Debian's `prometheus` package: `promtool`). Missing tooling fails the test:
scripts/test.sh installs it."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from promql import CHART_DASHBOARDS, DASHBOARDS, RULES, as_rules_file, panel_exprs, rule_exprs, rule_groups


def _promtool() -> str:
    tool = shutil.which("promtool")
    assert tool, "promtool not found: install Debian's prometheus package (scripts/test.sh does)"
    return tool


def test_dashboards_have_panels_and_chart_copies_are_identical() -> None:
    names = sorted(p.name for p in DASHBOARDS.glob("*.json"))
    assert names == ["rlhf-job.json", "rlhf-operator.json"]
    for n in names:
        assert (CHART_DASHBOARDS / n).read_bytes() == (DASHBOARDS / n).read_bytes(), (
            f"chart copy of {n} differs"
        )
        d = json.loads((DASHBOARDS / n).read_text())
        assert d["uid"] and d["panels"] and all(p["targets"] for p in d["panels"])
    titles = {p["title"] for p in json.loads((DASHBOARDS / "rlhf-job.json").read_text())["panels"]}
    for want in ("Reward (mean)", "KL to reference", "Policy entropy", "Step time by phase", "Throughput",
                 "Rollout replicas", "Rollout wait fraction and queue", "Weight sync seconds", "Controller restarts (1h)"):  # fmt: skip
        assert want in titles


def test_panel_expressions_parse(tmp_path: Path) -> None:
    exprs = panel_exprs()
    assert len(exprs) >= 20
    f = tmp_path / "panels.yaml"
    f.write_text(as_rules_file(exprs))
    r = subprocess.run([_promtool(), "check", "rules", str(f)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_alert_rules_pass_promtool(tmp_path: Path) -> None:
    f = tmp_path / "rules.yaml"
    f.write_text(yaml.safe_dump({"groups": rule_groups()}))
    r = subprocess.run([_promtool(), "check", "rules", str(f)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    alerts = {name for name, _ in rule_exprs()}
    assert {"RLHFJobFailed", "RLHFJobRestarting", "RLHFJobNoProgress", "RLHFRolloutSaturated"} <= alerts


def test_a_broken_expression_is_caught(tmp_path: Path) -> None:
    f = tmp_path / "bad.yaml"
    f.write_text(as_rules_file([("x", "sum by (job (rlhf_step)")]))
    r = subprocess.run([_promtool(), "check", "rules", str(f)], capture_output=True, text=True)
    assert r.returncode != 0


@pytest.mark.parametrize("manifest", [RULES])
def test_rule_manifest_is_a_prometheusrule(manifest: Path) -> None:
    doc = yaml.safe_load(manifest.read_text())
    assert (doc["apiVersion"], doc["kind"]) == ("monitoring.coreos.com/v1", "PrometheusRule")
