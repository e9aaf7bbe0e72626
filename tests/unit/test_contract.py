"""The pod contract's round trip (`rlhf_api.contract`): what the operator puts in a pod is what
the trainer reads, and the other way round.

* The operator's side: pods of representative jobs (colocated, disaggregated; the controller and
  every role) set exactly the variables the contract says the operator sets in such a pod.
* The trainer's side: a scan of `rlhf_trainer` for reads through the contract's accessors
  (`contract.ENV_X.get()`, `.get_int()`, ...). Every variable declared as read by the trainer is
  read somewhere; every variable read is set by the operator, or is a knob with a default, or
  comes from Kubernetes; the trainer never reads the environment around the contract; no module
  spells a contract variable's name out instead of naming the constant.

Adding a variable on one side only fails one of these tests.
"""

from __future__ import annotations

import ast
import copy
import re
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

import rlhf_operator
import rlhf_trainer
from rlhf_api import contract
from rlhf_api.fields import camel
from rlhf_api.loader import parse_job
from rlhf_operator import children

TRAINER_DIR = Path(rlhf_trainer.__file__).resolve().parent
OPERATOR_DIR = Path(rlhf_operator.__file__).resolve().parent
CONTRACT_FILE = Path(contract.__file__).resolve()
READ_METHODS = {"get", "get_str", "get_int", "get_float", "is_set"}
#: Reads that tolerate an unset variable (the others raise when it is unset without a default).
LENIENT_READS = {"get", "is_set"}
ENV_CONSTANTS = {name: v for name, v in vars(contract).items() if isinstance(v, contract.EnvVar)}

BASE: dict[str, Any] = {
    "apiVersion": "rlhf.dev/v1alpha1",
    "kind": "RLTrainingJob",
    "metadata": {"name": "j", "namespace": "ns", "uid": "u"},
    "spec": {
        "model": {"path": "/models/m"},
        "data": {"path": "/data/prompts.jsonl"},
        "reward": {"functions": [{"path": "rewards:exact"}]},
    },
}
#: name -> (algorithm, roles): between them every role, both placements, GPU and CPU pods.
JOBS: dict[str, tuple[str, dict[str, Any]]] = {
    "colocated-ppo": (
        "ppo",
        {
            "placement": "colocated",
            "actor": {"replicas": 2, "resources": {"gpus": 8}},
            "critic": {"replicas": 2, "resources": {"gpus": 8}},
            "reference": {"replicas": 1, "resources": {"gpus": 1}},
            "reward": {"replicas": 1, "resources": {"gpus": 1}},
        },
    ),
    "disaggregated-grpo": (
        "grpo",
        {
            "placement": "disaggregated",
            "actor": {"replicas": 2},
            "critic": {"replicas": 0},
            "reference": {"replicas": 0},
            "reward": {"replicas": 1},
            "rollout": {"replicas": 2, "minReplicas": 1, "maxReplicas": 4},
        },
    ),
}


def _job(name: str) -> Any:
    algorithm, roles = JOBS[name]
    body = copy.deepcopy(BASE)
    body["spec"]["algorithm"] = {"name": algorithm}
    body["spec"]["roles"] = roles
    return parse_job(body)


def _pods() -> list[tuple[str, dict[str, Any]]]:
    out = []
    for name in JOBS:
        for pod_name, pod in children.build_pods(_job(name), attempt=1).items():
            out.append((f"{name}/{pod_name}", pod))
    return out


PODS = _pods()


def _container(pod: dict[str, Any]) -> dict[str, Any]:
    (container,) = pod["spec"]["containers"]
    return container


def _role(pod: dict[str, Any]) -> str:
    return str(pod["metadata"]["labels"][contract.ROLE])


def test_the_jobs_cover_every_role_and_the_controller() -> None:
    assert {_role(pod) for _, pod in PODS} == {contract.CONTROLLER_ROLE, *contract.ROLES}


