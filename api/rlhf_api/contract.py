"""The pod contract: every name the operator puts on a job's pods and the trainer reads back.

Environment variables, ports, paths, labels, resource names and the status keys the two sides
exchange are defined here, once. The operator (`rlhf_operator.children`) builds pods from these
constants; the trainer reads the environment only through the `EnvVar` accessors below. A test
(`tests/unit/test_contract.py`) builds pods of representative jobs and scans the trainer for
accessor calls, and fails when a variable is set on one side only.

This module is imported by the operator and by the trainer, so, like all of `rlhf_api`, it stays
torch-free and Ray-free and imports neither `rlhf_operator` nor `rlhf_trainer`. The operator's
labels, annotations and resource names are here too (it has no module of its own for them).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from rlhf_api import status as _status
from rlhf_api.fields import camel


def _status_key(section: type, name: str) -> str:
    """The status key of field `name` of the status dataclass `section` (its camelCase name);
    a name the schema lacks fails at import."""
    if name not in {f.name for f in dataclasses.fields(section)}:
        raise AttributeError(f"{section.__name__} has no field {name!r}")
    return camel(name)


# --------------------------------------------------------------------------------------------
# API group, kind, labels, annotations
# --------------------------------------------------------------------------------------------

GROUP = "rlhf.dev"
VERSION = "v1alpha1"
KIND = "RLTrainingJob"
PLURAL = "rltrainingjobs"
SINGULAR = "rltrainingjob"
SHORT_NAMES = ["rltj"]
API_VERSION = f"{GROUP}/{VERSION}"

#: Name of the RLTrainingJob that owns the object.
JOB_NAME = "rlhf.dev/job-name"
#: Role of the pod: controller, actor, critic, reference, reward or rollout.
ROLE = "rlhf.dev/role"
#: Ordinal of the pod within its role (0-based, stable across restarts).
REPLICA_INDEX = "rlhf.dev/replica-index"
#: Gang restart attempt the pod belongs to (bumped on every gang restart).
RESTART_ATTEMPT = "rlhf.dev/restart-attempt"

ROLES = ("actor", "critic", "reference", "reward", "rollout")
CONTROLLER_ROLE = "controller"

#: Roles whose pods form the training gang: one of them failing restarts every pod of the job
#: from the last checkpoint. A failed `rollout` pod is replaced alone.
GANG_ROLES = (CONTROLLER_ROLE, "actor", "critic", "reference", "reward")

#: Finalizer the operator puts on every job so that its per-job worker stops before deletion.
FINALIZER = "rlhf.dev/operator"

#: Kueue's plain-pod integration: queue, pod group and the group's size.
KUEUE_QUEUE_NAME = "kueue.x-k8s.io/queue-name"
KUEUE_POD_GROUP_NAME = "kueue.x-k8s.io/pod-group-name"
KUEUE_POD_GROUP_TOTAL_COUNT = "kueue.x-k8s.io/pod-group-total-count"
#: scheduler-plugins' coscheduling label and Volcano's group annotation.
SCHEDULER_PLUGINS_POD_GROUP = "scheduling.x-k8s.io/pod-group"
VOLCANO_POD_GROUP = "scheduling.k8s.io/group-name"

#: Ray custom resource a role pod advertises (`rlhf.dev/role-actor: 1`) so the driver's actors land on it.
RAY_ROLE_RESOURCE_PREFIX = "rlhf.dev/role-"

#: Field manager of every write the operator makes.
FIELD_MANAGER = "rlhf-operator"


def ray_role_resource(role: str) -> str:
    """The Ray custom resource a pod of `role` advertises and a rank of `role` asks for."""
    return f"{RAY_ROLE_RESOURCE_PREFIX}{role}"


#: Roles whose pods run one rank per GPU (a pod with N GPUs runs N ranks, each on its own GPU).
#: A rollout pod instead runs one engine holding all of the pod's GPUs (tensor-parallel over them).
RANK_PER_GPU_ROLES = ("actor", "critic", "reference", "reward")


def ranks_per_pod(role: str, gpus: int) -> int:
    """Ranks of `role` on one of its pods with `gpus` GPUs: the amount of `ray_role_resource(role)`
    the pod advertises, each rank asking for 1 of it (so exactly that many land on the pod)."""
    return max(1, gpus) if role in RANK_PER_GPU_ROLES else 1


def cpu_cores(quantity: str) -> float:
    """A Kubernetes CPU quantity in cores: "100m" -> 0.1, "4" -> 4.0, "1.5" -> 1.5."""
    q = str(quantity).strip()
    return float(q[:-1]) / 1000 if q.endswith("m") else float(q)


def ray_cpus(quantity: str) -> int:
    """CPUs a role pod gives Ray (`--num-cpus`): its request rounded up, at least 1."""
    return max(1, math.ceil(cpu_cores(quantity) - 1e-9))


#: Ray custom resource rollout pod `i` advertises besides its role's (`rlhf.dev/rollout-0: 1`):
#: the controller pod's replica for fleet slot `i` asks for it, so it lands on that pod and no
#: other, and a replica in a slot `>= replicas` is the one on a leaving pod.
RAY_ROLLOUT_SLOT_RESOURCE_PREFIX = "rlhf.dev/rollout-"


def ray_rollout_slot_resource(index: int) -> str:
    """The Ray custom resource rollout pod `index` advertises (`rlhf.dev/rollout-<index>`)."""
    return f"{RAY_ROLLOUT_SLOT_RESOURCE_PREFIX}{index}"


# --------------------------------------------------------------------------------------------
# Resource names, DNS names, ports, paths
# --------------------------------------------------------------------------------------------

#: Port of the Ray head (GCS) in the controller pod; role pods join it.
RAY_PORT = 6379
#: Port of the controller's `/metrics` and `/healthz` (the Service, the readiness probe).
METRICS_PORT = 8080
RAY_PORT_NAME = "ray"
METRICS_PORT_NAME = "metrics"


@dataclass(frozen=True)
class RayAgentPorts:
    """Pod-local ports of a Ray node's agents (every pod has its own network namespace, so fixed
    ports cannot collide). Fixed ports spare the raylet its 15 s wait for the agents' port files,
    which a loaded node misses (see `rlhf_trainer.ray_node`). Nothing outside the pod uses them:
    the operator opens no Service port for them."""

    metrics_export: int = 52364
    dashboard_agent_listen: int = 52365
    dashboard_agent_grpc: int = 52366
    runtime_env_agent: int = 52367


RAY_AGENT_PORTS = RayAgentPorts()
METRICS_PATH = "/metrics"
HEALTHZ_PATH = "/healthz"

#: Where the job's ConfigMap (the manifest with every default filled in) is mounted, read-only.
POD_SPEC_DIR = CONFIG_DIR = "/etc/rlhf"
CONFIG_KEY = "job.yaml"
SPEC_FILE = f"{CONFIG_DIR}/{CONFIG_KEY}"
#: Memory-backed shared memory (NCCL, torch's dataloader, vLLM) and the writable scratch
#: directory (Ray's session files) under a read-only root filesystem.
POD_SHM_DIR = "/dev/shm"
POD_TMP_DIR = "/tmp"
#: Working directory of every pod: relative spec paths (`model.path`, `data.path`, `output.dir`,
#: `checkpoint.dir`) resolve against it. A per-pod emptyDir unless the spec mounts a volume exactly
#: here (then it is that volume; a shared PersistentVolumeClaim makes relative paths shared).
POD_WORKSPACE_DIR = "/workspace"
#: HOME of every pod, on the /tmp emptyDir; the caches (`POD_FILESYSTEM_ENV`) live below it.
POD_HOME_DIR = f"{POD_TMP_DIR}/home"
#: Names of the volumes the operator adds to every pod (the spec may name none of them).
VOLUME_SHM = "dshm"
VOLUME_TMP = "tmp"
VOLUME_SPEC = "spec"
VOLUME_WORKSPACE = "workspace"
OPERATOR_VOLUMES = (VOLUME_SHM, VOLUME_TMP, VOLUME_SPEC, VOLUME_WORKSPACE)
#: Where the operator's autoscaler scrapes a job's controller pod when the job names no
#: Prometheus (`{job}` and `{namespace}` substituted): its DNS name, port and path.
CONTROLLER_METRICS_URL = (
    f"http://{{job}}-{CONTROLLER_ROLE}.{{job}}.{{namespace}}.svc:{METRICS_PORT}{METRICS_PATH}"
)
#: Key of the Ray auth token in the per-job Secret.
RAY_TOKEN_KEY = "token"


def pod_name(job: str, role: str, index: int = 0) -> str:
    """`<job>-controller` or `<job>-<role>-<index>`: stable across gang restarts."""
    return f"{job}-{CONTROLLER_ROLE}" if role == CONTROLLER_ROLE else f"{job}-{role}-{index}"


def pod_host(job: str, namespace: str, pod: str) -> str:
    """DNS name of one pod of the job through its headless Service `<job>` (hostname + subdomain)."""
    return f"{pod}.{job}.{namespace}.svc"


def head_address(job: str, namespace: str) -> str:
    """`host:port` of the job's Ray head: the controller pod's DNS name, never an IP, so it
    survives the controller pod being recreated with a new IP."""
    return f"{pod_host(job, namespace, pod_name(job, CONTROLLER_ROLE))}:{RAY_PORT}"


def ray_token_secret_name(job: str, uid: str = "") -> str:
    """`<job>-ray-token-<job uid>`: the job's UID in the name means no Secret can exist under it
    before the job does (UIDs are assigned at creation), so the operator, which by design may not
    read Secrets, never has to decide whether a same-named one is its own, and a job recreated
    under the same name never meets its predecessor's token."""
    return f"{job}-ray-token-{uid}" if uid else f"{job}-ray-token"


