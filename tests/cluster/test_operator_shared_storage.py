"""A job whose checkpoints lie on a claim its pods cannot all write is held back by the operator,
on the real control plane, under the chart's RBAC: the checkpoint claim of a multi-pod gang is
ReadWriteOnce, so the job gets `StorageNotShared` naming the claim and its access mode and no pod;
once the claim is replaced by a ReadWriteMany one (nothing else changes, no event on the job), the
operator creates the gang by itself (`reconcile.shared_storage`, `storage.claim_findings`)."""

from __future__ import annotations

import time
from typing import Any

import pytest
from harness import Cluster, wait_for
from kubernetes.client import ApiException
from test_operator_e2e import Api, grpo_job, installed, operator, unique  # noqa: F401

from rlhf_operator.testing import OperatorProcess

pytestmark = pytest.mark.cluster

CLAIM = "ckpt-once"


def _claim(mode: str) -> dict[str, Any]:
    # Unbound (no class, no volume): the access modes the operator reads are the claim's spec.
    return {
        "metadata": {"name": CLAIM},
        "spec": {
            "accessModes": [mode],
            "storageClassName": "",
            "resources": {"requests": {"storage": "1Gi"}},
        },
    }


def _not_shared(api: Api, name: str) -> dict[str, Any] | None:
    conds = api.status(name).get("conditions") or []
    return next((c for c in conds if c.get("type") == "StorageNotShared"), None)


def test_a_read_write_once_checkpoint_claim_gets_no_pods_until_it_is_read_write_many(
    cluster: Cluster,
    namespace: str,
    operator: OperatorProcess,  # noqa: F811
) -> None:
    api = Api(cluster, namespace)
    api.core.create_namespaced_persistent_volume_claim(namespace, _claim("ReadWriteOnce"))
    name = unique("once")
    doc = grpo_job(name)
    for v in doc["spec"]["pod"]["volumes"]:
        if v["name"] == "checkpoints":
            v["persistentVolumeClaim"]["claimName"] = CLAIM
    api.apply(doc)

    cond = wait_for(
        lambda: (c := _not_shared(api, name)) and c["status"] == "True" and c,
        timeout=60,
        what=f"job {namespace}/{name} to report StorageNotShared",
    )
    assert cond["reason"] == "ClaimNotShared"
    assert f"persistentVolumeClaim '{CLAIM}' with access mode ReadWriteOnce" in cond["message"]
    assert "valid: a claim with access mode ReadWriteMany" in cond["message"]
    assert api.status(name)["phase"] == "Pending"
    time.sleep(3)  # a few more passes: still no pod
    assert api.pods(name) == []

    # The user replaces the claim (its access modes are immutable) with a ReadWriteMany one.
    api.core.delete_namespaced_persistent_volume_claim(CLAIM, namespace)

    def gone() -> bool:
        try:
            api.core.read_namespaced_persistent_volume_claim(CLAIM, namespace)
        except ApiException as err:
            return err.status == 404
        return False

    wait_for(gone, timeout=60, what=f"claim {namespace}/{CLAIM} deleted")
    api.core.create_namespaced_persistent_volume_claim(namespace, _claim("ReadWriteMany"))

    pods = wait_for(lambda: api.pods(name), timeout=60, what=f"pods of {namespace}/{name}")
    assert pods
    cond = wait_for(
        lambda: (c := _not_shared(api, name)) and c["status"] == "False" and c,
        timeout=30,
        what="StorageNotShared False",
    )
    assert cond["reason"] == "ClaimsShared"


@pytest.fixture
def operator_without_claim_reads(
    installed: Any,  # noqa: F811
    cluster: Cluster,
    namespace: str,
    tmp_path: Any,
) -> Any:
    """The operator as an older chart installed it: the chart's ClusterRole without its rule on
    persistentvolumeclaims (a copy, bound to a ServiceAccount of its own, with the chart's discovery
    role), watching `namespace`. Yields (process, the copy's name); removes what it made."""
    import kubernetes

    # Any: the client takes plain dicts as its models (typed as the models).
    rbac: Any = kubernetes.client.RbacAuthorizationV1Api(cluster.admin())
    core: Any = kubernetes.client.CoreV1Api(cluster.admin())
    chart = cluster.admin().sanitize_for_serialization(rbac.read_cluster_role("rlhf-operator"))
    rules = [r for r in chart["rules"] if "persistentvolumeclaims" not in r.get("resources", [])]
    assert len(rules) == len(chart["rules"]) - 1, "the chart's ClusterRole has one rule on claims"
    old = f"rlhf-operator-old-{namespace}"
    rbac.create_cluster_role({"metadata": {"name": old}, "rules": rules})
    core.create_namespaced_service_account("rlhf-system", {"metadata": {"name": old}})
    subject = [{"kind": "ServiceAccount", "name": old, "namespace": "rlhf-system"}]
    for role in (old, "rlhf-operator-discovery"):
        rbac.create_cluster_role_binding(
            {
                "metadata": {"name": f"{old}-{role.rsplit('-', 1)[-1]}"},
                "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": role},
                "subjects": subject,
            }
        )
    proc = OperatorProcess(
        cluster.as_service_account("rlhf-system", old).kubeconfig,
        [namespace],
        log_path=tmp_path / "operator.log",
    )
    proc.start()
    try:
        yield proc, old
    finally:
        proc.stop()
        print(proc.log_tail(3000))
        for role in (old, "rlhf-operator-discovery"):
            rbac.delete_cluster_role_binding(f"{old}-{role.rsplit('-', 1)[-1]}")
        rbac.delete_cluster_role(old)
        core.delete_namespaced_service_account(old, "rlhf-system")


def test_without_get_on_claims_the_job_says_which_permission_is_missing_until_it_is_granted(
    cluster: Cluster, namespace: str, operator_without_claim_reads: Any
) -> None:
    """Under an older chart's ClusterRole (no `get` on persistentvolumeclaims) the API server
    answers the operator's read of the checkpoint claim 403: the job gets StorageNotShared /
    ClaimsForbidden naming the claim, the namespace and the missing verb, and no pod; the operator
    keeps running. Once the verb is granted (nothing else changes), the gang is created."""
    import kubernetes

    proc, old = operator_without_claim_reads
    api = Api(cluster, namespace)
    name = unique("norbac")
    api.apply(grpo_job(name))
    cond = wait_for(
        lambda: (c := _not_shared(api, name)) and c["status"] == "True" and c,
        timeout=60,
        what=f"job {namespace}/{name} to report StorageNotShared",
    )
    assert cond["reason"] == "ClaimsForbidden"
    assert f"in namespace {namespace!r}" in cond["message"]
    assert "lacks the verb get on persistentvolumeclaims" in cond["message"]
    assert "HTTP 403" in cond["message"] and "forbidden" in cond["message"]
    assert api.status(name)["phase"] == "Pending"
    time.sleep(3)
    assert api.pods(name) == []
    assert proc.proc is not None and proc.proc.poll() is None  # the operator did not die

    rbac = kubernetes.client.RbacAuthorizationV1Api(cluster.admin())
    rbac.patch_cluster_role(
        old,
        [
            {
                "op": "add",
                "path": "/rules/-",
                "value": {"apiGroups": [""], "resources": ["persistentvolumeclaims"], "verbs": ["get"]},
            }
        ],
    )
    assert wait_for(lambda: api.pods(name), timeout=60, what=f"pods of {namespace}/{name}")
    cond = wait_for(
        lambda: (c := _not_shared(api, name)) and c["status"] == "False" and c,
        timeout=30,
        what="StorageNotShared False",
    )
    assert cond["reason"] == "ClaimsShared"
