"""Builders of the job's children: whole-manifest comparisons, no cluster."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml
from operator_helpers import BASE_SPEC, NO_VOLUMES_SPEC, job

from rlhf_api.fields import to_dict
from rlhf_api.loader import parse_job, parse_spec
from rlhf_operator import children, kueue

ELASTIC = Path(__file__).resolve().parents[3] / "manifests" / "examples" / "elastic.yaml"

OWNER = {
    "apiVersion": "rlhf.dev/v1alpha1",
    "kind": "RLTrainingJob",
    "name": "j",
    "uid": "uid-1",
    "controller": True,
    "blockOwnerDeletion": True,
}
JOB_LABELS = {
    "rlhf.dev/job-name": "j",
    "app.kubernetes.io/managed-by": "rlhf-operator",
    "app.kubernetes.io/part-of": "rlhf-operator",
}


def _job(**spec_updates: Any):
    return parse_job(job(spec=NO_VOLUMES_SPEC, **spec_updates))


def _meta(name: str, **extra_labels: str) -> dict[str, Any]:
    return {
        "name": name,
        "namespace": "ns",
        "labels": {**JOB_LABELS, **extra_labels},
        "ownerReferences": [OWNER],
    }


SECURITY = {
    "runAsNonRoot": True,
    "runAsUser": 1000,
    "runAsGroup": 1000,
    "fsGroup": 1000,
    "seccompProfile": {"type": "RuntimeDefault"},
}
CONTAINER_SECURITY = {
    "allowPrivilegeEscalation": False,
    "readOnlyRootFilesystem": True,
    "capabilities": {"drop": ["ALL"]},
}


def _env(role: str, index: int, attempt: int) -> list[dict[str, Any]]:
    env: list[dict[str, Any]] = [
        {"name": "RLHF_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
        {"name": "RLHF_POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "RLHF_POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": "RLHF_ROLE", "value": role},
        {"name": "RLHF_REPLICA_INDEX", "value": str(index)},
        {"name": "RLHF_RESTART_ATTEMPT", "value": str(attempt)},
        {"name": "RAY_AUTH_MODE", "value": "token"},
        {
            "name": "RAY_AUTH_TOKEN",
            "valueFrom": {"secretKeyRef": {"name": "j-ray-token-uid-1", "key": "token"}},
        },
        {"name": "TORCH_NCCL_ASYNC_ERROR_HANDLING", "value": "1"},
        {"name": "NCCL_DEBUG", "value": "WARN"},
        {"name": "PYTHONUNBUFFERED", "value": "1"},
    ]
    if role == "controller":
        env.append({"name": "RLHF_METRICS_PORT", "value": "8080"})
        env.append({"name": "RLHF_JOB_UID", "value": "uid-1"})
    return env


VOLUMES = [
    {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "1Gi"}},
    {"name": "tmp", "emptyDir": {}},
    {"name": "spec", "configMap": {"name": "j-spec"}},
    {"name": "workspace", "emptyDir": {}},
]
MOUNTS = [
    {"name": "dshm", "mountPath": "/dev/shm"},
    {"name": "tmp", "mountPath": "/tmp"},
    {"name": "spec", "mountPath": "/etc/rlhf", "readOnly": True},
    {"name": "workspace", "mountPath": "/workspace"},
]
#: Every write off the read-only root filesystem: HOME and the caches on the /tmp emptyDir.
FILESYSTEM_ENV = [
    {"name": "HOME", "value": "/tmp/home"},
    {"name": "XDG_CACHE_HOME", "value": "/tmp/home/.cache"},
    {"name": "XDG_CONFIG_HOME", "value": "/tmp/home/.config"},
    {"name": "HF_HOME", "value": "/tmp/home/.cache/huggingface"},
    {"name": "MPLCONFIGDIR", "value": "/tmp/home/.config/matplotlib"},
    {"name": "TRITON_CACHE_DIR", "value": "/tmp/home/.triton/cache"},
    {"name": "TORCHINDUCTOR_CACHE_DIR", "value": "/tmp/home/.cache/torchinductor"},
    {"name": "PYTHONPYCACHEPREFIX", "value": "/tmp/pycache"},
]
GPU_TOLERATION = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
NODE_LOSS = [
    {
        "key": "node.kubernetes.io/not-ready",
        "operator": "Exists",
        "effect": "NoExecute",
        "tolerationSeconds": 60,
    },
    {
        "key": "node.kubernetes.io/unreachable",
        "operator": "Exists",
        "effect": "NoExecute",
        "tolerationSeconds": 60,
    },
]

EXPECTED_ACTOR_1 = {
    "apiVersion": "v1",
    "kind": "Pod",
    "metadata": _meta(
        "j-actor-1",
        **{"rlhf.dev/role": "actor", "rlhf.dev/replica-index": "1", "rlhf.dev/restart-attempt": "3"},
    ),
    "spec": {
        "restartPolicy": "Never",
        "hostname": "j-actor-1",
        "subdomain": "j",
        "serviceAccountName": "j-uid-1",
        "automountServiceAccountToken": False,
        "terminationGracePeriodSeconds": 30,
        "enableServiceLinks": False,
        "securityContext": SECURITY,
        "containers": [
            {
                "name": "trainer",
                "image": "trainer:test",
                "command": [
                    "rlhf",
                    "worker",
                    "--address=j-controller.j.ns.svc:6379",
                    "--num-gpus=8",
                    "--num-cpus=16",
                    '--resources={"rlhf.dev/role-actor": 8}',  # one rank per GPU
                ],
                "env": [*_env("actor", 1, 3), *FILESYSTEM_ENV],
                "resources": {
                    "requests": {"cpu": "16", "memory": "64Gi", "nvidia.com/gpu": "8"},
                    "limits": {"memory": "64Gi", "nvidia.com/gpu": "8"},
                },
                "volumeMounts": MOUNTS,
                "workingDir": "/workspace",
                "securityContext": CONTAINER_SECURITY,
                "terminationMessagePolicy": "FallbackToLogsOnError",
            }
        ],
        "volumes": VOLUMES,
        "nodeSelector": {"rlhf.dev/pool": "h100"},
        "tolerations": [GPU_TOLERATION, *NODE_LOSS],
    },
}

EXPECTED_CONTROLLER = {
    "apiVersion": "v1",
    "kind": "Pod",
    "metadata": _meta(
        "j-controller",
        **{"rlhf.dev/role": "controller", "rlhf.dev/replica-index": "0", "rlhf.dev/restart-attempt": "0"},
    ),
    "spec": {
        "restartPolicy": "Never",
        "hostname": "j-controller",
        "subdomain": "j",
        "serviceAccountName": "j-uid-1",
        "automountServiceAccountToken": True,
        "terminationGracePeriodSeconds": 30,
        "enableServiceLinks": False,
        "securityContext": SECURITY,
        "containers": [
            {
                "name": "trainer",
                "image": "trainer:test",
                "command": ["rlhf", "controller", "--spec-file", "/etc/rlhf/job.yaml"],
                "env": [*_env("controller", 0, 0), *FILESYSTEM_ENV],
                "resources": {"requests": {"cpu": "1", "memory": "2Gi"}, "limits": {"memory": "2Gi"}},
                "ports": [{"name": "ray", "containerPort": 6379}, {"name": "metrics", "containerPort": 8080}],
                "volumeMounts": MOUNTS,
                "workingDir": "/workspace",
                "securityContext": CONTAINER_SECURITY,
                "terminationMessagePolicy": "FallbackToLogsOnError",
                "readinessProbe": {"httpGet": {"path": "/healthz", "port": "metrics"}, "periodSeconds": 10},
            }
        ],
        "volumes": VOLUMES,
        "tolerations": NODE_LOSS,
    },
}


def test_actor_pod_whole_manifest() -> None:
    assert children.build_pod(_job(), "actor", 1, attempt=3) == EXPECTED_ACTOR_1


def test_controller_pod_whole_manifest() -> None:
    assert children.build_pod(_job(), "controller") == EXPECTED_CONTROLLER


# (case, spec updates, role, index, expected differences from the actor pod: path -> value)
POD_VARIANTS = [
    (
        "rollout on an untainted pool gets the GPU toleration added",
        {},
        "rollout",
        0,
        {
            ("spec", "nodeSelector"): {"rlhf.dev/pool": "l4"},
            ("spec", "tolerations"): [GPU_TOLERATION, *NODE_LOSS],
        },
    ),
    (
        "rollout pod i advertises its fleet slot besides its role, and exposes no fixed port",
        {},
        "rollout",
        1,
        {
            ("spec", "containers", 0, "command"): [
                "rlhf",
                "worker",
                "--address=j-controller.j.ns.svc:6379",
                "--num-gpus=1",
                "--num-cpus=1",
                '--resources={"rlhf.dev/role-rollout": 1, "rlhf.dev/rollout-1": 1}',
            ],
            ("spec", "containers", 0, "ports"): None,
            ("spec", "containers", 0, "env", 2): {
                "name": "RLHF_POD_IP",
                "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}},
            },
        },
    ),
    (
        "CPU pod without a pool: no selector, only the node-loss tolerations, no GPU limits",
        {
            "roles": {
                **BASE_SPEC["roles"],
                "reward": {"replicas": 1, "resources": {"cpu": "2", "memory": "8Gi", "shm": "2Gi"}},
            }
        },
        "reward",
        0,
        {
            ("spec", "nodeSelector"): None,
            ("spec", "tolerations"): NODE_LOSS,
            ("spec", "containers", 0, "resources"): {
                "requests": {"cpu": "2", "memory": "8Gi"},
                "limits": {"memory": "8Gi"},
            },
            ("spec", "volumes", 0): {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "2Gi"}},
        },
    ),
    (
        "scheduler, priority and affinity pass through",
        {
            "scheduling": {"schedulerName": "volcano", "priorityClassName": "high"},
            "nodePools": [
                {**BASE_SPEC["nodePools"][0], "affinity": {"nodeAffinity": {"x": 1}}},
                BASE_SPEC["nodePools"][1],
            ],
        },
        "actor",
        0,
        {
            ("spec", "schedulerName"): "volcano",
            ("spec", "priorityClassName"): "high",
            ("spec", "affinity"): {"nodeAffinity": {"x": 1}},
        },
    ),
    (
        # The group of this job's UID and attempt 0; its size is the gang's without the
        # rollout fleet (controller, 2 actors, reference), which follows /scale.
        "Kueue queue: plain pod-group labels and the group's size",
        {"scheduling": {"queueName": "team-a"}},
        "actor",
        0,
        {
            ("metadata", "labels", "kueue.x-k8s.io/queue-name"): "team-a",
            ("metadata", "labels", "kueue.x-k8s.io/pod-group-name"): kueue.group_name("j", "uid-1", 0),
            ("metadata", "annotations"): {"kueue.x-k8s.io/pod-group-total-count": "4"},
        },
    ),
    (
        "Kueue queue: a rollout pod is admitted on its own (no group, no count)",
        {"scheduling": {"queueName": "team-a"}},
        "rollout",
        1,
        {
            ("metadata", "labels", "kueue.x-k8s.io/queue-name"): "team-a",
            ("metadata", "labels", "kueue.x-k8s.io/pod-group-name"): None,
            ("metadata", "annotations"): None,
        },
    ),
    (
        "scheduler-plugins PodGroup label",
        {"scheduling": {"podGroup": "scheduler-plugins"}},
        "actor",
        0,
        {("metadata", "labels", "scheduling.x-k8s.io/pod-group"): "j"},
    ),
    (
        "Volcano PodGroup annotation",
        {"scheduling": {"podGroup": "volcano"}},
        "actor",
        0,
        {("metadata", "annotations"): {"scheduling.k8s.io/group-name": "j"}},
    ),
]


def _get(obj: Any, path: tuple[Any, ...]) -> Any:
    for key in path:
        if isinstance(obj, dict):
            obj = obj.get(key)
        elif isinstance(obj, list):
            obj = obj[key]
        if obj is None:
            return None
    return obj


@pytest.mark.parametrize("case,updates,role,index,expected", POD_VARIANTS, ids=[c[0] for c in POD_VARIANTS])
def test_pod_variants(
    case: str, updates: dict[str, Any], role: str, index: int, expected: dict[Any, Any]
) -> None:
    pod = children.build_pod(_job(**updates), role, index)
    assert pod["metadata"]["name"] == f"j-{role}-{index}"
    assert pod["metadata"]["labels"]["rlhf.dev/role"] == role
    for path, value in expected.items():
        assert _get(pod, path) == value, path


def test_pods_of_a_job_one_per_replica() -> None:
    pods = children.build_pods(_job())
    assert sorted(pods) == [
        "j-actor-0",
        "j-actor-1",
        "j-controller",
        "j-reference-0",
        "j-rollout-0",
        "j-rollout-1",
    ]
    assert sorted(children.build_pods(_job(), rollout_replicas=3)) == sorted([*pods, "j-rollout-2"])


def test_colocated_placement_has_no_rollout_pods() -> None:
    roles = {**BASE_SPEC["roles"], "placement": "colocated"}
    assert "rollout" not in children.role_replicas(parse_spec({**BASE_SPEC, "roles": roles}))


STATIC: list[tuple[Any, dict[str, Any]]] = [
    (
        children.build_service_account,
        {
            "apiVersion": "v1",
            "kind": "ServiceAccount",
            "metadata": _meta("j-uid-1"),
            "automountServiceAccountToken": False,
        },
    ),
    (
        children.build_role,
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "Role",
            "metadata": _meta("j-uid-1"),
            "rules": [
                {
                    "apiGroups": ["rlhf.dev"],
                    "resources": ["rltrainingjobs"],
                    "resourceNames": ["j"],
                    "verbs": ["get", "watch"],
                },
                {
                    "apiGroups": ["rlhf.dev"],
                    "resources": ["rltrainingjobs/status"],
                    "resourceNames": ["j"],
                    "verbs": ["get", "patch"],
                },
            ],
        },
    ),
    (
        children.build_role_binding,
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": _meta("j-uid-1"),
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "j-uid-1"},
            "subjects": [{"kind": "ServiceAccount", "name": "j-uid-1", "namespace": "ns"}],
        },
    ),
    (
        children.build_service,
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": _meta("j"),
            "spec": {
                "clusterIP": "None",
                "publishNotReadyAddresses": True,
                "selector": {"rlhf.dev/job-name": "j"},
                "ports": [
                    {"name": "ray", "port": 6379, "targetPort": 6379},
                    {"name": "metrics", "port": 8080, "targetPort": 8080},
                ],
            },
        },
    ),
    (
        lambda j: children.build_secret(j, "tok"),
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": _meta("j-ray-token-uid-1"),
            "type": "Opaque",
            "stringData": {"token": "tok"},
        },
    ),
]


@pytest.mark.parametrize("builder,expected", STATIC, ids=[e["kind"] for _, e in STATIC])
def test_static_children_whole_manifest(builder: Any, expected: dict[str, Any]) -> None:
    assert builder(_job()) == expected


def test_config_map_holds_the_defaulted_spec() -> None:
    cm = children.build_config_map(_job())
    assert cm["metadata"] == _meta("j-spec")
    doc = yaml.safe_load(cm["data"]["job.yaml"])
    assert doc["metadata"] == {"name": "j", "namespace": "ns"}
    assert doc["spec"] == to_dict(_job().spec)
    assert parse_job(doc).spec == _job().spec  # the controller pod loads it back


@pytest.mark.parametrize(
    "kind,expected",
    [
        ("none", None),
        (
            "scheduler-plugins",
            {
                "apiVersion": "scheduling.x-k8s.io/v1alpha1",
                "kind": "PodGroup",
                "metadata": _meta("j"),
                "spec": {"minMember": 4, "scheduleTimeoutSeconds": 60},
            },
        ),
        (
            "volcano",
            {
                "apiVersion": "scheduling.volcano.sh/v1beta1",
                "kind": "PodGroup",
                "metadata": _meta("j"),
                "spec": {"minMember": 4},
            },
        ),
    ],
)
def test_pod_group(kind: str, expected: dict[str, Any] | None) -> None:
    spec = copy.deepcopy(BASE_SPEC)
    spec["scheduling"] = {"timeoutSeconds": 60, "podGroup": kind}
    assert children.build_pod_group(parse_job(job(spec=spec))) == expected


def test_static_children_order_role_before_binding_and_config_before_pods() -> None:
    kinds = [o["kind"] for o in children.build_static_children(_job(), "t")]
    assert kinds == [
        "ServiceAccount",
        "Role",
        "RoleBinding",
        "Secret",
        "ConfigMap",
        "Service",
        "NetworkPolicy",
    ]


@pytest.mark.parametrize("quantity,cpus", [("100m", 1), ("1", 1), ("1500m", 2), ("2.5", 3), ("16", 16)])
def test_a_role_pod_gives_ray_its_cpu_request_rounded_up(quantity: str, cpus: int) -> None:
    """Without a CPU limit Ray would count the node's cores (and start an idle worker per core)."""
    assert children.ray_cpus(quantity) == cpus