def spec_config_map_name(job: str) -> str:
    return f"{job}-spec"


# --------------------------------------------------------------------------------------------
# Status keys exchanged through the job's status (camelCase, as in the CRD)
# --------------------------------------------------------------------------------------------

#: The keys are the camelCase names of the status dataclasses' fields (`rlhf_api.status`, which
#: the CRD's status schema is rendered from): the schema owns them, these constants name them.
#: `status.progress`, written by the controller pod only.
STATUS_PROGRESS = _status_key(_status.JobStatus, "progress")
PROGRESS_STEP = _status_key(_status.ProgressStatus, "step")
PROGRESS_TOTAL_STEPS = _status_key(_status.ProgressStatus, "total_steps")
PROGRESS_REWARD = _status_key(_status.ProgressStatus, "reward")
PROGRESS_CHECKPOINT_STEP = _status_key(_status.ProgressStatus, "checkpoint_step")
PROGRESS_UPDATED = _status_key(_status.ProgressStatus, "updated")
#: The last evaluation's mean reward (`spec.eval`; trainer metric `eval/reward_mean`) and the
#: training steps done when it ran. Written only by steps that evaluate; the merge patch keeps
#: them in between.
PROGRESS_EVAL_REWARD = _status_key(_status.ProgressStatus, "eval_reward")
PROGRESS_EVAL_STEP = _status_key(_status.ProgressStatus, "eval_step")
#: Free-form metrics of the last step: `/` in the trainer's metric names becomes `_` (label-safe).
PROGRESS_METRICS = _status_key(_status.ProgressStatus, "metrics")

