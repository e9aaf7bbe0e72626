"""What the spec adds to pods (`pod_template`): volumes, working directory, env, metadata, pull
settings, ephemeral storage and devices. Table-driven, through `children.build_pod`, no cluster."""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import pytest
from operator_helpers import BASE_SPEC, NO_VOLUMES_SPEC, job

from rlhf_api import contract
from rlhf_api.contract import GROUP
from rlhf_api.loader import parse_job
from rlhf_api.pods import OPERATOR_METADATA_KEYS, OPERATOR_VOLUMES, EnvVarSpec
from rlhf_api.storage import pod_mounts
from rlhf_operator import children, pod_template

OPERATOR_VOLUMES_OF_A_POD = [
    {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "1Gi"}},
    {"name": "tmp", "emptyDir": {}},
    {"name": "spec", "configMap": {"name": "j-spec"}},
]
OPERATOR_MOUNTS = [
    {"name": "dshm", "mountPath": "/dev/shm"},
    {"name": "tmp", "mountPath": "/tmp"},
    {"name": "spec", "mountPath": "/etc/rlhf", "readOnly": True},
]
WORKSPACE_VOLUME = {"name": "workspace", "emptyDir": {}}
WORKSPACE_MOUNT = {"name": "workspace", "mountPath": "/workspace"}
FILESYSTEM_ENV = {
    "HOME": "/tmp/home",
    "XDG_CACHE_HOME": "/tmp/home/.cache",
    "XDG_CONFIG_HOME": "/tmp/home/.config",
    "HF_HOME": "/tmp/home/.cache/huggingface",
    "MPLCONFIGDIR": "/tmp/home/.config/matplotlib",
    "TRITON_CACHE_DIR": "/tmp/home/.triton/cache",
    "TORCHINDUCTOR_CACHE_DIR": "/tmp/home/.cache/torchinductor",
    "PYTHONPYCACHEPREFIX": "/tmp/pycache",
}
WORK_PVC = {"name": "work", "mountPath": "/workspace", "persistentVolumeClaim": {"claimName": "rlhf-work"}}


def _build(spec_updates: dict[str, Any], role: str, index: int = 0) -> dict[str, Any]:
    return children.build_pod(parse_job(job(spec=NO_VOLUMES_SPEC, **spec_updates)), role, index)


def _roles(**per_role: dict[str, Any]) -> dict[str, Any]:
    """BASE_SPEC's roles with `per_role` merged into the named roles."""
    roles = copy.deepcopy(BASE_SPEC["roles"])
    for role, extra in per_role.items():
        roles[role] = {**roles.get(role, {}), **extra}
    return roles


def _env(pod: dict[str, Any]) -> list[dict[str, Any]]:
    return pod["spec"]["containers"][0]["env"]  # type: ignore[no-any-return]


# --------------------------------------------------------------------------------------------
# Storage
# --------------------------------------------------------------------------------------------

