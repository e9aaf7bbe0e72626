"""Failures of pods that never start, and children the API server refuses, on the real control plane.

kwok plays a kubelet that cannot pull `MISSING_IMAGE` (stages/pod-image-pull-error.yaml: the
containers wait with `ErrImagePull` and containerd's message); the API server's own ResourceQuota
admission and pod validation refuse the children. The operator runs under the chart's RBAC.
"""

from __future__ import annotations

import json
import time
from typing import Any

import pytest
from harness import Cluster, wait_for
from test_operator_e2e import Api, grpo_job, installed, operator  # noqa: F401  (fixtures)

from rlhf_operator.testing import OperatorProcess

pytestmark = pytest.mark.cluster

#: The image kwok's stage never "pulls".
MISSING_IMAGE = "registry.invalid/rlhf/missing:1"


def events(cluster: Cluster, namespace: str, name: str) -> list[dict[str, Any]]:
    out = cluster.kubectl(
        "get", "events", "-n", namespace, f"--field-selector=involvedObject.name={name}", "-o", "json"
    )
    return list(json.loads(out)["items"])


def condition(api: Api, name: str, type_: str, status: str = "True") -> dict[str, Any] | None:
    return next(
        (c for c in api.status(name).get("conditions", []) if c["type"] == type_ and c["status"] == status),
        None,
    )


def test_missing_image_is_reported_then_fails_the_job_within_its_timeout(
    cluster: Cluster,
    namespace: str,
    operator: OperatorProcess,  # noqa: F811
) -> None:
    api = Api(cluster, namespace)
    name = "noimage"
    timeout = 20
    api.apply(
        grpo_job(
            name,
            image=MISSING_IMAGE,
            scheduling={"timeoutSeconds": timeout},
            failurePolicy={"maxRestarts": 3, "backoffSeconds": 1},
        )
    )
    applied = time.monotonic()

    cond = wait_for(lambda: condition(api, name, "PodFailure"), timeout=60, what="PodFailure condition")
    assert cond["reason"] == "ImagePullFailed", cond
    assert f"image '{MISSING_IMAGE}' cannot be pulled (ErrImagePull: failed to pull" in cond["message"], cond
    assert cond["message"].startswith(f"pod {name}-"), cond
    warning = wait_for(
        lambda: next((e for e in events(cluster, namespace, name) if e["reason"] == "ImagePullFailed"), None),
        timeout=30,
        what="ImagePullFailed Event",
    )
    assert warning["type"] == "Warning"
    assert f"pod {name}-" in warning["message"] and MISSING_IMAGE in warning["message"]

    status = api.wait_phase(name, "Failed", timeout=90)
    took = time.monotonic() - applied
    failed = next(c for c in status["conditions"] if c["type"] == "Failed")
    assert failed["reason"] == "ImagePullFailed" and "without a gang restart" in failed["message"], failed
    assert status["restarts"] == 0  # a restart would pull the same image
    # Acted on after the grace (min(60 s, timeoutSeconds) from the bind), with slack for 2 shared cores.
    assert took < timeout + 45, took

    # Reported once (first sight) and once more when it failed the job (that Event follows the
    # status write), not on every pass of the grace period.
    def pull_events() -> int:
        return len([e for e in events(cluster, namespace, name) if e["reason"] == "ImagePullFailed"])

    wait_for(lambda: pull_events() == 2, timeout=30, what="the second ImagePullFailed Event")
    time.sleep(3)
    assert pull_events() == 2
    wait_for(lambda: api.pods(name) == [], timeout=60, what="the failed job's pods removed (GPUs freed)")


