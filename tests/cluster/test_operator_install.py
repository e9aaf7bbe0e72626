"""The install path on the real control plane: tenants and defaults.

* A namespace editor (a ServiceAccount bound to the built-in `edit` ClusterRole in namespace A,
  which the chart's aggregated ClusterRole extends) creates, scales and deletes a job in A, reads
  its status, and is forbidden in namespace B.
* A GRPO job with `klCoef: 0`, a critic and a reference with replicas, and no `spec.image` gets no
  critic or reference pod, and its pods run the operator's default trainer image.
"""

from __future__ import annotations

import copy
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from harness import Cluster, ClusterError, wait_for
from test_operator_e2e import GROUP, PLURAL, VERSION, Api, grpo_job, installed, operator  # noqa: F401 (fixtures)

from rlhf_operator.testing import TEST_TRAINER_IMAGE, OperatorProcess

pytestmark = pytest.mark.cluster


@pytest.fixture
def other_namespace(cluster: Cluster) -> Iterator[str]:
    name = f"t-other-{uuid.uuid4().hex[:6]}"
    cluster.kubectl("create", "namespace", name)
    yield name
    cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)


def _bind_edit(cluster: Cluster, namespace: str, account: str) -> None:
    cluster.kubectl(
        "create", "rolebinding", f"{account}-edit", "-n", namespace, "--clusterrole=edit",
        f"--serviceaccount={namespace}:{account}",
    )  # fmt: skip


def test_a_namespace_editor_manages_jobs_in_their_namespace_and_nowhere_else(
    cluster: Cluster,
    installed: Any,  # noqa: F811 (the chart's RBAC, aggregated ClusterRoles included)
    namespace: str,
    other_namespace: str,
) -> None:
    import kubernetes

    _bind_edit(cluster, namespace, "alice")
    alice = cluster.as_service_account(namespace, "alice", create=True)
    custom = kubernetes.client.CustomObjectsApi(alice.api_client())
    # The aggregation controller folds the chart's ClusterRole into `edit` shortly after install.
    wait_for(
        lambda: (
            alice.kubectl(
                "auth", "can-i", "create", f"{PLURAL}.{GROUP}", "-n", namespace, check=False
            ).strip()
            == "yes"
        ),
        timeout=60,
        what="edit to include rltrainingjobs",
    )
    job = grpo_job("by-alice")
    custom.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, job)
    alice.kubectl("scale", f"{PLURAL}.{GROUP}/by-alice", "-n", namespace, "--replicas=3")
    got = custom.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "by-alice")
    assert got["spec"]["roles"]["rollout"]["replicas"] == 3
    custom.get_namespaced_custom_object_status(GROUP, VERSION, namespace, PLURAL, "by-alice")
    # Status is the operator's and the controller pod's: an editor reads it, never writes it.
    with pytest.raises(kubernetes.client.ApiException) as err:
        custom.patch_namespaced_custom_object_status(
            GROUP, VERSION, namespace, PLURAL, "by-alice", {"status": {"phase": "Succeeded"}}
        )
    assert err.value.status == 403
    custom.delete_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "by-alice")

    for call in (
        lambda: custom.create_namespaced_custom_object(GROUP, VERSION, other_namespace, PLURAL, job),
        lambda: custom.list_namespaced_custom_object(GROUP, VERSION, other_namespace, PLURAL),
    ):
        with pytest.raises(kubernetes.client.ApiException) as err:
            call()
        assert err.value.status == 403, err.value
    with pytest.raises(ClusterError):
        alice.kubectl("scale", f"{PLURAL}.{GROUP}/by-alice", "-n", other_namespace, "--replicas=2")


def test_grpo_without_kl_and_without_an_image_gets_no_critic_or_reference_pod(
    cluster: Cluster,
    namespace: str,
    operator: OperatorProcess,  # noqa: F811
) -> None:
    doc = grpo_job("no-idle", algorithm={"name": "grpo", "params": {"klCoef": 0}})
    roles = doc["spec"]["roles"]
    roles["critic"] = {**copy.deepcopy(roles["reference"]), "replicas": 1}  # given replicas: still unused
    assert "image" not in doc["spec"] and roles["reference"]["replicas"] >= 1
    api = Api(cluster, namespace)
    api.apply(doc)
    api.wait_phase("no-idle", "Running")
    pods = api.pods("no-idle")
    assert {p.metadata.labels["rlhf.dev/role"] for p in pods} == {"controller", "actor", "reward", "rollout"}
    assert {c.image for p in pods for c in p.spec.containers} == {TEST_TRAINER_IMAGE}