# (case, spec updates, role, expected volumes, expected mounts)
STORAGE = [
    (
        "no volumes: a per-pod emptyDir at the working directory",
        {},
        "actor",
        [*OPERATOR_VOLUMES_OF_A_POD, WORKSPACE_VOLUME],
        [*OPERATOR_MOUNTS, WORKSPACE_MOUNT],
    ),
    (
        "a PVC mounted at /workspace replaces the default workspace, in every pod",
        {"pod": {"volumes": [WORK_PVC]}},
        "controller",
        [*OPERATOR_VOLUMES_OF_A_POD, {"name": "work", "persistentVolumeClaim": {"claimName": "rlhf-work"}}],
        [*OPERATOR_MOUNTS, {"name": "work", "mountPath": "/workspace"}],
    ),
    (
        "a volume at exactly /tmp replaces the operator's tmp emptyDir",
        {"pod": {"volumes": [{"name": "scratch", "mountPath": "/tmp", "emptyDir": {"sizeLimit": "50Gi"}}]}},
        "rollout",
        [
            OPERATOR_VOLUMES_OF_A_POD[0],
            OPERATOR_VOLUMES_OF_A_POD[2],
            WORKSPACE_VOLUME,
            {"name": "scratch", "emptyDir": {"sizeLimit": "50Gi"}},
        ],
        [OPERATOR_MOUNTS[0], OPERATOR_MOUNTS[2], WORKSPACE_MOUNT, {"name": "scratch", "mountPath": "/tmp"}],
    ),
    (
        "every source, read-only flags, subPath and projected items",
        {
            "pod": {
                "volumes": [
                    {
                        "name": "models",
                        "mountPath": "/models",
                        "readOnly": True,
                        "subPath": "qwen",
                        "persistentVolumeClaim": {"claimName": "models", "readOnly": True},
                    },
                    {
                        "name": "node",
                        "mountPath": "/mnt/nvme",
                        "hostPath": {"path": "/mnt/nvme", "type": "Directory"},
                    },
                    {"name": "fast", "mountPath": "/cache", "emptyDir": {"medium": "Memory"}},
                    {
                        "name": "prompts",
                        "mountPath": "/data",
                        "configMap": {
                            "name": "prompts",
                            "items": [{"key": "train", "path": "train.jsonl", "mode": 292}],
                            "defaultMode": 292,
                        },
                    },
                    {
                        "name": "creds",
                        "mountPath": "/creds",
                        "secret": {"secretName": "hub", "optional": True},
                    },
                ]
            }
        },
        "reference",
        [
            *OPERATOR_VOLUMES_OF_A_POD,
            WORKSPACE_VOLUME,
            {"name": "models", "persistentVolumeClaim": {"claimName": "models", "readOnly": True}},
            {"name": "node", "hostPath": {"path": "/mnt/nvme", "type": "Directory"}},
            {"name": "fast", "emptyDir": {"medium": "Memory"}},
            {
                "name": "prompts",
                "configMap": {
                    "name": "prompts",
                    "items": [{"key": "train", "path": "train.jsonl", "mode": 292}],
                    "defaultMode": 292,
                },
            },
            {"name": "creds", "secret": {"secretName": "hub", "optional": True}},
        ],
        [
            *OPERATOR_MOUNTS,
            WORKSPACE_MOUNT,
            {"name": "models", "mountPath": "/models", "subPath": "qwen", "readOnly": True},
            {"name": "node", "mountPath": "/mnt/nvme"},
            {"name": "fast", "mountPath": "/cache"},
            {"name": "prompts", "mountPath": "/data"},
            {"name": "creds", "mountPath": "/creds"},
        ],
    ),
    (
        "a role's volumes come after spec.pod's, in that role's pods",
        {
            "pod": {"volumes": [WORK_PVC]},
            "roles": _roles(
                rollout={"pod": {"volumes": [{"name": "vllm", "mountPath": "/cache/vllm", "emptyDir": {}}]}}
            ),
        },
        "rollout",
        [
            *OPERATOR_VOLUMES_OF_A_POD,
            {"name": "work", "persistentVolumeClaim": {"claimName": "rlhf-work"}},
            {"name": "vllm", "emptyDir": {}},
        ],
        [
            *OPERATOR_MOUNTS,
            {"name": "work", "mountPath": "/workspace"},
            {"name": "vllm", "mountPath": "/cache/vllm"},
        ],
    ),
    (
        "... and not in another role's",
        {
            "roles": _roles(
                rollout={"pod": {"volumes": [{"name": "vllm", "mountPath": "/cache/vllm", "emptyDir": {}}]}}
            )
        },
        "actor",
        [*OPERATOR_VOLUMES_OF_A_POD, WORKSPACE_VOLUME],
        [*OPERATOR_MOUNTS, WORKSPACE_MOUNT],
    ),
    (
        "the controller pod gets spec.controller.pod's volumes",
        {"controller": {"pod": {"volumes": [{"name": "reports", "mountPath": "/reports", "emptyDir": {}}]}}},
        "controller",
        [*OPERATOR_VOLUMES_OF_A_POD, WORKSPACE_VOLUME, {"name": "reports", "emptyDir": {}}],
        [*OPERATOR_MOUNTS, WORKSPACE_MOUNT, {"name": "reports", "mountPath": "/reports"}],
    ),
]