#: `status.rollout`: the operator writes `generation`, the controller pod `syncedGeneration`.
STATUS_ROLLOUT = _status_key(_status.JobStatus, "rollout")
ROLLOUT_GENERATION = _status_key(_status.RolloutStatus, "generation")
ROLLOUT_SYNCED_GENERATION = _status_key(_status.RolloutStatus, "synced_generation")
#: `status.rollout.desired`: the replica count the operator's `generation` stands for (written
#: with it; the controller pod follows this, not `spec.roles.rollout.replicas`, which may be ahead).
ROLLOUT_DESIRED = _status_key(_status.RolloutStatus, "desired")
ROLLOUT_READY = _status_key(_status.RolloutStatus, "ready")
ROLLOUT_SELECTOR = _status_key(_status.RolloutStatus, "selector")


def progress_metric_key(metric: str) -> str:
    """The key of trainer metric `metric` (`reward/mean`) under `status.progress.metrics`."""
    return metric.replace("/", "_")


#: The mean reward among `progress.metrics` (the printer column's fallback).
PROGRESS_METRIC_REWARD_MEAN = progress_metric_key("reward/mean")


# --------------------------------------------------------------------------------------------
# Environment variables
# --------------------------------------------------------------------------------------------

#: Who gives a variable its value: the operator (in every pod it builds, or in some), the user
#: (an optional knob with a default; through the spec's pod env or a local shell), or Kubernetes.
SetBy = Literal["operator", "user", "kubernetes"]
#: Which pods the operator sets a variable in.
Pods = Literal["all", "controller", "workers"]
#: The trainer reads the variable through this module's accessors; any other value names the
#: program that reads it instead (Ray, torch, NCCL, the Python interpreter).
TRAINER = "trainer"


