"""The monitoring files the Helm chart ships, kept as copies of their one source.

The alert rules and the Grafana dashboards are written once, under `manifests/monitoring/` (what a
user without Helm applies). Helm reads nothing outside a chart's directory, so the chart carries
copies (`files/prometheus-rules.yaml`, `dashboards/*.json`); `rlhf crd --write` refreshes them with
the CRDs, and `rlhf crd --check` (run by a unit test) fails when one is stale, missing, or left
over after its source was removed. Nothing in the chart's copies is edited by hand.
"""

from __future__ import annotations

import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SOURCE = Path("manifests") / "monitoring"
CHART = Path("charts") / "rlhf-operator"


def pairs(root: Path = ROOT) -> list[tuple[Path, Path]]:
    """(source, chart copy) for every monitoring file."""
    src = root / SOURCE
    out = [(src / "prometheus-rules.yaml", root / CHART / "files" / "prometheus-rules.yaml")]
    out += [(p, root / CHART / "dashboards" / p.name) for p in sorted((src / "dashboards").glob("*.json"))]
    return out


def leftovers(root: Path = ROOT) -> list[Path]:
    """Dashboards in the chart with no source any more."""
    wanted = {copy for _, copy in pairs(root)}
    return [p for p in sorted((root / CHART / "dashboards").glob("*.json")) if p not in wanted]


def stale(root: Path = ROOT) -> list[Path]:
    """Chart copies that differ from their source, are missing, or have no source."""
    differ = [c for s, c in pairs(root) if not c.exists() or c.read_bytes() != s.read_bytes()]
    return differ + leftovers(root)


def write(root: Path = ROOT) -> list[Path]:
    """Refreshes every chart copy from its source and removes leftovers; returns what changed."""
    changed = []
    for source, copy in pairs(root):
        if not copy.exists() or copy.read_bytes() != source.read_bytes():
            copy.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(source, copy)
            changed.append(copy)
    for extra in leftovers(root):
        extra.unlink()
        changed.append(extra)
    return changed