@pytest.mark.parametrize("case,updates,role,volumes,mounts", STORAGE, ids=[c[0] for c in STORAGE])
def test_storage(case: str, updates: dict[str, Any], role: str, volumes: Any, mounts: Any) -> None:
    pod = _build(updates, role)
    container = pod["spec"]["containers"][0]
    assert pod["spec"]["volumes"] == volumes
    assert container["volumeMounts"] == mounts
    assert container["workingDir"] == "/workspace"


@pytest.mark.parametrize("case,updates,role,volumes,mounts", STORAGE, ids=[c[0] for c in STORAGE])
def test_the_validators_view_of_a_pods_filesystem_is_the_pod_built(
    case: str, updates: dict[str, Any], role: str, volumes: Any, mounts: Any
) -> None:
    """`spec.pod_mounts` (what `rlhf validate --cluster` checks) lists exactly the pod's mounts."""
    j = parse_job(job(spec=NO_VOLUMES_SPEC, **updates))
    built = children.build_pod(j, role)
    seen = {(m["name"], m["mountPath"]) for m in built["spec"]["containers"][0]["volumeMounts"]}
    assert {(m.volume, m.path) for m in pod_mounts(j.spec, role)} == seen


def test_operator_volume_names_are_the_ones_the_spec_refuses() -> None:
    pod = _build({}, "actor")
    assert {v["name"] for v in pod["spec"]["volumes"]} == set(OPERATOR_VOLUMES)


# --------------------------------------------------------------------------------------------
# Environment
# --------------------------------------------------------------------------------------------


def test_every_pod_gets_home_and_caches_on_tmp_after_the_contract_variables() -> None:
    for role in ("controller", "actor", "rollout", "reference"):
        env = _env(_build({}, role))
        names = [e["name"] for e in env]
        assert sorted(names) == sorted(contract.operator_env_names(role)), role
        assert {e["name"]: e["value"] for e in env[-len(FILESYSTEM_ENV) :]} == FILESYSTEM_ENV
        assert all(v.startswith(contract.POD_TMP_DIR + "/") for v in FILESYSTEM_ENV.values())