def test_quota_refusal_is_reported_and_retried_until_the_quota_allows_it(
    cluster: Cluster,
    namespace: str,
    operator: OperatorProcess,  # noqa: F811
) -> None:
    import kubernetes

    core = kubernetes.client.CoreV1Api(cluster.admin())
    quota = {"metadata": {"name": "gpu"}, "spec": {"hard": {"requests.nvidia.com/gpu": "0"}}}
    core.create_namespaced_resource_quota(namespace, quota)
    wait_for(
        lambda: (core.read_namespaced_resource_quota("gpu", namespace).status.hard or {}).get(
            "requests.nvidia.com/gpu"
        ),
        timeout=30,
        what="the quota controller to observe the quota",
    )
    api = Api(cluster, namespace)
    name = "quota"
    api.apply(grpo_job(name))

    cond = wait_for(lambda: condition(api, name, "ChildFailure"), timeout=60, what="ChildFailure condition")
    assert cond["reason"] == "QuotaExceeded", cond
    assert (
        "refused by the API server (HTTP 403)" in cond["message"] and "exceeded quota: gpu" in cond["message"]
    )
    assert api.status(name)["phase"] == "Pending"
    time.sleep(12)  # several retries (5 s, then as long as refused) ...
    refusals = [e for e in events(cluster, namespace, name) if e["reason"] == "QuotaExceeded"]
    assert len(refusals) == 1 and refusals[0]["type"] == "Warning", refusals  # ... reported once

    core.patch_namespaced_resource_quota(
        "gpu", namespace, {"spec": {"hard": {"requests.nvidia.com/gpu": "1000"}}}
    )
    api.wait_phase(name, "Running", timeout=120)
    cleared = condition(api, name, "ChildFailure", status="False")
    assert cleared is not None and cleared["reason"] == "ChildrenCreated"


def test_invalid_child_fails_the_job_naming_the_object_and_the_server_message(
    cluster: Cluster,
    namespace: str,
    operator: OperatorProcess,  # noqa: F811
) -> None:
    api = Api(cluster, namespace)
    name = "badaffinity"
    doc = grpo_job(name)
    bad = {"key": "rlhf.dev/pool", "operator": "Among", "values": ["l4"]}
    for pool in doc["spec"]["nodePools"]:
        if pool["name"] == "l4":  # only the rollout pods use it
            pool["affinity"] = {
                "nodeAffinity": {
                    "requiredDuringSchedulingIgnoredDuringExecution": {
                        "nodeSelectorTerms": [{"matchExpressions": [bad]}]
                    }
                }
            }
    api.apply(doc)
    status = api.wait_phase(name, "Failed", timeout=60)
    failed = next(c for c in status["conditions"] if c["type"] == "Failed")
    assert failed["reason"] == "ChildRejected", failed
    assert f"Pod {name}-rollout-0: rejected by the API server (HTTP 422)" in failed["message"], failed
    assert "Among" in failed["message"]
    warnings = [e for e in events(cluster, namespace, name) if e["reason"] == "ChildRejected"]
    assert len(warnings) == 1 and warnings[0]["type"] == "Warning"
    wait_for(lambda: api.pods(name) == [], timeout=60, what="the pods created before the refusal removed")


def test_a_custom_algorithms_bad_params_fail_the_job_before_any_pod(
    cluster: Cluster,
    namespace: str,
    operator: OperatorProcess,  # noqa: F811
) -> None:
    """The API server cannot see into a custom algorithm's free-form customParams (it accepts the
    job); the operator checks them before it creates anything: Failed / InvalidSpec, no pod."""
    api = Api(cluster, namespace)
    name = "badcustom"
    doc = grpo_job(name)
    doc["spec"]["algorithm"] = {"name": "my_pkg.algos:MyAlgo", "customParams": {"my-coef": 0.5}}
    api.apply(doc)
    status = api.wait_phase(name, "Failed", timeout=60)
    failed = next(c for c in status["conditions"] if c["type"] == "Failed")
    assert failed["reason"] == "InvalidSpec", failed
    assert "spec.algorithm.customParams.my-coef: 'my-coef' can never be a param" in failed["message"], failed
    assert api.pods(name) == []
    warnings = [e for e in events(cluster, namespace, name) if e["reason"] == "InvalidSpec"]
    assert len(warnings) == 1 and warnings[0]["type"] == "Warning"
