"""Pure builders of every child object of an RLTrainingJob: `build_*(job, ...) -> dict`.

No API calls here; `reconcile` decides which of them to create or delete, `kube` sends them.
Every child carries the job's labels and an owner reference to the job, so deleting the job
garbage-collects them.

Pods, one per replica with stable names:

* `<job>-controller`: Ray head plus the single controller (`rlhf controller`), reading the spec
  from the job's ConfigMap and writing `status.progress` with the job's ServiceAccount
  (`identity_name`: the job's name and part of its UID);
* `<job>-<role>-<i>`: a Ray worker advertising its GPUs and the custom resource
  `rlhf.dev/role-<role>: n`, n the ranks it runs (`contract.ranks_per_pod`: one per GPU for
  actor, critic, reference and reward; one engine per rollout pod), joined to the head through the headless Service `<job>` (`rlhf worker` waits
  for the head, bounded, then execs `ray start`).

Every env var, port, path and name the pods read back is defined in `rlhf_api.contract`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import yaml

from rlhf_api import contract
from rlhf_api.fields import to_dict
from rlhf_api.job import JobSpec, RLTrainingJob, roles_in_use
from rlhf_api.roles import NodePoolSpec
from rlhf_operator import images, kueue, network_policy, pod_identity, pod_template

# The pod contract's names, under the spellings the operator's code and tests use.
CONFIG_KEY = contract.CONFIG_KEY
CONFIG_DIR = contract.CONFIG_DIR
RAY_PORT = contract.RAY_PORT
METRICS_PORT = contract.METRICS_PORT
RAY_TOKEN_KEY = contract.RAY_TOKEN_KEY
RUN_AS_USER = pod_identity.DEFAULT_UID
GPU = "nvidia.com/gpu"
CONTROLLER_RESOURCES = {"cpu": "1", "memory": "2Gi"}
#: How long a pod stays on a NotReady/unreachable node before eviction. Kubernetes' default is
#: 300 s; a gang blocked on a dead rank wastes every other GPU meanwhile, so restart sooner.
NODE_LOSS_TOLERATION_SECONDS = 60


# --------------------------------------------------------------------------------------------
# Names and labels
# --------------------------------------------------------------------------------------------


def pod_name(job: str, role: str, index: int = 0) -> str:
    return contract.pod_name(job, role, index)


def controller_address(job: RLTrainingJob) -> str:
    """DNS name of the controller pod through the headless Service."""
    name = job.metadata_name
    return contract.pod_host(name, job.namespace, pod_name(name, contract.CONTROLLER_ROLE))


def job_labels(job: RLTrainingJob) -> dict[str, str]:
    return {
        contract.JOB_NAME: job.metadata_name,
        "app.kubernetes.io/managed-by": "rlhf-operator",
        "app.kubernetes.io/part-of": "rlhf-operator",
    }


def selector(job_name: str, role: str | None = None) -> str:
    sel = f"{contract.JOB_NAME}={job_name}"
    return sel + (f",{contract.ROLE}={role}" if role else "")


def owner_reference(job: RLTrainingJob) -> dict[str, Any]:
    return {
        "apiVersion": contract.API_VERSION,
        "kind": contract.KIND,
        "name": job.metadata_name,
        "uid": job.raw.get("metadata", {}).get("uid", ""),
        "controller": True,
        "blockOwnerDeletion": True,
    }


def _meta(job: RLTrainingJob, name: str, extra_labels: dict[str, str] | None = None) -> dict[str, Any]:
    return {
        "name": name,
        "namespace": job.namespace,
        "labels": {**job_labels(job), **(extra_labels or {})},
        "ownerReferences": [owner_reference(job)],
    }


# --------------------------------------------------------------------------------------------
# Which pods a job has
# --------------------------------------------------------------------------------------------


def role_replicas(spec: JobSpec) -> dict[str, int]:
    """Pods per role: `spec.roles_in_use` (roles with 0 replicas get none, nor do the roles the
    algorithm never uses: a critic-free algorithm's critic, klCoef 0's or LoRA's reference; the
    rollout fleet exists only when disaggregated)."""
    return roles_in_use(spec)


def gang_size(spec: JobSpec) -> int:
    """Pods of the gang that start and stop together: every role's but the elastic rollout
    fleet's, whose size follows `/scale` (a Kueue pod group's count and a PodGroup's
    `minMember` cannot follow it; see `kueue`)."""
    return sum(n for role, n in role_replicas(spec).items() if role != "rollout")


def _pool(spec: JobSpec, name: str | None) -> NodePoolSpec | None:
    return next((p for p in spec.node_pools if p.name == name), None) if name else None


# --------------------------------------------------------------------------------------------
# Per-job objects
# --------------------------------------------------------------------------------------------


#: Characters of the job's UID in the name of its ServiceAccount, Role and RoleBinding: a job name
#: of at most `admission.MAX_JOB_NAME` (50) + "-" + 12 is a 63-character DNS label.
IDENTITY_UID_CHARS = 12


def identity_name(job: RLTrainingJob) -> str:
    """`<job>-<first 12 characters of its UID>`: the name of the job's ServiceAccount, Role and
    RoleBinding. A UID exists only once the job does, so no tenant can mint the account in advance
    under a name that some other (dangling, hand-written) RoleBinding names, and a job recreated
    under the same name never meets its predecessor's account. The chart's status-writers policy
    matches the controller pod's user by the same rule (templates/rbac/status-writers-policy.yaml)."""
    uid = str(job.raw.get("metadata", {}).get("uid", ""))
    return f"{job.metadata_name}-{uid[:IDENTITY_UID_CHARS]}" if uid else job.metadata_name


