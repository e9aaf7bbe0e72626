"""What the chart tells Prometheus and the operator about scraping: the PodMonitor selects only the
namespaces the operator watches, and the operator's Prometheus allow-list is the chart's value
(read back through the operator's own parser). Rendered with the real `helm template` (the
binary the cluster build caches); skipped, saying so, where it has not been built."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from rlhf_operator import autoscaler

CHART = Path(__file__).resolve().parents[3] / "charts" / "rlhf-operator"


def helm_binary() -> Path | None:
    """helm from $RLHF_KUBE_ASSETS, the cluster build's cache (~/.cache/rlhf-operator/bin/<version>), or PATH."""
    given = os.environ.get("RLHF_KUBE_ASSETS")
    cache = Path(os.environ.get("RLHF_CACHE_DIR") or Path.home() / ".cache" / "rlhf-operator")
    candidates = ([Path(given) / "helm"] if given else []) + sorted(cache.glob("bin/*/helm"))
    on_path = shutil.which("helm")
    candidates += [Path(on_path)] if on_path else []
    return next((c for c in candidates if os.access(c, os.X_OK)), None)


HELM = helm_binary()
pytestmark = pytest.mark.skipif(HELM is None, reason="helm not built yet (tests/cluster/build caches it)")


def helm(*args: str) -> subprocess.CompletedProcess[str]:
    assert HELM is not None
    return subprocess.run([str(HELM), *args], capture_output=True, text=True, timeout=120)


def render(*sets: str) -> list[dict[str, Any]]:
    args = ["template", "r", str(CHART), "--namespace", "rlhf-system", "--set", "crds.install=false"]
    for s in sets:
        args += ["--set", s]
    out = helm(*args)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def one(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    (found,) = [d for d in docs if d["kind"] == kind]
    return found


def operator_env(docs: list[dict[str, Any]]) -> dict[str, str]:
    container = one(docs, "Deployment")["spec"]["template"]["spec"]["containers"][0]
    return {e["name"]: e["value"] for e in container["env"] if "value" in e}


@pytest.mark.parametrize(
    "watch,selector",
    [
        ([], {"any": True}),
        (["team-a"], {"matchNames": ["team-a"]}),
        (["team-a", "team-b"], {"matchNames": ["team-a", "team-b"]}),
    ],
)
def test_pod_monitor_selects_only_the_watched_namespaces(watch: list[str], selector: dict[str, Any]) -> None:
    sets = ["podMonitor.enabled=true"] + ([f"watchNamespaces={{{','.join(watch)}}}"] if watch else [])
    docs = render(*sets)
    assert one(docs, "PodMonitor")["spec"]["namespaceSelector"] == selector
    # ... the same namespaces the operator is told to watch.
    args = one(docs, "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert [a.split("=", 1)[1] for a in args if a.startswith("--namespace=")] == watch
    assert ("--all-namespaces" in args) is (not watch)


@pytest.mark.parametrize(
    "value,prefixes",
    [
        (None, ()),
        ("{http://prometheus-operated.monitoring:9090}", ("http://prometheus-operated.monitoring:9090",)),
        ("{http://a:9090,https://b/prom}", ("http://a:9090", "https://b/prom")),
    ],
)
def test_the_operator_reads_the_prometheus_allow_list_the_chart_gives_it(
    value: str | None, prefixes: tuple[str, ...]
) -> None:
    docs = render(*([f"autoscaler.prometheusUrlPrefixes={value}"] if value else []))
    assert autoscaler.prometheus_url_prefixes(operator_env(docs)) == prefixes


@pytest.mark.parametrize(
    "value", ["{prometheus:9090}", "{http://a:9090?x=1}", "{http://user@a:9090}", "{ftp://a}"]
)
def test_the_schema_refuses_a_prefix_that_is_not_an_http_url(value: str) -> None:
    out = helm("template", "r", str(CHART), "--set", f"autoscaler.prometheusUrlPrefixes={value}")
    assert out.returncode != 0
    assert "/autoscaler/prometheusUrlPrefixes/0" in out.stderr, out.stderr