def test_every_contract_variable_is_declared_once_and_named_after_its_constant() -> None:
    assert list(contract.ENV_VARS) == list(ENV_CONSTANTS.values())
    names = [v.name for v in contract.ENV_VARS]
    assert len(names) == len(set(names))
    for constant, var in ENV_CONSTANTS.items():
        # ENV_POD_IP <-> RLHF_POD_IP, ENV_RAY_ADDRESS <-> RAY_ADDRESS: a reader finds either from the other.
        assert constant == "ENV_" + var.name.removeprefix("RLHF_"), constant
        assert var.doc, f"{var.name} has no documentation"
        assert var.set_by == "operator" or var.pods == "all", (
            f"{var.name}: `pods` only applies to the operator's"
        )
        assert var.field_path is None or var.set_by == "operator", var.name


@pytest.mark.parametrize("where,pod", PODS, ids=[w for w, _ in PODS])
def test_each_pod_sets_exactly_the_variables_the_contract_gives_the_operator(
    where: str, pod: dict[str, Any]
) -> None:
    env = _container(pod)["env"]
    names = [e["name"] for e in env]
    assert len(names) == len(set(names)), f"{where}: a variable is set twice: {names}"
    undeclared = sorted(set(names) - {v.name for v in contract.ENV_VARS})
    assert not undeclared, (
        f"{where} sets {undeclared}, which rlhf_api.contract does not declare: declare each "
        "(who sets it, who reads it) and read it in the trainer through the contract"
    )
    expected = contract.operator_env_names(_role(pod))
    assert sorted(names) == sorted(expected), (
        f"{where}: sets {sorted(names)}, the contract says {sorted(expected)}"
    )


@pytest.mark.parametrize("where,pod", PODS, ids=[w for w, _ in PODS])
def test_pod_variables_carry_the_pods_identity_and_come_from_the_pod(where: str, pod: dict[str, Any]) -> None:
    env = {e["name"]: e for e in _container(pod)["env"]}
    labels = pod["metadata"]["labels"]
    assert env[contract.ENV_ROLE.name]["value"] == labels[contract.ROLE]
    assert env[contract.ENV_REPLICA_INDEX.name]["value"] == labels[contract.REPLICA_INDEX]
    assert env[contract.ENV_RESTART_ATTEMPT.name]["value"] == labels[contract.RESTART_ATTEMPT]
    for var in contract.ENV_VARS:
        if var.field_path is not None:
            assert env[var.name] == var.from_field(), where
    # Rendezvous from the pod's own address (downward API), never loopback.
    assert env[contract.ENV_POD_IP.name]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    assert "127.0.0.1" not in str(pod) and "localhost" not in str(pod)


@pytest.mark.parametrize("where,pod", PODS, ids=[w for w, _ in PODS])
def test_the_command_names_the_contracts_entrypoints_ports_and_paths(where: str, pod: dict[str, Any]) -> None:
    container = _container(pod)
    cmd = container["command"]
    if _role(pod) == contract.CONTROLLER_ROLE:
        assert cmd == ["rlhf", "controller", "--spec-file", contract.SPEC_FILE]
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert ports == {
            contract.RAY_PORT_NAME: contract.RAY_PORT,
            contract.METRICS_PORT_NAME: contract.METRICS_PORT,
        }
        assert container["readinessProbe"]["httpGet"] == {
            "path": contract.HEALTHZ_PATH,
            "port": contract.METRICS_PORT_NAME,
        }
        return
    assert cmd[:2] == ["rlhf", "worker"], where
    assert f"--address={contract.head_address('j', 'ns')}" in cmd
    assert "--address=j-controller.j.ns.svc:6379" in cmd


# --------------------------------------------------------------------------------------------
# The trainer's side: a scan of rlhf_trainer
# --------------------------------------------------------------------------------------------


def _modules(root: Path) -> list[tuple[str, ast.Module]]:
    return [
        (str(p.relative_to(root.parent)), ast.parse(p.read_text(), str(p)))
        for p in sorted(root.rglob("*.py"))
        if p.resolve() != CONTRACT_FILE
    ]


TRAINER_MODULES = _modules(TRAINER_DIR)
OPERATOR_MODULES = _modules(OPERATOR_DIR)