def build_service_account(job: RLTrainingJob) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "metadata": _meta(job, identity_name(job)),
        "automountServiceAccountToken": False,
    }


def build_role(job: RLTrainingJob) -> dict[str, Any]:
    """The controller pod may read its own job and patch its status: nothing else."""
    name = [job.metadata_name]
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": _meta(job, identity_name(job)),
        "rules": [
            {
                "apiGroups": [contract.GROUP],
                "resources": [contract.PLURAL],
                "resourceNames": name,
                "verbs": ["get", "watch"],
            },
            {
                "apiGroups": [contract.GROUP],
                "resources": [f"{contract.PLURAL}/status"],
                "resourceNames": name,
                "verbs": ["get", "patch"],
            },
        ],
    }


def build_role_binding(job: RLTrainingJob) -> dict[str, Any]:
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": _meta(job, identity_name(job)),
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": identity_name(job)},
        "subjects": [{"kind": "ServiceAccount", "name": identity_name(job), "namespace": job.namespace}],
    }


def secret_name(job: RLTrainingJob) -> str:
    return contract.ray_token_secret_name(job.metadata_name, job.raw.get("metadata", {}).get("uid", ""))


def build_secret(job: RLTrainingJob, token: str) -> dict[str, Any]:
    """The Ray auth token shared by the job's pods. Created once; never overwritten."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": _meta(job, secret_name(job)),
        "type": "Opaque",
        "stringData": {RAY_TOKEN_KEY: token},
    }


def config_name(job: RLTrainingJob) -> str:
    return contract.spec_config_map_name(job.metadata_name)


def job_document(job: RLTrainingJob) -> dict[str, Any]:
    """The manifest the controller pod loads: the job with every default filled in."""
    return {
        "apiVersion": contract.API_VERSION,
        "kind": contract.KIND,
        "metadata": {"name": job.metadata_name, "namespace": job.namespace},
        "spec": to_dict(job.spec),
    }


def build_config_map(job: RLTrainingJob) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _meta(job, config_name(job)),
        "data": {CONFIG_KEY: yaml.safe_dump(job_document(job), sort_keys=False)},
    }


def build_service(job: RLTrainingJob) -> dict[str, Any]:
    """Headless Service giving every pod a stable DNS name `<pod>.<job>.<ns>.svc` (Ray, NCCL rendezvous)."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(job, job.metadata_name),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": {contract.JOB_NAME: job.metadata_name},
            "ports": [
                {"name": contract.RAY_PORT_NAME, "port": RAY_PORT, "targetPort": RAY_PORT},
                {"name": contract.METRICS_PORT_NAME, "port": METRICS_PORT, "targetPort": METRICS_PORT},
            ],
        },
    }


def build_pod_group(job: RLTrainingJob) -> dict[str, Any] | None:
    """A PodGroup for scheduler-plugins' coscheduling or Volcano, when `scheduling.podGroup` asks for one."""
    kind = job.spec.scheduling.pod_group
    if kind == "none":
        return None
    size = gang_size(job.spec)
    timeout = job.spec.scheduling.timeout_seconds
    if kind == "scheduler-plugins":
        return {
            "apiVersion": "scheduling.x-k8s.io/v1alpha1",
            "kind": "PodGroup",
            "metadata": _meta(job, job.metadata_name),
            "spec": {"minMember": size, "scheduleTimeoutSeconds": timeout},
        }
    return {
        "apiVersion": "scheduling.volcano.sh/v1beta1",
        "kind": "PodGroup",
        "metadata": _meta(job, job.metadata_name),
        "spec": {"minMember": size},
    }


