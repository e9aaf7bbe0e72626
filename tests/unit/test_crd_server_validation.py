"""The generated CRD as the API server validates it when it is created: structural schema, CEL
rules and message expressions compiled, their estimated cost held to the per-rule and whole-schema
budgets. No cluster: tests/cluster/build-crdcheck builds the server's own validation code
(k8s.io/apiextensions-apiserver, at the test cluster's version) into a small command.

Without it a rule or message the server cannot afford shows only when the cluster tests install
the CRD, and then every cluster test fails at once."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from rlhf_api import admission
from rlhf_operator import crd

ROOT = Path(__file__).resolve().parents[2]
KUBE_VERSION = "v1.36.3"  # tests/cluster/build's
PER_RULE = "estimated messageExpression cost exceeds budget"


def _crdcheck() -> str:
    cache = Path(os.environ.get("RLHF_CACHE_DIR") or Path.home() / ".cache" / "rlhf-operator")
    path = os.environ.get("RLHF_CRDCHECK") or str(cache / "bin" / KUBE_VERSION / "crdcheck")
    if not os.access(path, os.X_OK):
        pytest.skip(
            f"crdcheck is not built ({path}): run tests/cluster/build, then tests/cluster/build-crdcheck"
        )
    return path


def _run(*paths: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([_crdcheck(), *map(str, paths)], capture_output=True, text=True, timeout=120)


def test_the_generated_crd_passes_the_api_servers_validation() -> None:
    res = _run(*crd.CRD_FILES)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stdout + res.stderr


def _message_paths(node: Any, path: str, out: set[str]) -> None:
    """Paths, in the API server's notation, of every rule with a messageExpression."""
    if isinstance(node, dict):
        for i, rule in enumerate(node.get("x-kubernetes-validations", [])):
            if "messageExpression" in rule:
                out.add(f"{path}.x-kubernetes-validations[{i}].messageExpression")
        for key, value in (node.get("properties") or {}).items():
            _message_paths(value, f"{path}.properties[{key}]", out)
        for key in ("items", "additionalProperties"):
            if isinstance(node.get(key), dict):
                _message_paths(node[key], f"{path}.{key}", out)


def test_the_messages_dropped_for_the_server_are_exactly_those_it_cannot_afford(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`admission.server_messages` drops a rule's messageExpression from the CRD when the server
    would refuse it: not one more (the server would show less than it could), not one fewer."""
    served = crd.build_crd()
    monkeypatch.setattr(admission, "server_messages", lambda schema: schema)
    full = crd.build_crd()
    root = "spec.validation.openAPIV3Schema"
    kept: set[str] = set()
    wanted: set[str] = set()
    _message_paths(served["spec"]["versions"][0]["schema"]["openAPIV3Schema"], root, kept)
    _message_paths(full["spec"]["versions"][0]["schema"]["openAPIV3Schema"], root, wanted)
    dropped = wanted - kept
    path = tmp_path / "full.yaml"
    path.write_text(yaml.safe_dump(full))
    res = _run(path)
    refused = {
        m.group(1) for m in re.finditer(rf"^\S+: (\S+): Forbidden: {PER_RULE}", res.stdout, re.MULTILINE)
    }
    assert refused, "no message expression refused: the check found nothing to hold server_messages to"
    assert refused == dropped, (sorted(refused - dropped), sorted(dropped - refused))