@dataclass(frozen=True)
class EnvVar:
    """One environment variable of the contract. The trainer reads it with `get*`, never with
    `os.environ` directly; an empty value counts as unset."""

    name: str
    doc: str
    set_by: SetBy
    pods: Pods = "all"
    read_by: str = TRAINER
    default: str | None = None
    #: Downward-API source of the value (`status.podIP`), when the kubelet fills it in.
    field_path: str | None = None
    #: The value differs from pod to pod: it must reach a Ray worker from its own raylet's
    #: environment, never from the driver's runtime_env (which would spread the controller
    #: pod's value to every pod).
    pod_local: bool = False
    #: The operator's value is a default: a manifest's pod env (`spec.pod.env`, a role's) may
    #: replace it (HF_HOME on a volume, NCCL_DEBUG=INFO). Otherwise the spec refuses the name.
    overridable: bool = False

    def get(self, environ: Mapping[str, str] | None = None) -> str | None:
        """The value, else the default, else None."""
        value = (os.environ if environ is None else environ).get(self.name)
        return value if value else self.default

    def get_str(self, environ: Mapping[str, str] | None = None) -> str:
        value = self.get(environ)
        if value is None:
            raise KeyError(f"{self.name} is not set and has no default ({self.doc})")
        return value

    def get_int(self, environ: Mapping[str, str] | None = None) -> int:
        raw = self.get_str(environ)
        try:
            return int(raw)
        except ValueError:
            raise ValueError(f"{self.name}={raw!r}: expected an integer ({self.doc})") from None

    def get_float(self, environ: Mapping[str, str] | None = None) -> float:
        raw = self.get_str(environ)
        try:
            return float(raw)
        except ValueError:
            raise ValueError(f"{self.name}={raw!r}: expected a number ({self.doc})") from None

    @contextlib.contextmanager
    def overridden(self, value: str) -> Iterator[None]:
        """This variable is `value` in this process's environment inside the block (for a library
        that reads it at one moment, e.g. torch when it constructs a process group)."""
        old = os.environ.get(self.name)
        os.environ[self.name] = value
        try:
            yield
        finally:
            if old is None:
                os.environ.pop(self.name, None)
            else:
                os.environ[self.name] = old

    def is_set(self, environ: Mapping[str, str] | None = None) -> bool:
        return bool((os.environ if environ is None else environ).get(self.name))

    # -- the operator's side: container env entries ----------------------------------------------
    def value(self, value: str) -> dict[str, Any]:
        return {"name": self.name, "value": value}

    def from_field(self) -> dict[str, Any]:
        if self.field_path is None:
            raise ValueError(f"{self.name} has no downward-API field")
        return {"name": self.name, "valueFrom": {"fieldRef": {"fieldPath": self.field_path}}}

    def from_secret(self, secret: str, key: str) -> dict[str, Any]:
        return {"name": self.name, "valueFrom": {"secretKeyRef": {"name": secret, "key": key}}}