def _trainer_reads() -> dict[str, list[tuple[str, str]]]:
    """Variable name -> [(where, accessor)] for every `ENV_X.<accessor>(...)` call in the trainer
    (through `contract.ENV_X` or an imported `ENV_X`)."""
    reads: dict[str, list[tuple[str, str]]] = defaultdict(list)
    for rel, tree in TRAINER_MODULES:
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            if node.func.attr not in READ_METHODS:
                continue
            target = node.func.value
            name = (
                target.attr
                if isinstance(target, ast.Attribute)
                else target.id
                if isinstance(target, ast.Name)
                else None
            )
            if name in ENV_CONSTANTS:
                reads[ENV_CONSTANTS[name].name].append((f"{rel}:{node.lineno}", node.func.attr))
    return reads


READS = _trainer_reads()


@pytest.mark.parametrize(
    "var", [v for v in contract.ENV_VARS if v.read_by == contract.TRAINER], ids=lambda v: v.name
)
def test_every_variable_meant_for_the_trainer_is_read_by_it(var: contract.EnvVar) -> None:
    assert READS.get(var.name), (
        f"{var.name} is declared as read by the trainer, but no module of rlhf_trainer reads it "
        f"(contract.{_constant(var)}.get()): read it, or stop setting it and remove it from the contract"
    )


@pytest.mark.parametrize(
    "var", [v for v in contract.ENV_VARS if v.read_by != contract.TRAINER], ids=lambda v: v.name
)
def test_variables_for_other_programs_are_not_read_by_the_trainer(var: contract.EnvVar) -> None:
    assert not READS.get(var.name), (
        f"{var.name} is declared as read by {var.read_by}, but the trainer reads it at "
        f"{[w for w, _ in READS[var.name]]}: declare read_by=TRAINER"
    )


@pytest.mark.parametrize("name", sorted(READS), ids=str)
def test_every_variable_the_trainer_reads_is_set_or_optional(name: str) -> None:
    var = next(v for v in contract.ENV_VARS if v.name == name)
    strict = [where for where, how in READS[name] if how not in LENIENT_READS]
    if var.set_by == "operator":
        set_in = [where for where, pod in PODS if any(e["name"] == name for e in _container(pod)["env"])]
        assert set_in, (
            f"the trainer reads {name} ({READS[name][0][0]}), but no pod the operator builds sets it"
        )
    elif var.set_by == "user":
        assert var.default is not None or not strict, (
            f"{name} is an optional knob without a default, but {strict} read it as required: give it "
            "a default or read it with .get()"
        )
    else:  # Kubernetes sets it in a pod only: a local run must work without it
        assert not strict, f"{name} is absent outside a pod, but {strict} read it as required"


def _constant(var: contract.EnvVar) -> str:
    return next(k for k, v in ENV_CONSTANTS.items() if v is var)


def _is_os_environ(node: ast.AST) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == "environ" and _is_name(node.value, "os")


def _is_name(node: ast.AST, name: str) -> bool:
    return isinstance(node, ast.Name) and node.id == name


def test_the_trainer_reads_the_environment_only_through_the_contract() -> None:
    """Only writes are allowed around it (`os.environ.setdefault` of a library's own knob)."""
    bad = []
    for rel, tree in TRAINER_MODULES:
        parents = {child: parent for parent in ast.walk(tree) for child in ast.iter_child_nodes(parent)}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module == "os":
                bad += [f"{rel}:{node.lineno} from os import {a.name}" for a in node.names if "env" in a.name]
            if (
                isinstance(node, ast.Attribute)
                and node.attr in ("getenv", "getenvb")
                and _is_name(node.value, "os")
            ):
                bad.append(f"{rel}:{node.lineno} os.{node.attr}")
            if _is_os_environ(node):
                parent = parents.get(node)
                writes = isinstance(parent, ast.Attribute) and parent.attr == "setdefault"
                if not writes:
                    bad.append(f"{rel}:{node.lineno} os.environ")
    assert not bad, f"read the environment through rlhf_api.contract (EnvVar.get*), not: {bad}"


#: Names that look like the pod contract's but belong to the operator process itself.
OPERATOR_PROCESS_ENV = re.compile(r"^RLHF_OPERATOR_[A-Z0-9_]+$")
CONTRACT_LIKE = re.compile(r"^(RLHF|RAY|NCCL|TORCH_NCCL)_[A-Z0-9_]+$")