@pytest.mark.parametrize("kind", ["scheduler-plugins", "volcano"])
def test_the_pod_group_holds_exactly_min_member_pods_without_the_rollout_fleet(kind: str) -> None:
    """minMember excludes the elastic rollout fleet (`gang_size`), so its pods must not be in the
    group: counted towards minMember they would let the group start with a gang pod pending."""
    doc = next(d for d in yaml.safe_load_all(ELASTIC.read_text()) if d and d.get("kind") == "RLTrainingJob")
    doc["spec"].setdefault("scheduling", {})["podGroup"] = kind
    parsed = parse_job(doc)
    members = [
        name
        for name, pod in children.build_pods(parsed).items()
        if {**(pod["metadata"].get("labels") or {}), **(pod["metadata"].get("annotations") or {})}.get(
            "scheduling.x-k8s.io/pod-group" if kind == "scheduler-plugins" else "scheduling.k8s.io/group-name"
        )
    ]
    pod_group = children.build_pod_group(parsed)
    assert pod_group is not None
    assert children.role_replicas(parsed.spec).get("rollout", 0) >= 1
    assert len(members) == pod_group["spec"]["minMember"], members
    assert not [m for m in members if "-rollout-" in m], members


def test_the_jobs_identity_is_named_from_its_uid_and_fits_a_dns_label() -> None:
    """A tenant cannot pre-mint the job's ServiceAccount (a RoleBinding written for `<job>` would
    bind it): its name, the Role's and the RoleBinding's carry the UID, still within 63."""
    doc = job()
    doc["metadata"].update(name="a" * 50, uid="0b6b7a34-8c1e-4a8f-9d2e-5f4c3b2a1908")
    parsed = parse_job(doc)
    want = "a" * 50 + "-0b6b7a34-8c1"
    assert children.identity_name(parsed) == want and len(want) == 63
    assert children.build_service_account(parsed)["metadata"]["name"] == want
    assert children.build_role(parsed)["metadata"]["name"] == want
    binding = children.build_role_binding(parsed)
    assert binding["metadata"]["name"] == want and binding["roleRef"]["name"] == want
    assert binding["subjects"][0]["name"] == want
    assert children.build_pod(parsed, "actor")["spec"]["serviceAccountName"] == want
    # The Role still names the job itself (its resourceNames), not the account.
    assert children.build_role(parsed)["rules"][0]["resourceNames"] == ["a" * 50]