_DECLARED: list[EnvVar] = []


def _declare(*args: Any, **kwargs: Any) -> EnvVar:
    var = EnvVar(*args, **kwargs)
    if any(v.name == var.name for v in _DECLARED):
        raise ValueError(f"{var.name} is declared twice in the pod contract")
    _DECLARED.append(var)
    return var


# -- set by the operator, read by the trainer --------------------------------------------------
ENV_NAMESPACE = _declare(
    "RLHF_NAMESPACE",
    "Namespace of the job (for PromQL selectors of the job's own series).",
    "operator",
    field_path="metadata.namespace",
)
ENV_POD_NAME = _declare(
    "RLHF_POD_NAME",
    "Name of this pod (named in the pod's startup log line).",
    "operator",
    field_path="metadata.name",
    pod_local=True,
)
ENV_POD_IP = _declare(
    "RLHF_POD_IP",
    "This pod's IP: Ray's --node-ip-address and the host of every rendezvous a rank on this pod "
    "offers (torch.distributed store, weight-sync group). Unset locally, where everything is on "
    "127.0.0.1.",
    "operator",
    field_path="status.podIP",
    pod_local=True,
)
ENV_ROLE = _declare(
    "RLHF_ROLE",
    "Role of this pod: controller (the Ray head and driver) or a worker role.",
    "operator",
    pod_local=True,
)
ENV_REPLICA_INDEX = _declare(
    "RLHF_REPLICA_INDEX",
    "Ordinal of this pod within its role.",
    "operator",
    pod_local=True,
)
ENV_RESTART_ATTEMPT = _declare(
    "RLHF_RESTART_ATTEMPT",
    "Gang restart attempt of this pod (0 for the first start).",
    "operator",
)
ENV_JOB_UID = _declare(
    "RLHF_JOB_UID",
    "UID of the job: the checkpoint directory's owner (checkpoint_owner), so a job recreated "
    "under the same name does not resume its predecessor's checkpoints.",
    "operator",
    pods="controller",
)
ENV_METRICS_PORT = _declare(
    "RLHF_METRICS_PORT",
    "Port the controller serves /metrics and /healthz on (the Service and readiness probe use it).",
    "operator",
    pods="controller",
)

# -- set by the operator, read by other programs in the pod -------------------------------------
ENV_RAY_AUTH_MODE = _declare(
    "RAY_AUTH_MODE",
    "Ray's authentication mode: token (also read by ray_node, which refuses a Ray too old to enforce it).",
    "operator",
    read_by=TRAINER,
)
ENV_RAY_AUTH_TOKEN = _declare(
    "RAY_AUTH_TOKEN", "Ray's shared auth token, from the per-job Secret.", "operator", read_by="Ray"
)
ENV_TORCH_NCCL_ASYNC_ERROR_HANDLING = _declare(
    "TORCH_NCCL_ASYNC_ERROR_HANDLING",
    "1: a collective with a lost peer fails instead of hanging, so the gang restart can happen.",
    "operator",
    read_by="torch",
)
ENV_NCCL_DEBUG = _declare("NCCL_DEBUG", "NCCL's log level.", "operator", read_by="NCCL", overridable=True)
ENV_PYTHONUNBUFFERED = _declare(
    "PYTHONUNBUFFERED", "1: log lines reach `kubectl logs` at once.", "operator", read_by="python"
)