SECRET_REF = {
    "name": "HF_TOKEN",
    "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token", "optional": True}},
}
# (case, spec updates, role, expected spec env entries in order, expected values by name)
ENV = [
    (
        "value and every kind of valueFrom, in order, after the defaults",
        {
            "pod": {
                "env": [
                    {"name": "A", "value": "1"},
                    SECRET_REF,
                    {"name": "CM", "valueFrom": {"configMapKeyRef": {"name": "cfg", "key": "k"}}},
                    {"name": "NODE", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
                    {
                        "name": "MEM",
                        "valueFrom": {"resourceFieldRef": {"resource": "limits.memory", "divisor": "1Mi"}},
                    },
                ]
            }
        },
        "actor",
        [
            {"name": "A", "value": "1"},
            SECRET_REF,
            {"name": "CM", "valueFrom": {"configMapKeyRef": {"name": "cfg", "key": "k"}}},
            {"name": "NODE", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
            {
                "name": "MEM",
                "valueFrom": {"resourceFieldRef": {"resource": "limits.memory", "divisor": "1Mi"}},
            },
        ],
        {},
    ),
    (
        "an operator default (HF_HOME, NCCL_DEBUG) is replaced, not duplicated",
        {
            "pod": {
                "env": [{"name": "HF_HOME", "value": "/models/hf"}, {"name": "NCCL_DEBUG", "value": "INFO"}]
            }
        },
        "rollout",
        [{"name": "HF_HOME", "value": "/models/hf"}, {"name": "NCCL_DEBUG", "value": "INFO"}],
        {"HF_HOME": "/models/hf", "NCCL_DEBUG": "INFO", "HOME": "/tmp/home"},
    ),
    (
        "a role's entry replaces spec.pod's of the same name, in that role only",
        {
            "pod": {"env": [{"name": "NCCL_IB_HCA", "value": "mlx5"}, {"name": "B", "value": "all"}]},
            "roles": _roles(actor={"pod": {"env": [{"name": "NCCL_IB_HCA", "value": "mlx5_0,mlx5_1"}]}}),
        },
        "actor",
        [{"name": "B", "value": "all"}, {"name": "NCCL_IB_HCA", "value": "mlx5_0,mlx5_1"}],
        {"NCCL_IB_HCA": "mlx5_0,mlx5_1"},
    ),
    (
        "... other roles keep spec.pod's",
        {
            "pod": {"env": [{"name": "NCCL_IB_HCA", "value": "mlx5"}]},
            "roles": _roles(actor={"pod": {"env": [{"name": "NCCL_IB_HCA", "value": "mlx5_0"}]}}),
        },
        "reference",
        [{"name": "NCCL_IB_HCA", "value": "mlx5"}],
        {},
    ),
    (
        "the controller pod: spec.pod's, then spec.controller.pod's",
        {
            "pod": {"env": [{"name": "A", "value": "1"}]},
            "controller": {"pod": {"env": [{"name": "C", "value": "2"}]}},
        },
        "controller",
        [{"name": "A", "value": "1"}, {"name": "C", "value": "2"}],
        {},
    ),
]


@pytest.mark.parametrize("case,updates,role,user,values", ENV, ids=[c[0] for c in ENV])
def test_environment(
    case: str, updates: dict[str, Any], role: str, user: Any, values: dict[str, str]
) -> None:
    pod = _build(updates, role)
    env = _env(pod)
    names = [e["name"] for e in env]
    assert len(names) == len(set(names)), names
    assert env[-len(user) :] == user
    by_name = {e["name"]: e.get("value") for e in env}
    for name, value in values.items():
        assert by_name[name] == value, name


def test_a_contract_variable_is_never_overridden_even_by_an_unvalidated_spec() -> None:
    j = parse_job(job())
    sneaky = EnvVarSpec(name=contract.ENV_ROLE.name, value="controller")
    pod_settings = dataclasses.replace(j.spec.pod, env=[sneaky])
    spec = dataclasses.replace(j.spec, pod=pod_settings)
    env = pod_template.environment(spec, "actor", [contract.ENV_ROLE.value("actor")])
    assert [e for e in env if e["name"] == contract.ENV_ROLE.name] == [
        {"name": "RLHF_ROLE", "value": "actor"}
    ]


# --------------------------------------------------------------------------------------------
# Metadata, image, resources
# --------------------------------------------------------------------------------------------

# (case, spec updates, role, expected differences from the default pod: path -> value)
VARIANTS = [
    (
        "labels and annotations: spec.pod's, then the role's, beneath the operator's",
        {
            "pod": {"labels": {"team": "rl", "tier": "a"}, "annotations": {"example.com/owner": "me"}},
            "roles": _roles(actor={"pod": {"labels": {"tier": "b"}}}),
            "scheduling": {"timeoutSeconds": 60, "podGroup": "volcano"},
        },
        "actor",
        {
            ("metadata", "labels", "team"): "rl",
            ("metadata", "labels", "tier"): "b",
            ("metadata", "labels", "rlhf.dev/role"): "actor",
            ("metadata", "annotations"): {"example.com/owner": "me", "scheduling.k8s.io/group-name": "j"},
        },
    ),
    (
        "no annotations at all: no annotations key",
        {"pod": {"labels": {"team": "rl"}}},
        "rollout",
        {("metadata", "annotations"): None, ("metadata", "labels", "team"): "rl"},
    ),
    (
        "imagePullPolicy and imagePullSecrets",
        {"imagePullPolicy": "Always", "imagePullSecrets": [{"name": "regcred"}, {"name": "mirror"}]},
        "reference",
        {
            ("spec", "containers", 0, "imagePullPolicy"): "Always",
            ("spec", "imagePullSecrets"): [{"name": "regcred"}, {"name": "mirror"}],
        },
    ),
    (
        "unset pull settings are left to Kubernetes",
        {},
        "actor",
        {("spec", "containers", 0, "imagePullPolicy"): None, ("spec", "imagePullSecrets"): None},
    ),
    (
        "ephemeral storage (a request) and devices (requests = limits) per role",
        {
            "roles": _roles(
                actor={
                    "resources": {
                        "gpus": 8,
                        "cpu": "16",
                        "memory": "64Gi",
                        "ephemeralStorage": "100Gi",
                        "devices": {"rdma/hca": 1, "vpc.amazonaws.com/efa": 4},
                    }
                }
            )
        },
        "actor",
        {
            ("spec", "containers", 0, "resources"): {
                "requests": {
                    "cpu": "16",
                    "memory": "64Gi",
                    "nvidia.com/gpu": "8",
                    "ephemeral-storage": "100Gi",
                    "rdma/hca": "1",
                    "vpc.amazonaws.com/efa": "4",
                },
                "limits": {
                    "memory": "64Gi",
                    "nvidia.com/gpu": "8",
                    "rdma/hca": "1",
                    "vpc.amazonaws.com/efa": "4",
                },
            }
        },
    ),
    (
        "the controller pod: default resources, no pool (as before these settings existed)",
        {},
        "controller",
        {
            ("spec", "containers", 0, "resources"): {
                "requests": {"cpu": "1", "memory": "2Gi"},
                "limits": {"memory": "2Gi"},
            },
            ("spec", "nodeSelector"): None,
            ("spec", "volumes", 0): {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "1Gi"}},
        },
    ),
    (
        "the controller pod: its resources, shm, ephemeral storage and node pool",
        {
            "controller": {
                "nodePool": "l4",
                "resources": {"cpu": "4", "memory": "16Gi", "shm": "4Gi", "ephemeralStorage": "20Gi"},
            }
        },
        "controller",
        {
            ("spec", "containers", 0, "resources"): {
                "requests": {"cpu": "4", "memory": "16Gi", "ephemeral-storage": "20Gi"},
                "limits": {"memory": "16Gi"},
            },
            ("spec", "nodeSelector"): {"rlhf.dev/pool": "l4"},
            ("spec", "volumes", 0): {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "4Gi"}},
        },
    ),
]


