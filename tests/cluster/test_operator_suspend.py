"""Suspend, then resume at once while the suspended pods are still terminating (held here by a
finalizer of the test's, as a long grace period or a slow kubelet would hold them): the job waits
for them and starts its gang again without counting a restart."""

from __future__ import annotations

import json
import time

import pytest
from harness import Cluster, wait_for
from test_operator_e2e import Api, grpo_job, installed, operator  # noqa: F401 (fixtures)

from rlhf_operator.testing import OperatorProcess

pytestmark = pytest.mark.cluster

HOLD = "test.rlhf.dev/hold"


def test_suspend_then_immediate_resume_is_not_a_restart(
    cluster: Cluster,
    namespace: str,
    operator: OperatorProcess,  # noqa: F811
) -> None:
    api = Api(cluster, namespace)
    name = "blink"
    api.apply(grpo_job(name))
    api.wait_phase(name, "Running")
    old = {p.metadata.name: p.metadata.uid for p in api.pods(name)}
    for pod in old:
        cluster.kubectl(
            "patch",
            "pod",
            pod,
            "-n",
            namespace,
            "--type=merge",
            "-p",
            json.dumps({"metadata": {"finalizers": [HOLD]}}),
        )
    try:
        cluster.kubectl(
            "patch", "rltj", name, "-n", namespace, "--type=merge", "-p", '{"spec":{"suspend":true}}'
        )
        api.wait_phase(name, "Suspended")
        wait_for(
            lambda: all(p.metadata.deletion_timestamp for p in api.pods(name)) and len(api.pods(name)) == 7,
            timeout=30,
            what="every pod terminating, held by the test's finalizer",
        )
        cluster.kubectl(
            "patch", "rltj", name, "-n", namespace, "--type=merge", "-p", '{"spec":{"suspend":false}}'
        )
        api.wait_phase(name, "Pending")
        time.sleep(5)  # several passes over the terminating pods
        status = api.status(name)
        assert status["phase"] == "Pending" and status["restarts"] == 0, status
        assert {p.metadata.uid for p in api.pods(name)} == set(old.values())  # nothing new yet

    finally:  # release the pods whatever happened (they hold the pools' capacity)
        for pod in old:
            cluster.kubectl(
                "patch",
                "pod",
                pod,
                "-n",
                namespace,
                "--type=merge",
                "-p",
                '{"metadata":{"finalizers":null}}',
                check=False,
            )
    status = api.wait_phase(name, "Running", timeout=120)
    assert status["restarts"] == 0
    pods = api.pods(name)
    assert len(pods) == 7 and not {p.metadata.uid for p in pods} & set(old.values())
    assert {p.metadata.labels["rlhf.dev/restart-attempt"] for p in pods} == {"0"}
    reasons = {
        e.reason
        for e in api.core.list_namespaced_event(namespace, field_selector=f"involvedObject.name={name}").items
    }
    assert "GangRestart" not in reasons and {"Suspended", "Resumed"} <= reasons