def build_static_children(job: RLTrainingJob, token: str) -> list[dict[str, Any]]:
    """Every child except pods, in creation order (the Role before its binding, the Secret and
    ConfigMap before pods mount them)."""
    out = [
        build_service_account(job),
        build_role(job),
        build_role_binding(job),
        build_secret(job, token),
        build_config_map(job),
        build_service(job),
    ]
    pg = build_pod_group(job)
    if pg:
        out.append(pg)
    policy = build_network_policy(job)
    if policy:
        out.append(policy)
    return out


#: The operator's NetworkPolicy settings, from its environment (the chart's `networkPolicy.*`).
NETWORK_POLICY = network_policy.Settings.from_env()


def build_network_policy(
    job: RLTrainingJob, settings: network_policy.Settings | None = None
) -> dict[str, Any] | None:
    """Who may connect to the job's pods (see network_policy.py); None when policies are off."""
    name = job.metadata_name
    meta = _meta(job, network_policy.policy_name(name))
    return network_policy.build_network_policy(name, meta, settings or NETWORK_POLICY)


# --------------------------------------------------------------------------------------------
# Pods
# --------------------------------------------------------------------------------------------


def _env(job: RLTrainingJob, role: str, index: int, attempt: int) -> list[dict[str, Any]]:
    """The pod contract's variables (`rlhf_api.contract`); tests/unit/test_contract.py proves
    that the trainer reads each one the trainer is meant to read."""
    c = contract
    env: list[dict[str, Any]] = [
        c.ENV_NAMESPACE.from_field(),
        c.ENV_POD_NAME.from_field(),
        # The pod's own IP, never loopback: Ray's --node-ip-address and every rendezvous a rank
        # on this pod offers to ranks on other pods.
        c.ENV_POD_IP.from_field(),
        c.ENV_ROLE.value(role),
        c.ENV_REPLICA_INDEX.value(str(index)),
        c.ENV_RESTART_ATTEMPT.value(str(attempt)),
        c.ENV_RAY_AUTH_MODE.value("token"),
        c.ENV_RAY_AUTH_TOKEN.from_secret(secret_name(job), RAY_TOKEN_KEY),
        # NCCL: fail collectives instead of hanging on a lost peer, so the gang restart can happen.
        c.ENV_TORCH_NCCL_ASYNC_ERROR_HANDLING.value("1"),
        c.ENV_NCCL_DEBUG.value("WARN"),
        c.ENV_PYTHONUNBUFFERED.value("1"),
    ]
    if role == contract.CONTROLLER_ROLE:
        env.append(c.ENV_METRICS_PORT.value(str(METRICS_PORT)))
        # The checkpoint directory's owner (checkpoint_owner): a recreated job starts fresh.
        env.append(c.ENV_JOB_UID.value(str(job.raw.get("metadata", {}).get("uid", ""))))
    return env


#: A CPU quantity in cores, and the CPUs a role pod gives Ray (the pod contract's rounding).
cpu_cores = contract.cpu_cores
ray_cpus = contract.ray_cpus


def _command(job: RLTrainingJob, role: str, index: int, gpus: int, cpu: str = "1") -> list[str]:
    if role == contract.CONTROLLER_ROLE:
        return ["rlhf", "controller", "--spec-file", contract.SPEC_FILE]
    # `rlhf worker` waits (bounded) for the head's DNS name and port, then execs
    # `ray start --block --node-ip-address=$RLHF_POD_IP` with these arguments: with
    # restartPolicy Never, a plain `ray start` racing the head would burn a gang restart.
    # One unit of the role's resource per rank the pod runs (`contract.ranks_per_pod`: one per
    # GPU for the training and scoring roles), each rank asking for 1 of it.
    advertised = {contract.ray_role_resource(role): contract.ranks_per_pod(role, gpus)}
    if role == "rollout":  # the controller's replica for fleet slot `index` lands on this pod only
        advertised[contract.ray_rollout_slot_resource(index)] = 1
    resources = json.dumps(advertised)
    return [
        "rlhf",
        "worker",
        f"--address={contract.head_address(job.metadata_name, job.namespace)}",
        f"--num-gpus={gpus}",
        f"--num-cpus={ray_cpus(cpu)}",
        f"--resources={resources}",
    ]