# -- optional knobs (a default applies when unset) -----------------------------------------------
ENV_SPEC_FILE = _declare("RLHF_SPEC_FILE", "The manifest `rlhf controller` loads.", "user", default=SPEC_FILE)
ENV_RAY_ADDRESS = _declare(
    "RAY_ADDRESS",
    "A Ray cluster to join instead of starting one (`rlhf run`, `rlhf controller`); Ray reads it too.",
    "user",
)
ENV_VLLM_CPU_KVCACHE_SPACE = _declare(
    "VLLM_CPU_KVCACHE_SPACE",
    "vLLM's KV-cache size on CPU, in GiB; when set, a CPU vllm engine uses it instead of its small "
    "default budget (`rollout/vllm.py`).",
    "user",
)
ENV_RAY_HEAD_TIMEOUT_S = _declare(
    "RLHF_RAY_HEAD_TIMEOUT_S",
    "Seconds `rlhf worker` waits for the Ray head to resolve and accept connections.",
    "user",
    default="300",
)
ENV_RAY_START_ATTEMPTS = _declare(
    "RLHF_RAY_START_ATTEMPTS",
    "How often a pod tries `ray start` when it fails before its node registered with the head "
    "(Ray allows 30 s; a loaded node can need more).",
    "user",
    default="3",
)
ENV_COLLECTIVE_TIMEOUT_S = _declare(
    "RLHF_COLLECTIVE_TIMEOUT_S",
    "Seconds a torch.distributed collective may block before the group raises.",
    "user",
    default="300",
)
ENV_SYNC_TIMEOUT_S = _declare(
    "RLHF_SYNC_TIMEOUT_S",
    "Seconds a dead member can hold a weight sync up.",
    "user",
    default="60",
)
ENV_SYNC_BACKEND = _declare(
    "RLHF_SYNC_BACKEND",
    "Weight-sync backend from the actor to the rollout fleet: gloo (CPU buffers, any placement) or "
    "nccl (GPU buffers; the actor and rollout roles need GPUs). Read by the controller.",
    "user",
    default="gloo",
)
ENV_VERIFY_WEIGHT_SYNC = _declare(
    "RLHF_VERIFY_WEIGHT_SYNC",
    "1: hash the weights on the actor and every rollout replica after each sync, log them, and fail "
    "the step on a mismatch (costs one pass over the weights on each side).",
    "user",
    default="0",
)
ENV_TORCH_THREADS = _declare(
    "RLHF_TORCH_THREADS", "Intra-op torch threads per worker (workers share the cores).", "user", default="1"
)
#: Ray's name for its own setting (`RAY_CONFIG(int, worker_niceness, 15)`), so the constant keeps
#: Ray's spelling.
ENV_RAY_worker_niceness = _declare(
    "RAY_worker_niceness",
    "The niceness Ray's worker processes add to their raylet's (Ray's own default is 15). The "
    "project's role workers do the job's compute, so every Ray the project starts gives them 0 "
    "(`ray_node.worker_niceness`); a higher value yields the CPU to other programs.",
    "user",
    default="0",
)
ENV_CUDA_DRIVER_MIN = _declare(
    "RLHF_CUDA_DRIVER_MIN",
    "The oldest NVIDIA driver branch the image's CUDA wheels run on (the GPU image sets it beside "
    "its label dev.rlhf.cuda.driver-min); GPU pods check the node's driver against it at start "
    "(`gpu_preflight`). Unset: the floor of torch's CUDA major version.",
    "user",
)
ENV_WORKER_CPUS = _declare(
    "RLHF_WORKER_CPUS", "Logical CPUs each worker asks Ray for.", "user", default="0.25"
)
ENV_TRANSFORMERS_VERBOSITY = _declare(
    "TRANSFORMERS_VERBOSITY",
    "transformers' log level, passed on to the workers (quiet by default).",
    "user",
    default="error",
)

ENV_MLFLOW_TRACKING_URI = _declare(
    "MLFLOW_TRACKING_URI",
    "MLflow's server (spec.output.trackers.mlflow, read by the controller); unset: a store in the "
    "run directory (mlflow.db, or the mlruns folder without SQLAlchemy).",
    "user",
)

