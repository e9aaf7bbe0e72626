"""The chart's ValidatingAdmissionPolicy on the real API server: a job's controller pod (its
per-job ServiceAccount, which RBAC lets patch the job's status) may write status.progress and
status.rollout.syncedGeneration, and is refused on the keys the operator decides on."""

from __future__ import annotations

from typing import Any

import pytest
from harness import Cluster, wait_for
from test_operator_e2e import GROUP, PLURAL, VERSION, Api, grpo_job, installed, operator  # noqa: F401 (fixtures)

from rlhf_operator.testing import OperatorProcess

pytestmark = pytest.mark.cluster


def test_the_jobs_controller_pod_cannot_patch_the_operators_status_keys(
    cluster: Cluster,
    namespace: str,
    operator: OperatorProcess,  # noqa: F811
) -> None:
    import kubernetes

    api = Api(cluster, namespace)
    name = "tenant"
    api.apply(grpo_job(name))
    status = api.wait_phase(name, "Running")
    restarts, generation = status["restarts"], status["rollout"]["generation"]
    # What the controller pod's token is: the job's own account, <job>-<12 characters of its UID>.
    account = f"{name}-{api.job(name)['metadata']['uid'][:12]}"
    pod = cluster.as_service_account(namespace, account, create=False)
    custom = kubernetes.client.CustomObjectsApi(pod.api_client())

    def patch(body: dict[str, Any]) -> Any:
        return custom.patch_namespaced_custom_object_status(GROUP, VERSION, namespace, PLURAL, name, body)

    # Its own keys: allowed.
    patch({"status": {"progress": {"step": 3, "totalSteps": 20}}})
    patch({"status": {"rollout": {"syncedGeneration": generation}}})
    assert api.status(name)["progress"]["step"] == 3

    for body, key in [
        ({"status": {"phase": "Succeeded"}}, "status.phase"),
        ({"status": {"restarts": 0 if restarts else 5}}, "status.restarts"),
        ({"status": {"rollout": {"generation": generation + 7}}}, "status.rollout.generation"),
        ({"status": {"conditions": []}}, "status.conditions"),
        ({"status": {"phase": "Succeeded", "progress": {"step": 4}}}, "status.phase"),
    ]:
        with pytest.raises(kubernetes.client.ApiException) as err:
            patch(body)
        assert err.value.status in (403, 422), err.value
        assert f"{key} belongs to the rlhf operator" in str(err.value.body), err.value.body

    after = api.status(name)
    assert after["phase"] == "Running" and after["restarts"] == restarts
    assert after["rollout"]["generation"] == generation and after["progress"]["step"] == 3
    # Its RBAC stops at its own job's status; the operator's writes go through as before.
    with pytest.raises(kubernetes.client.ApiException) as err:
        custom.patch_namespaced_custom_object(
            GROUP, VERSION, namespace, PLURAL, name, {"spec": {"suspend": True}}
        )
    assert err.value.status == 403
    cluster.kubectl("patch", "rltj", name, "-n", namespace, "--type=merge", "-p", '{"spec":{"suspend":true}}')
    wait_for(lambda: api.status(name).get("phase") == "Suspended", timeout=60, what="the operator's write")
