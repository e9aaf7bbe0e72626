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
