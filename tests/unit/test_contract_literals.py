"""The pod contract is adopted on both sides: no string literal in the operator or the trainer
repeats a name the contract owns.

Two scans of every source file of `rlhf_operator` and `rlhf_trainer` (docstrings aside):

* a literal equal to one of the contract's distinctive values (paths, URLs, label and annotation
  keys, camelCase status keys: anything with '/', '.', ':' or a camel hump) is refused anywhere;
* in the modules that read or write a job's status, a literal equal to a status key
  (`STATUS_*`, `PROGRESS_*`, `ROLLOUT_*`) used as a key of a status object (a subscript or
  `.get()` of something named status, progress or rollout) is refused too. (Elsewhere "step" or
  "reward" are the trainer's own metric names, and "rollout" a role.)
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from rlhf_api import contract

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = (ROOT / "operator" / "rlhf_operator", ROOT / "trainer" / "rlhf_trainer")
#: Where a job's status is read or written, by the operator and by the controller pod.
STATUS_MODULES = (
    "operator/rlhf_operator/status.py",
    "operator/rlhf_operator/reconcile.py",
    "operator/rlhf_operator/pass_state.py",
    "operator/rlhf_operator/child_failures.py",
    "operator/rlhf_operator/executor.py",
    "operator/rlhf_operator/autoscaler.py",
    "trainer/rlhf_trainer/run_cli.py",
    "trainer/rlhf_trainer/fleet/cluster_membership.py",
)


def _constants() -> dict[str, str]:
    return {k: v for k, v in vars(contract).items() if k.isupper() and isinstance(v, str)}


def distinctive() -> dict[str, str]:
    return {v: k for k, v in _constants().items() if len(v) >= 4 and re.search(r"[/.:]|[a-z][A-Z]", v)}


def status_keys() -> dict[str, str]:
    return {v: k for k, v in _constants().items() if re.match(r"(STATUS|PROGRESS|ROLLOUT)_", k)}


def _docstrings(tree: ast.AST) -> set[int]:
    kinds = (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
    return {
        id(n.body[0].value)
        for n in ast.walk(tree)
        if isinstance(n, kinds) and n.body and isinstance(n.body[0], ast.Expr)
    }


STATUS_OBJECT = re.compile(r"status|progress|rollout", re.I)


def _keys_used(node: ast.AST) -> list[ast.AST]:
    """The keys `node` reads of a status object: `status["rollout"]`, `progress.get("step")`."""
    if isinstance(node, ast.Subscript) and STATUS_OBJECT.search(ast.unparse(node.value)):
        return [node.slice]
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.args
        and node.func.attr in ("get", "pop", "setdefault")
        and STATUS_OBJECT.search(ast.unparse(node.func.value))
    ):
        return [node.args[0]]
    return []


def literal_repeats() -> list[str]:
    names, keys = distinctive(), status_keys()
    found = []
    for package in PACKAGES:
        for path in sorted(package.rglob("*.py")):
            where = str(path.relative_to(ROOT))
            tree = ast.parse(path.read_text())
            docs = _docstrings(tree)
            for node in ast.walk(tree):
                if isinstance(node, ast.Constant) and node.value in names and id(node) not in docs:
                    found.append(f"{where}:{node.lineno}: {node.value!r} is contract.{names[node.value]}")
                if where in STATUS_MODULES:
                    for key in _keys_used(node):
                        if isinstance(key, ast.Constant) and key.value in keys:
                            found.append(f"{where}:{key.lineno}: {key.value!r} is contract.{keys[key.value]}")
    return found


def test_the_scan_knows_the_shared_names() -> None:
    assert {"/metrics", "/healthz", "/dev/shm", "syncedGeneration", "totalSteps"} <= set(distinctive())
    assert {"desired", "generation", "progress", "step"} <= set(status_keys())
    assert all((ROOT / m).is_file() for m in STATUS_MODULES)


def test_no_literal_repeats_a_contract_name() -> None:
    found = literal_repeats()
    assert not found, "use the contract's constant instead:\n" + "\n".join(found)