def _tolerations(pool: NodePoolSpec | None, gpus: int) -> list[dict[str, Any]]:
    out = [dict(t) for t in (pool.tolerations if pool else [])]
    # GPU pools are tainted nvidia.com/gpu; a pod that asks for GPUs tolerates that taint (as the
    # ExtendedResourceToleration admission plugin would).
    gpu_toleration = {"key": GPU, "operator": "Exists", "effect": "NoSchedule"}
    if gpus > 0 and not any(t.get("key") == GPU for t in out):
        out.append(gpu_toleration)
    for key in ("node.kubernetes.io/not-ready", "node.kubernetes.io/unreachable"):
        if not any(t.get("key") == key for t in out):
            out.append(
                {
                    "key": key,
                    "operator": "Exists",
                    "effect": "NoExecute",
                    "tolerationSeconds": NODE_LOSS_TOLERATION_SECONDS,
                }
            )
    return out


def _gang_metadata(job: RLTrainingJob, role: str, kueue_group: str) -> tuple[dict[str, str], dict[str, str]]:
    """Labels and annotations that tell a gang scheduler or Kueue which pods belong together."""
    lab: dict[str, str] = {}
    ann: dict[str, str] = {}
    sched = job.spec.scheduling
    if sched.queue_name:
        lab, ann = kueue.pod_metadata(sched.queue_name, role, kueue_group, gang_size(job.spec))
    # The PodGroup's minMember is the gang without the rollout fleet (`gang_size`): a rollout pod
    # in the group would count towards it, and the scheduler could admit the group with rollout
    # pods bound and gang pods (an actor rank) left pending. Rollout pods schedule on their own,
    # as with Kueue.
    if role == "rollout":
        return lab, ann
    if sched.pod_group == "scheduler-plugins":
        lab[contract.SCHEDULER_PLUGINS_POD_GROUP] = job.metadata_name
    elif sched.pod_group == "volcano":
        ann[contract.VOLCANO_POD_GROUP] = job.metadata_name
    return lab, ann


def kueue_group(job: RLTrainingJob, attempt: int = 0, incarnation: str = "") -> str:
    """The Kueue pod group of the gang's pods of `attempt` (see `kueue.group_name`)."""
    uid = job.raw.get("metadata", {}).get("uid", "")
    return kueue.group_name(job.metadata_name, uid, attempt, incarnation)


@dataclass(frozen=True)
class _Shape:
    """What one pod of a role asks for, and where it may run."""

    gpus: int
    cpu: str
    memory: str
    shm: str
    pool: NodePoolSpec | None


def _shape(spec: JobSpec, role: str) -> _Shape:
    """The role's resources and node pool (the controller's: `spec.controller`)."""
    if role == contract.CONTROLLER_ROLE:
        ctl = spec.controller.resources  # defaults: CONTROLLER_RESOURCES
        return _Shape(0, ctl.cpu, ctl.memory, ctl.shm, _pool(spec, spec.controller.node_pool))
    role_spec = getattr(spec.roles, role)
    res = role_spec.resources
    return _Shape(res.gpus, res.cpu, res.memory, res.shm, _pool(spec, role_spec.node_pool))


def _pod_metadata(
    job: RLTrainingJob, role: str, index: int, attempt: int, incarnation: str
) -> dict[str, Any]:
    """The pod's name, owner, role/replica/attempt labels, and what groups it for a gang
    scheduler or Kueue."""
    gang_labels, gang_annotations = _gang_metadata(job, role, kueue_group(job, attempt, incarnation))
    meta = _meta(
        job,
        pod_name(job.metadata_name, role, index),
        {
            contract.ROLE: role,
            contract.REPLICA_INDEX: str(index),
            contract.RESTART_ATTEMPT: str(attempt),
            **gang_labels,
        },
    )
    if gang_annotations:
        meta["annotations"] = gang_annotations
    return meta


