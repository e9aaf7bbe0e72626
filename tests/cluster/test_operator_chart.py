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


@pytest.mark.parametrize("values", SCENARIOS)
def test_helm_template_passes_server_dry_run(cluster: Cluster, values: str) -> None:
    rendered = render_chart(values)
    docs = [d for d in yaml.safe_load_all(rendered) if d]
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
