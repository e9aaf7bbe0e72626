"""Job bodies and pod states for the operator's unit tests (no cluster)."""

from __future__ import annotations

import copy
import datetime as dt
from typing import Any

T0 = dt.datetime(2025, 1, 1, 12, 0, 0, tzinfo=dt.timezone.utc)


def at(seconds: float) -> dt.datetime:
    return T0 + dt.timedelta(seconds=seconds)


BASE_SPEC: dict[str, Any] = {
    "model": {"path": "/models/qwen"},
    "data": {"path": "/data/prompts.jsonl"},
    "reward": {"functions": [{"path": "rewards.math:exact"}]},
    "algorithm": {"name": "grpo"},
    "image": "trainer:test",
    # The run and checkpoint directories (relative: below /workspace) on one claim every pod mounts
    # (`storage.cluster_storage_findings`); FakeKube holds it as ReadWriteMany (`WORK_CLAIM`).
    "pod": {
        "volumes": [
            {"name": "work", "mountPath": "/workspace", "persistentVolumeClaim": {"claimName": "work"}}
        ]
    },
    "nodePools": [
        {
            "name": "h100",
            "nodeSelector": {"rlhf.dev/pool": "h100"},
            "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        },
        {"name": "l4", "nodeSelector": {"rlhf.dev/pool": "l4"}},
    ],
    "roles": {
        "placement": "disaggregated",
        "actor": {"replicas": 2, "nodePool": "h100", "resources": {"gpus": 8, "cpu": "16", "memory": "64Gi"}},
        "critic": {"replicas": 0},
        "reference": {"replicas": 1, "nodePool": "h100", "resources": {"gpus": 1}},
        "reward": {"replicas": 0},
        "rollout": {
            "replicas": 2,
            "minReplicas": 1,
            "maxReplicas": 4,
            "nodePool": "l4",
            "resources": {"gpus": 1},
        },
    },
    "failurePolicy": {"maxRestarts": 2, "backoffSeconds": 10, "maxBackoffSeconds": 60},
    "scheduling": {"timeoutSeconds": 60},
}


#: BASE_SPEC without its volumes: the pod builders' tests see only what the operator mounts.
NO_VOLUMES_SPEC: dict[str, Any] = {k: v for k, v in BASE_SPEC.items() if k != "pod"}

#: The claim BASE_SPEC's pods share, as the API server stores it.
WORK_CLAIM: dict[str, Any] = {
    "apiVersion": "v1",
    "kind": "PersistentVolumeClaim",
    "metadata": {"name": "work", "namespace": "ns"},
    "spec": {"accessModes": ["ReadWriteMany"]},
    "status": {"phase": "Bound", "accessModes": ["ReadWriteMany"]},
}


def job(
    name: str = "j",
    spec: dict[str, Any] | None = None,
    status: dict[str, Any] | None = None,
    **spec_updates: Any,
) -> dict[str, Any]:
    s = copy.deepcopy(spec if spec is not None else BASE_SPEC)
    s.update(spec_updates)
    body: dict[str, Any] = {
        "apiVersion": "rlhf.dev/v1alpha1",
        "kind": "RLTrainingJob",
        "metadata": {
            "name": name,
            "namespace": "ns",
            "uid": "uid-1",
            "generation": 1,
            "resourceVersion": "1",
        },
        "spec": s,
    }
    if status is not None:
        body["status"] = status
    return body


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch, as the API server applies the operator's status writes."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merge_patch(out.get(key), value)
    return out


def with_status(body: dict[str, Any], status: dict[str, Any]) -> dict[str, Any]:
    """The job as the operator's writes leave it: `status` merged, and the restart record
    (`restart_record`, the annotations the executor writes) saying what the status says."""
    out = copy.deepcopy(body)
    out["status"] = merge_patch(out.get("status") or {}, status)
    return with_record(out, out["status"].get("restarts"), out["status"].get("countedRestarts"))


def with_record(body: dict[str, Any], restarts: int | None, counted: int | None = None) -> dict[str, Any]:
    """`body` with the operator's restart record (no record for restarts None)."""
    from rlhf_operator import restart_record

    out = copy.deepcopy(body)
    if restarts is not None:
        notes = out["metadata"].setdefault("annotations", {})
        notes[restart_record.RESTARTS] = str(restarts)
        notes[restart_record.COUNTED_RESTARTS] = str(restarts if counted is None else counted)
    return out


def scheduled(pod: dict[str, Any], node: str = "node-0") -> dict[str, Any]:
    p = copy.deepcopy(pod)
    p["metadata"]["uid"] = "uid-" + p["metadata"]["name"]
    p["spec"]["nodeName"] = node
    p["status"] = {"phase": "Pending", "conditions": [{"type": "PodScheduled", "status": "True"}]}
    return p


def running(pod: dict[str, Any]) -> dict[str, Any]:
    p = scheduled(pod)
    p["status"]["phase"] = "Running"
    return p


def phase(pod: dict[str, Any], value: str, reason: str | None = None) -> dict[str, Any]:
    p = running(pod)
    p["status"]["phase"] = value
    if reason:
        p["status"]["reason"] = reason
    return p


def unschedulable(pod: dict[str, Any], message: str) -> dict[str, Any]:
    p = copy.deepcopy(pod)
    p["metadata"]["uid"] = "uid-" + p["metadata"]["name"]
    p["spec"].pop("nodeName", None)
    p["status"] = {
        "phase": "Pending",
        "conditions": [
            {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": message}
        ],
    }
    return p


def names(objs: list[dict[str, Any]]) -> list[str]:
    return sorted(o["metadata"]["name"] for o in objs)


def bare_pod(name: str, role: str = "actor", index: int = 0, **status: Any) -> dict[str, Any]:
    """A minimal labelled pod for the policy modules: `deleting=True` sets a deletionTimestamp,
    `node=` binds it; the other keywords are its status."""
    meta: dict[str, Any] = {
        "name": name,
        "labels": {"rlhf.dev/role": role, "rlhf.dev/replica-index": str(index)},
    }
    if status.pop("deleting", False):
        meta["deletionTimestamp"] = "2025-01-01T00:00:00Z"
    spec = {"nodeName": status.pop("node")} if "node" in status else {}
    return {"metadata": meta, "spec": spec, "status": status}