def _container(job: RLTrainingJob, role: str, index: int, attempt: int, shape: _Shape) -> dict[str, Any]:
    """The one container: image, command, the contract's env, resources, the mounts of the
    pod's volumes (`_pod_spec`), a locked-down security context; the controller's ports and probe."""
    requests: dict[str, str] = {"cpu": shape.cpu, "memory": shape.memory}
    limits: dict[str, str] = {"memory": shape.memory}
    if shape.gpus:
        requests[GPU] = limits[GPU] = str(shape.gpus)
    container: dict[str, Any] = {
        "name": "trainer",
        "image": images.trainer_image(job.spec),
        "command": _command(job, role, index, shape.gpus, shape.cpu),
        "env": _env(job, role, index, attempt),
        "resources": {"requests": requests, "limits": limits},
        "volumeMounts": [
            {"name": contract.VOLUME_SHM, "mountPath": contract.POD_SHM_DIR},
            {"name": contract.VOLUME_TMP, "mountPath": contract.POD_TMP_DIR},
            {"name": contract.VOLUME_SPEC, "mountPath": CONFIG_DIR, "readOnly": True},
        ],
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]},
        },
        # A failed container's last log lines become its termination message, which the
        # operator's PodFailure condition and Event quote: the gang restart deletes the pod
        # and its logs with it.
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    if role == contract.CONTROLLER_ROLE:
        # Only the controller pod listens on fixed ports (the Ray head, /metrics); a role pod's
        # raylet picks its own ports.
        container["ports"] = [
            {"name": contract.RAY_PORT_NAME, "containerPort": RAY_PORT},
            {"name": contract.METRICS_PORT_NAME, "containerPort": METRICS_PORT},
        ]
        container["readinessProbe"] = {
            "httpGet": {"path": contract.HEALTHZ_PATH, "port": contract.METRICS_PORT_NAME},
            "periodSeconds": 10,
        }
    return container


def _pod_spec(
    job: RLTrainingJob, role: str, name: str, container: dict[str, Any], shape: _Shape
) -> dict[str, Any]:
    """The pod's spec: no kubelet restarts, its DNS name under the job's Service, the job's
    identity, the volumes the container mounts, and where it may be placed (`_place`)."""
    is_controller = role == contract.CONTROLLER_ROLE
    pod_spec: dict[str, Any] = {
        "restartPolicy": "Never",  # the operator restarts the gang; kubelet restarts would desync ranks
        "hostname": name,
        "subdomain": job.metadata_name,
        "serviceAccountName": identity_name(job),
        # Only the controller pod talks to the API server.
        "automountServiceAccountToken": is_controller,
        "terminationGracePeriodSeconds": 30,
        "enableServiceLinks": False,
        # uid/gid/fsGroup: the operator's setting (a fixed uid, one per job, or the platform's).
        "securityContext": pod_identity.security_context(str(job.raw.get("metadata", {}).get("uid", ""))),
        "containers": [container],
        "volumes": [
            {"name": contract.VOLUME_SHM, "emptyDir": {"medium": "Memory", "sizeLimit": shape.shm}},
            {"name": contract.VOLUME_TMP, "emptyDir": {}},
            {"name": contract.VOLUME_SPEC, "configMap": {"name": config_name(job)}},
        ],
    }
    _place(job.spec, shape, pod_spec)
    return pod_spec


def _place(spec: JobSpec, shape: _Shape, pod_spec: dict[str, Any]) -> None:
    """The node pool's selector, tolerations and affinity; the scheduler and priority class."""
    pool = shape.pool
    if pool and pool.node_selector:
        pod_spec["nodeSelector"] = dict(pool.node_selector)
    pod_spec["tolerations"] = _tolerations(pool, shape.gpus)
    if pool and pool.affinity:
        pod_spec["affinity"] = pool.affinity
    if spec.scheduling.scheduler_name:
        pod_spec["schedulerName"] = spec.scheduling.scheduler_name
    if spec.scheduling.priority_class_name:
        pod_spec["priorityClassName"] = spec.scheduling.priority_class_name


def build_pod(
    job: RLTrainingJob, role: str, index: int = 0, attempt: int = 0, incarnation: str = ""
) -> dict[str, Any]:
    """The pod of one replica of one role (or the controller pod), for restart attempt `attempt`
    (`incarnation`: when the gang was last resumed, which names its Kueue pod group)."""
    shape = _shape(job.spec, role)
    meta = _pod_metadata(job, role, index, attempt, incarnation)
    container = _container(job, role, index, attempt, shape)
    pod_spec = _pod_spec(job, role, meta["name"], container, shape)
    # The spec's volumes, working directory, env, labels, pull settings and extra resources.
    return pod_template.customize(
        job, role, {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": pod_spec}
    )


def build_pods(
    job: RLTrainingJob, attempt: int = 0, rollout_replicas: int | None = None, incarnation: str = ""
) -> dict[str, dict[str, Any]]:
    """Every pod of the job by name; `rollout_replicas` overrides the rollout count (scaling)."""
    out: dict[str, dict[str, Any]] = {}
    for role, n in role_replicas(job.spec).items():
        if role == "rollout" and rollout_replicas is not None:
            n = rollout_replicas
        for i in range(n):
            pod = build_pod(job, role, i, attempt, incarnation)
            out[pod["metadata"]["name"]] = pod
    return out