# -- where programs in a pod write under its read-only root filesystem ---------------------------
# The operator sets these in every pod, below POD_HOME_DIR (the /tmp emptyDir); a manifest's pod
# env may point any of them at a volume instead (`HF_HOME` on a shared model cache).
ENV_HOME = _declare(
    "HOME",
    "Home directory (`~`, dot-files, caches of tools that use it).",
    "operator",
    read_by="python",
    overridable=True,
    default=POD_HOME_DIR,
)
ENV_XDG_CACHE_HOME = _declare(
    "XDG_CACHE_HOME",
    "Caches of torch hub, vLLM, fontconfig, numba.",
    "operator",
    read_by="python",
    overridable=True,
    default=f"{POD_HOME_DIR}/.cache",
)
ENV_XDG_CONFIG_HOME = _declare(
    "XDG_CONFIG_HOME",
    "Config files some tools write (vLLM usage stats).",
    "operator",
    read_by="python",
    overridable=True,
    default=f"{POD_HOME_DIR}/.config",
)
ENV_HF_HOME = _declare(
    "HF_HOME",
    "Hugging Face hub, datasets and tokenizer caches.",
    "operator",
    read_by="huggingface",
    overridable=True,
    default=f"{POD_HOME_DIR}/.cache/huggingface",
)
ENV_MPLCONFIGDIR = _declare(
    "MPLCONFIGDIR",
    "matplotlib's config and font cache (the run report's plots).",
    "operator",
    read_by="matplotlib",
    overridable=True,
    default=f"{POD_HOME_DIR}/.config/matplotlib",
)
ENV_TRITON_CACHE_DIR = _declare(
    "TRITON_CACHE_DIR",
    "Compiled Triton kernels.",
    "operator",
    read_by="triton",
    overridable=True,
    default=f"{POD_HOME_DIR}/.triton/cache",
)
ENV_TORCHINDUCTOR_CACHE_DIR = _declare(
    "TORCHINDUCTOR_CACHE_DIR",
    "torch.compile's kernel cache.",
    "operator",
    read_by="torch",
    overridable=True,
    default=f"{POD_HOME_DIR}/.cache/torchinductor",
)
ENV_PYTHONPYCACHEPREFIX = _declare(
    "PYTHONPYCACHEPREFIX",
    "Bytecode of modules imported from read-only or shared directories.",
    "operator",
    read_by="python",
    overridable=True,
    default=f"{POD_TMP_DIR}/pycache",
)
#: The variables above, with the values the operator gives them in every pod (before the spec's env).
POD_FILESYSTEM_ENV: tuple[EnvVar, ...] = (
    ENV_HOME,
    ENV_XDG_CACHE_HOME,
    ENV_XDG_CONFIG_HOME,
    ENV_HF_HOME,
    ENV_MPLCONFIGDIR,
    ENV_TRITON_CACHE_DIR,
    ENV_TORCHINDUCTOR_CACHE_DIR,
    ENV_PYTHONPYCACHEPREFIX,
)

# -- set by Kubernetes -------------------------------------------------------------------------
ENV_KUBERNETES_SERVICE_HOST = _declare(
    "KUBERNETES_SERVICE_HOST",
    "Set by the kubelet in every pod (even with enableServiceLinks: false): we run in a cluster.",
    "kubernetes",
)

#: Every variable of the contract, in declaration order.
ENV_VARS: tuple[EnvVar, ...] = tuple(_DECLARED)
#: The variables the operator sets in some pod and a manifest's own env must not override.
OPERATOR_ENV_NAMES: tuple[str, ...] = tuple(
    v.name for v in ENV_VARS if v.set_by == "operator" and not v.overridable
)


def operator_env_names(role: str) -> list[str]:
    """Names the operator sets in a pod of `role` (the controller or a worker role)."""
    which = "controller" if role == CONTROLLER_ROLE else "workers"
    return [v.name for v in ENV_VARS if v.set_by == "operator" and v.pods in ("all", which)]
