"""The Helm chart: every scenario values file renders and passes the API server's dry run; the
CRD it ships is the generated one."""

from __future__ import annotations

import json

import pytest
import yaml
from harness import Cluster
from test_operator_e2e import CHART, installed, render_chart  # noqa: F401  (installed is a fixture)

from rlhf_operator import crd

pytestmark = [pytest.mark.cluster, pytest.mark.usefixtures("installed")]

SCENARIOS = sorted(p.name for p in (CHART / "ci").glob("*.yaml"))
PROMETHEUS_OPERATOR_GROUP = "monitoring.coreos.com/"
ROOT = CHART.parents[1]


@pytest.mark.parametrize("values", SCENARIOS)
def test_helm_template_passes_server_dry_run(cluster: Cluster, values: str) -> None:
    # Objects of the Prometheus Operator's CRDs, absent from the test cluster, are left out of the
    # dry run; test_monitoring_objects checks them.
    docs = [
        d
        for d in yaml.safe_load_all(render_chart(values))
        if d and not d["apiVersion"].startswith(PROMETHEUS_OPERATOR_GROUP)
    ]
    rendered = yaml.safe_dump_all(docs)
    for doc in docs:  # namespaces a scenario binds into must exist for the dry run
        ns = doc.get("metadata", {}).get("namespace")
        if ns:
            cluster.kubectl("create", "namespace", ns, check=False)
    out = cluster.kubectl(
        "apply", "--server-side", "--force-conflicts", "--dry-run=server", "-f", "-", input=rendered
    )
    kinds = {d["kind"] for d in docs}
    assert {"CustomResourceDefinition", "ClusterRole", "ServiceAccount", "Deployment"} <= kinds
    assert "serverside-applied (server dry run)" in out


def test_installed_crd_is_the_generated_one(cluster: Cluster) -> None:
    live = json.loads(cluster.kubectl("get", "crd", crd.CRD_NAME, "-o", "json"))
    want = crd.build_crd()
    assert live["spec"]["versions"][0]["schema"] == json.loads(
        json.dumps(want["spec"]["versions"][0]["schema"])
    )
    assert live["spec"]["versions"][0]["subresources"] == want["spec"]["versions"][0]["subresources"]


def test_monitoring_objects() -> None:
    """Dashboards, alerts and the scrape of every job's controller pod ship in the chart, and are
    the same files as manifests/monitoring/."""
    docs = [d for d in yaml.safe_load_all(render_chart("monitoring-values.yaml")) if d]
    by_kind: dict[str, list[dict]] = {}
    for d in docs:
        by_kind.setdefault(d["kind"], []).append(d)

    (rule,) = by_kind["PrometheusRule"]
    shipped = yaml.safe_load((ROOT / "manifests" / "monitoring" / "prometheus-rules.yaml").read_text())
    assert rule["spec"] == shipped["spec"]
    assert rule["metadata"]["labels"]["release"] == "kube-prometheus-stack"

    (pm,) = by_kind["PodMonitor"]
    assert pm["spec"]["selector"]["matchLabels"] == {"rlhf.dev/role": "controller"}
    relabel = pm["spec"]["podMetricsEndpoints"][0]["relabelings"]
    assert {
        "sourceLabels": ["__meta_kubernetes_pod_label_rlhf_dev_job_name"],
        "targetLabel": "rlhf_job",
    } in relabel
    assert pm["spec"]["podMetricsEndpoints"][0]["port"] == "metrics"
    assert len(by_kind["ServiceMonitor"]) == 1

    dashboards = {
        name: json.loads(body)
        for cm in by_kind["ConfigMap"]
        for name, body in cm["data"].items()
        if name.endswith(".json")
    }
    for path in (ROOT / "manifests" / "monitoring" / "dashboards").glob("*.json"):
        assert dashboards.pop(path.name) == json.loads(path.read_text()), path.name
    assert not dashboards, f"dashboards in the chart but not in manifests/monitoring: {sorted(dashboards)}"
    assert all(cm["metadata"]["labels"]["grafana_dashboard"] == "1" for cm in by_kind["ConfigMap"])
