"""Invalid manifests are rejected by the API server itself (the CRD's schema and CEL rules), with a
message naming the field. No operator runs here: this is the CRD alone."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from harness import Cluster
from test_operator_e2e import installed  # noqa: F401  (fixture)

pytestmark = [pytest.mark.cluster, pytest.mark.usefixtures("installed")]

ROOT = Path(__file__).resolve().parents[2]
BASE = yaml.safe_load((ROOT / "manifests" / "examples" / "grpo-h100.yaml").read_text())


def variant(change: Any) -> dict[str, Any]:
    doc = copy.deepcopy(BASE)
    doc["metadata"] = {"name": "bad"}
    change(doc)
    return doc


def setp(path: str, value: Any) -> Any:
    def change(doc: dict[str, Any]) -> None:
        *head, last = path.split(".")
        obj = doc
        for key in head:
            obj = obj[int(key)] if isinstance(obj, list) else obj.setdefault(key, {})
        if value is _DELETE:
            del obj[last]
        else:
            obj[last] = value

    return change


_DELETE = object()

# (kind of mistake, change, text the API server's message must contain)
CREATE_CASES = [
    ("negative GPUs", setp("spec.roles.actor.resources.gpus", -1), "spec.roles.actor.resources.gpus"),
    ("min > max", setp("spec.roles.rollout.minReplicas", 5), "minReplicas must be <= rollout.maxReplicas"),
    (
        "replicas above max",
        setp("spec.roles.rollout.replicas", 9),
        "rollout.replicas must lie in [minReplicas, maxReplicas]",
    ),
    ("unknown algorithm", setp("spec.algorithm.name", "ppo2"), "algorithm.name must be one of"),
    ("missing model", setp("spec.model", _DELETE), "spec.model"),
    ("empty model path", setp("spec.model.path", ""), "model.path must not be empty"),
    ("unknown enum value", setp("spec.rollout.engine", "tgi"), "spec.rollout.engine"),
    ("unknown field", setp("spec.roles.actor.gpu", 8), "spec.roles.actor.gpu"),
    (
        "undefined node pool",
        setp("spec.roles.actor.nodePool", "a100"),
        "spec.roles.actor.nodePool must name an entry",
    ),
    ("bad quantity", setp("spec.roles.actor.resources.memory", "lots"), "spec.roles.actor.resources.memory"),
    ("top-p above 1", setp("spec.rollout.topP", 1.5), "spec.rollout.topP"),
    ("no actor", setp("spec.roles.actor.replicas", 0), "spec.roles.actor.replicas must be >= 1"),
    (
        "mini-batch not dividing the batch",
        setp("spec.training.miniBatchSize", 100),
        "spec.training.miniBatchSize",
    ),
    (
        "vLLM rollout without GPUs",
        setp("spec.roles.rollout.resources.gpus", 0),
        "spec.rollout.engine: vllm needs",
    ),
    (
        "duplicate pool names",
        setp("spec.nodePools", [{"name": "h100"}, {"name": "h100"}, {"name": "l4"}, {"name": "cpu"}]),
        "spec.nodePools: names must be unique",
    ),
    ("job name too long", setp("metadata.name", "x" * 51), "valid: at most 50"),
    (
        "bad reward import path",
        setp("spec.reward.functions.0.path", "not a path"),
        "spec.reward.functions[0].path",
    ),
    ("no reward at all", setp("spec.reward.functions", []), "reward needs at least one function or a model"),
    ("negative maxRestarts", setp("spec.failurePolicy.maxRestarts", -1), "spec.failurePolicy.maxRestarts"),
    ("wrong type", setp("spec.training.steps", "ten"), "spec.training.steps"),
    (
        "backoff cap below backoff",
        setp("spec.failurePolicy.maxBackoffSeconds", 1),
        "maxBackoffSeconds must be >= backoffSeconds",
    ),
    ("pool name not a DNS label", setp("spec.nodePools.2.name", "CPU_pool"), "spec.nodePools[2].name"),
]

# (kind of mistake, merge patch to an existing job, text the message must contain)
UPDATE_CASES = [
    ("immutable model", {"spec": {"model": {"path": "/models/other"}}}, "path is immutable"),
    ("immutable algorithm", {"spec": {"algorithm": {"name": "ppo"}}}, "name is immutable"),
    ("immutable role shape", {"spec": {"roles": {"actor": {"replicas": 4}}}}, "replicas is immutable"),
    (
        "immutable rollout resources",
        {"spec": {"roles": {"rollout": {"resources": {"gpus": 8}}}}},
        "resources is immutable",
    ),
]


@pytest.mark.parametrize("case,change,message", CREATE_CASES, ids=[c[0] for c in CREATE_CASES])
def test_invalid_manifest_is_rejected_naming_the_field(
    cluster: Cluster, namespace: str, case: str, change: Any, message: str
) -> None:
    doc = variant(change)
    res = _kubectl_create(cluster, namespace, doc)
    assert res.returncode != 0, f"{case}: accepted"
    assert message in res.stderr, f"{case}: {res.stderr}"


@pytest.mark.parametrize("case,patch,message", UPDATE_CASES, ids=[c[0] for c in UPDATE_CASES])
def test_immutable_fields_cannot_change(
    cluster: Cluster, namespace: str, case: str, patch: dict[str, Any], message: str
) -> None:
    doc = variant(lambda d: None)
    assert _kubectl_create(cluster, namespace, doc, dry_run=False).returncode == 0
    import subprocess

    from harness import kubectl_binary

    res = subprocess.run(
        [
            kubectl_binary(),
            f"--kubeconfig={cluster.kubeconfig}",
            "-n",
            namespace,
            "patch",
            "rltj",
            "bad",
            "--type=merge",
            "-p",
            json.dumps(patch),
        ],
        capture_output=True,
        text=True,
    )
    assert res.returncode != 0, f"{case}: accepted"
    assert message in res.stderr, f"{case}: {res.stderr}"


def test_rollout_replicas_stay_mutable(cluster: Cluster, namespace: str) -> None:
    doc = variant(lambda d: None)
    assert _kubectl_create(cluster, namespace, doc, dry_run=False).returncode == 0
    cluster.kubectl("scale", "rltj", "bad", "-n", namespace, "--replicas=4")
    assert (
        cluster.kubectl(
            "get", "rltj", "bad", "-n", namespace, "-o", "jsonpath={.spec.roles.rollout.replicas}"
        )
        == "4"
    )
    bad = cluster.kubectl("scale", "rltj", "bad", "-n", namespace, "--replicas=5", check=False)
    assert bad == ""  # above maxReplicas: rejected


def test_kubectl_explain_documents_the_fields(cluster: Cluster) -> None:
    out = cluster.kubectl("explain", "rltj.spec.roles.rollout")
    assert "Generation engines" in out
    assert "maxReplicas" in out and "Upper bound for autoscaling" in out


def _kubectl_create(cluster: Cluster, namespace: str, doc: dict[str, Any], dry_run: bool = True) -> Any:
    import subprocess

    from harness import kubectl_binary

    cmd = [kubectl_binary(), f"--kubeconfig={cluster.kubeconfig}", "-n", namespace, "create", "-f", "-"]
    if dry_run:
        cmd.append("--dry-run=server")
    return subprocess.run(cmd, input=yaml.safe_dump(doc), capture_output=True, text=True)