def _get(obj: Any, path: tuple[Any, ...]) -> Any:
    for key in path:
        obj = obj.get(key) if isinstance(obj, dict) else obj[key]
        if obj is None:
            return None
    return obj


@pytest.mark.parametrize("case,updates,role,expected", VARIANTS, ids=[c[0] for c in VARIANTS])
def test_pod_variants(case: str, updates: dict[str, Any], role: str, expected: dict[Any, Any]) -> None:
    pod = _build(updates, role)
    for path, value in expected.items():
        assert _get(pod, path) == value, path


def test_the_spec_refuses_every_label_and_annotation_key_the_operator_sets() -> None:
    """So a spec's labels never collide with the operator's (drift guard for OPERATOR_METADATA_KEYS)."""
    spec = {
        **BASE_SPEC,
        "scheduling": {"timeoutSeconds": 60, "queueName": "q", "podGroup": "scheduler-plugins"},
    }
    keys: set[str] = set()
    for kind in ("scheduler-plugins", "volcano"):
        spec["scheduling"]["podGroup"] = kind
        for pod in children.build_pods(parse_job(job(spec=spec))).values():
            keys |= set(pod["metadata"]["labels"]) | set(pod["metadata"].get("annotations", {}))
    assert {k for k in keys if not k.startswith(GROUP + "/")} <= set(OPERATOR_METADATA_KEYS)


def test_the_controller_pods_default_size_is_the_one_it_always_had() -> None:
    from rlhf_api.roles import ControllerResourcesSpec

    default = ControllerResourcesSpec()
    assert {"cpu": default.cpu, "memory": default.memory} == children.CONTROLLER_RESOURCES
