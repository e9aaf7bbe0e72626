"""Where the PromQL of the shipped dashboards and alert rules lives, for the monitoring tests."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
DASHBOARDS = ROOT / "manifests" / "monitoring" / "dashboards"
CHART_DASHBOARDS = ROOT / "charts" / "rlhf-operator" / "dashboards"
RULES = ROOT / "manifests" / "monitoring" / "prometheus-rules.yaml"

#: Values for Grafana's template variables when an expression is evaluated outside Grafana.
GRAFANA_VARS = {"$namespace": ".*", "$job": ".*", "${datasource}": ""}


def _walk_targets(node: Any, path: str) -> list[tuple[str, str]]:
    out = []
    if isinstance(node, dict):
        if "expr" in node and isinstance(node["expr"], str):
            out.append((path, node["expr"]))
        for k, v in node.items():
            if k != "templating":  # variable queries are Grafana functions (label_values), not PromQL
                out += _walk_targets(v, f"{path}.{k}")
    elif isinstance(node, list):
        for i, v in enumerate(node):
            out += _walk_targets(v, f"{path}[{i}]")
    return out


def panel_exprs(job: str = ".*") -> list[tuple[str, str]]:
    """(where, expr) for every panel target of every dashboard, Grafana variables substituted
    (`$job` by `job`, a regex: one job's name selects that job alone)."""
    out = []
    for f in sorted(DASHBOARDS.glob("*.json")):
        for where, expr in _walk_targets(json.loads(f.read_text()), f.name):
            for var, value in {**GRAFANA_VARS, "$job": job}.items():
                expr = expr.replace(var, value)
            out.append((where, expr))
    return out


def rule_groups() -> list[dict[str, Any]]:
    doc = yaml.safe_load(RULES.read_text())
    groups: list[dict[str, Any]] = doc["spec"]["groups"]
    return groups


def rule_exprs() -> list[tuple[str, str]]:
    return [(r.get("alert") or r.get("record"), r["expr"]) for g in rule_groups() for r in g["rules"]]


def as_rules_file(exprs: list[tuple[str, str]]) -> str:
    """Expressions as recording rules, so `promtool check rules` parses each one."""
    rules = [{"record": f"rlhf_check:expr_{i}", "expr": e} for i, (_, e) in enumerate(exprs)]
    return yaml.safe_dump({"groups": [{"name": "panels", "rules": rules}]})