def test_no_module_spells_out_a_contract_variable() -> None:
    """Both packages name a variable by its constant (`contract.ENV_POD_IP.name`), so the scan
    above sees every use; a literal `"RLHF_..."` is a variable the contract does not know of."""
    declared = {v.name for v in contract.ENV_VARS}
    bad = []
    for rel, tree in TRAINER_MODULES + OPERATOR_MODULES:
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Constant) and isinstance(node.value, str)):
                continue
            text = node.value
            if OPERATOR_PROCESS_ENV.match(text) or text == "RAY_ROLE_RESOURCE_PREFIX":
                continue
            if text in declared or CONTRACT_LIKE.match(text):
                bad.append(f"{rel}:{node.lineno} {text!r}")
    assert not bad, f"use rlhf_api.contract's constants (or declare the variable there) instead of: {bad}"


# --------------------------------------------------------------------------------------------
# Ray workers get a pod's own values from their raylet, never from the driver
# --------------------------------------------------------------------------------------------


def test_the_drivers_runtime_env_carries_no_pod_local_value(monkeypatch: pytest.MonkeyPatch) -> None:
    """A Ray worker inherits its raylet's environment, which `rlhf worker` started in the pod with
    the pod's RLHF_POD_IP and RLHF_ROLE; a runtime_env value would override it on every pod with
    the controller pod's."""
    import ray

    from rlhf_trainer import startup

    for var in contract.ENV_VARS:
        if var.set_by == "operator":
            monkeypatch.setenv(var.name, "controller-pod-value")
    seen: dict[str, Any] = {}
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kwargs: seen.update(kwargs))
    startup.start_ray("j-controller.j.ns.svc:6379")
    passed = set(seen["runtime_env"]["env_vars"])
    pod_local = {v.name for v in contract.ENV_VARS if v.pod_local}
    assert {contract.ENV_POD_IP.name, contract.ENV_ROLE.name} <= pod_local
    assert not passed & pod_local, f"runtime_env carries pod-local {sorted(passed & pod_local)}"


def test_a_rank_offers_rendezvous_on_its_pods_ip(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("torch")
    from rlhf_trainer.workers import distributed

    monkeypatch.setenv(contract.ENV_POD_IP.name, "127.0.0.3")  # a loopback alias stands in for a pod IP
    host, port = distributed.pick_store_address()
    assert (host, port > 0) == ("127.0.0.3", True)
    monkeypatch.delenv(contract.ENV_POD_IP.name)
    assert distributed.rendezvous_host() == "127.0.0.1"  # locally every rank is on this host


# --------------------------------------------------------------------------------------------
# Status keys
# --------------------------------------------------------------------------------------------


def test_status_keys_are_fields_of_the_status_schema() -> None:
    from rlhf_api.status import JobStatus, ProgressStatus, RolloutStatus

    def keys(cls: type) -> set[str]:
        return {camel(f) for f in cls.__dataclass_fields__}

    assert {contract.STATUS_PROGRESS, contract.STATUS_ROLLOUT} <= keys(JobStatus)
    assert {
        contract.PROGRESS_STEP,
        contract.PROGRESS_TOTAL_STEPS,
        contract.PROGRESS_REWARD,
        contract.PROGRESS_CHECKPOINT_STEP,
        contract.PROGRESS_UPDATED,
        contract.PROGRESS_EVAL_REWARD,
        contract.PROGRESS_EVAL_STEP,
    } <= keys(ProgressStatus)
    assert {
        contract.ROLLOUT_GENERATION,
        contract.ROLLOUT_SYNCED_GENERATION,
        contract.ROLLOUT_DESIRED,
    } <= keys(RolloutStatus)


def test_the_controllers_progress_patch_reaches_the_printer_columns() -> None:
    from rlhf_operator.status import summary
    from rlhf_trainer.run_cli import StatusReporter

    patch = StatusReporter(None, "j", "ns").progress(3, 10, {"reward/mean": 0.25, "actor/kl": 0.5})
    assert summary(patch["status"], 10)["step"] == "3/10"
    assert summary(patch["status"], 10)["reward"] == 0.25
    del patch["status"][contract.STATUS_PROGRESS][contract.PROGRESS_REWARD]  # the metrics fallback
    assert summary(patch["status"], 10)["reward"] == 0.25
