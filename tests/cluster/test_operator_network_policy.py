"""The job's NetworkPolicy as the real API server stores it: every port from the job's own pods,
only the metrics port from the operator's pods and the monitoring namespaces. The test cluster's
network enforces no policy, so this checks the stored object (that the server accepts the rules
as built, with the operator's settings from its environment), not a refused connection."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from harness import Cluster, wait_for
from test_operator_e2e import Api, grpo_job, installed, unique  # noqa: F401 (fixtures)

from rlhf_api import contract
from rlhf_operator import network_policy
from rlhf_operator.testing import OperatorProcess

pytestmark = pytest.mark.cluster


def test_the_operator_and_monitoring_reach_only_the_metrics_port(
    cluster: Cluster,
    namespace: str,
    installed: Any,  # noqa: F811
    tmp_path: Path,
) -> None:
    env = {
        network_policy.ENV_NAMESPACE: "rlhf-system",
        network_policy.ENV_POD_SELECTOR: "app.kubernetes.io/name=rlhf-operator",
        network_policy.ENV_MONITORING: "monitoring",
    }
    api = Api(cluster, namespace)
    name = unique("netpol")
    with OperatorProcess(installed.kubeconfig, [namespace], log_path=tmp_path / "op.log", env=env) as op:
        try:
            api.apply(grpo_job(name))
            path = f"/apis/networking.k8s.io/v1/namespaces/{namespace}/networkpolicies/{name}"
            stored = wait_for(lambda: _get(cluster, path), timeout=60, what="the job's NetworkPolicy")
        finally:
            print(op.log_tail(2000))
    own, metrics = stored["spec"]["ingress"]
    assert own == {"from": [{"podSelector": {"matchLabels": {"rlhf.dev/job-name": name}}}]}
    assert metrics["ports"] == [{"protocol": "TCP", "port": contract.METRICS_PORT}]
    namespaces = [
        p["namespaceSelector"]["matchLabels"]["kubernetes.io/metadata.name"] for p in metrics["from"]
    ]
    assert namespaces == ["rlhf-system", "monitoring"]
    assert metrics["from"][0]["podSelector"] == {"matchLabels": {"app.kubernetes.io/name": "rlhf-operator"}}


def _get(cluster: Cluster, path: str) -> dict[str, Any] | None:
    import kubernetes

    try:
        return cluster.request("GET", path)  # type: ignore[no-any-return]
    except kubernetes.client.ApiException as err:
        if err.status == 404:
            return None
        raise
