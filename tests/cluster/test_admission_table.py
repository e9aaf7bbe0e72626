"""The admission table (tests/admission_cases.py) through a real API server with the chart's CRD:
every invalid manifest `rlhf validate` refuses (tests/unit/test_admission.py) is refused here too,
the message naming the same field; updates of immutable fields are refused and the elastic ones
allowed; every shipped example passes `kubectl apply --dry-run=server --validate=strict`; and
`kubectl explain` documents the algorithms' params. No operator runs: this is the CRD alone."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from admission_cases import CREATE_CASES, ROOT, UPDATE_CASES, base, variant
from harness import Cluster, kubectl_binary
from test_operator_e2e import installed  # noqa: F401  (fixture)

pytestmark = [pytest.mark.cluster, pytest.mark.usefixtures("installed")]

EXAMPLES = sorted((ROOT / "manifests" / "examples").glob("*.yaml"))


def _kubectl(
    cluster: Cluster, namespace: str, *args: str, doc: Any = None
) -> subprocess.CompletedProcess[str]:
    cmd = [kubectl_binary(), f"--kubeconfig={cluster.kubeconfig}", "-n", namespace, *args]
    text = doc if isinstance(doc, str) or doc is None else yaml.safe_dump(doc)
    return subprocess.run(cmd, input=text, capture_output=True, text=True)


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_every_example_passes_a_strict_server_dry_run(cluster: Cluster, namespace: str, path: Path) -> None:
    res = _kubectl(cluster, namespace, "apply", "--dry-run=server", "--validate=strict", "-f", str(path))
    assert res.returncode == 0, f"{path.name}: {res.stderr}"


@pytest.mark.parametrize("case,kind,change,field", CREATE_CASES, ids=[c[0] for c in CREATE_CASES])
def test_the_server_refuses_each_invalid_manifest_naming_the_field(
    cluster: Cluster, namespace: str, case: str, kind: str, change: Any, field: str
) -> None:
    res = _kubectl(
        cluster, namespace, "create", "--dry-run=server", "--validate=strict", "-f", "-", doc=variant(change)
    )
    assert res.returncode != 0, f"{case}: accepted by the API server"
    assert field in res.stderr, f"{case}: the message does not name {field}: {res.stderr}"


@pytest.mark.parametrize("case,change,field", UPDATE_CASES, ids=[c[0] for c in UPDATE_CASES])
def test_updates_immutable_refused_elastic_allowed(
    cluster: Cluster, namespace: str, case: str, change: Any, field: str | None
) -> None:
    created = _kubectl(cluster, namespace, "create", "-f", "-", doc=base())
    assert created.returncode == 0, created.stderr
    res = _kubectl(
        cluster, namespace, "replace", "--dry-run=server", "--validate=strict", "-f", "-", doc=variant(change)
    )
    if field is None:
        assert res.returncode == 0, f"{case}: refused: {res.stderr}"
    else:
        assert res.returncode != 0, f"{case}: accepted by the API server"
        assert field in res.stderr, f"{case}: the message does not name {field}: {res.stderr}"


def test_kubectl_explain_shows_the_algorithm_params(cluster: Cluster) -> None:
    out = cluster.kubectl("explain", "rltj.spec.algorithm.params")
    for key in ("klCoef", "clipRatioLow", "advantageEstimator", "labelSmoothing", "betaMax"):
        assert key in out, out
    one = cluster.kubectl("explain", "rltj.spec.algorithm.params.klCoef")
    assert "Initial coefficient beta of the KL" in one and "Taken by" in one and "Valid: >= 0" in one, one


def test_the_crd_on_the_server_is_the_generated_one(cluster: Cluster) -> None:
    """The rules exercised above are the ones `rlhf validate` evaluates (one source)."""
    from rlhf_operator.crd import build_crd

    def rules(node: Any) -> list[str]:
        if isinstance(node, dict):
            own = [r["rule"] for r in node.get("x-kubernetes-validations", [])]
            return own + [r for v in node.values() for r in rules(v)]
        if isinstance(node, list):
            return [r for v in node for r in rules(v)]
        return []

    served = yaml.safe_load(cluster.kubectl("get", "crd", "rltrainingjobs.rlhf.dev", "-o", "yaml"))
    assert sorted(rules(served["spec"]["versions"])) == sorted(rules(build_crd()["spec"]["versions"]))


def test_the_servers_messages_say_what_is_valid(cluster: Cluster, namespace: str) -> None:
    """(One mistake per object: the server skips the CEL rules of an object with schema errors.)"""
    cases = [
        (
            ("roles", "actor", "resources", "memory"),
            "lots",
            'spec.roles.actor.resources.memory: Invalid value: "lots": "lots" is not valid; valid: a '
            "Kubernetes quantity such as 8Gi",
        ),
        (
            ("algorithm", "params", "gamma"),
            0.9,
            "spec.algorithm.params.gamma: Invalid value: params.gamma is not a parameter of grpo; "
            "valid: advantageEstimator",
        ),
        (
            ("rollout", "engine"),
            "tgi",
            'spec.rollout.engine: Unsupported value: "tgi": supported values: "hf", "vllm"',
        ),
        # A cross-field rule names the field (`fieldPath`), the bounds it is held to and the value
        # (integers written by `spec.cel_int`: the server refuses messages built with string(int)).
        (
            ("roles", "rollout", "replicas"),
            9,
            "spec.roles.rollout.replicas: Invalid value: rollout.replicas must lie in [minReplicas, maxReplicas] "
            "= [1, 4]; got 9",
        ),
        (
            ("training", "miniBatchSize"),
            100,
            "spec.training.miniBatchSize must divide promptsPerStep × samplesPerPrompt = 512 responses "
            "(0: the whole batch); got 100",
        ),
        # Checks once only in the Python loader, now rules of the CRD, naming the key.
        (
            ("pod", "labels"),
            {"rlhf.dev/role": "x"},
            'label key "rlhf.dev/role" is set by the operator',
        ),
        (
            ("roles", "actor", "resources", "devices"),
            {"nvidia.com/gpu": 8},
            "nvidia.com/gpu is set by gpus",
        ),
    ]
    for keys, value, expected in cases:
        doc = base()
        obj = doc["spec"]
        for key in keys[:-1]:
            obj = obj.setdefault(key, {})
        obj[keys[-1]] = value
        res = _kubectl(
            cluster, namespace, "create", "--dry-run=server", "--validate=strict", "-f", "-", doc=doc
        )
        assert res.returncode != 0 and expected in res.stderr, res.stderr
