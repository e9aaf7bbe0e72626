"""Where a job runs: its roles and their replicas, node pools, the controller pod, scheduling
(gang schedulers, Kueue), the failure policy and the autoscaler's settings.

Importable without torch, Ray or a Kubernetes client.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Literal, get_args

from rlhf_api.contract import (
    POD_TMP_DIR,
    POD_WORKSPACE_DIR,
)
from rlhf_api.fields import DNS_LABEL_RE, MAX_REPLICAS, QUANTITY_RE, _f, cel_int
from rlhf_api.pods import PodSettingsSpec, ResourcesSpec

#: Pods a job can have at most, as CEL over the spec (the controller pod is the `1`).
_JOB_PODS_CEL = (
    "(1 + "
    + " + ".join(
        [f"self.roles.{r}.replicas" for r in ("actor", "critic", "reference", "reward")]
        + ["self.roles.rollout.maxReplicas"]
    )
    + ")"
)


@dataclass
class RoleSpec:
    """One role: `replicas` pods (or, locally, Ray workers), each a rank of the role's process group."""

    replicas: int = _f(
        1,
        doc="Pods of this role; each is one rank of the role's torch.distributed group.",
        minimum=0,
        maximum=MAX_REPLICAS,
        immutable=True,
    )
    resources: ResourcesSpec = _f(ResourcesSpec, doc="Resources per pod.", immutable=True)
    node_pool: str | None = _f(
        None, doc="Name of an entry of `nodePools` to place the pods on.", immutable=True
    )
    pod: PodSettingsSpec = _f(
        PodSettingsSpec,
        doc="Env, labels, annotations and volumes of this role's pods, added to `spec.pod`'s (cluster only).",
        cluster_only=True,
        immutable=True,
    )


@dataclass
class RolloutRoleSpec:
    """The rollout fleet: elastic between `minReplicas` and `maxReplicas` (the CRD's /scale subresource)."""

    replicas: int = _f(
        1,
        doc="Current rollout engines (the /scale subresource: kubectl scale, HPA, KEDA).",
        minimum=0,
        maximum=MAX_REPLICAS,
    )
    min_replicas: int = _f(1, doc="Lower bound for autoscaling.", minimum=0, maximum=MAX_REPLICAS)
    max_replicas: int = _f(1, doc="Upper bound for autoscaling.", minimum=1, maximum=MAX_REPLICAS)
    resources: ResourcesSpec = _f(ResourcesSpec, doc="Resources per rollout pod.", immutable=True)
    node_pool: str | None = _f(
        None, doc="Name of an entry of `nodePools` to place the pods on.", immutable=True
    )
    pod: PodSettingsSpec = _f(
        PodSettingsSpec,
        doc="Env, labels, annotations and volumes of the rollout pods, added to `spec.pod`'s (cluster only).",
        cluster_only=True,
        immutable=True,
    )

    CEL_RULES: ClassVar[list[tuple[Any, ...]]] = [
        (
            "self.minReplicas <= self.maxReplicas",
            "rollout.minReplicas must be <= rollout.maxReplicas",
            {
                "fieldPath": ".minReplicas",
                "messageExpression": "'rollout.minReplicas must be <= rollout.maxReplicas (' + "
                + cel_int("self.maxReplicas")
                + " + '); got ' + "
                + cel_int("self.minReplicas"),
            },
        ),
        (
            "self.replicas >= self.minReplicas && self.replicas <= self.maxReplicas",
            "rollout.replicas must lie in [minReplicas, maxReplicas]",
            {
                "fieldPath": ".replicas",
                "messageExpression": "'rollout.replicas must lie in [minReplicas, maxReplicas] = [' + "
                + cel_int("self.minReplicas")
                + " + ', ' + "
                + cel_int("self.maxReplicas")
                + " + ']; got ' + "
                + cel_int("self.replicas"),
            },
        ),
    ]


@dataclass
class RolesSpec:
    """Roles and how they share hardware."""

    placement: Literal["colocated", "disaggregated"] = _f(
        "colocated",
        doc="`colocated`: rollout runs inside the actor workers (hybrid engine); `disaggregated`: a separate, "
        "elastic rollout fleet receives weights by broadcast.",
        immutable=True,
    )
    actor: RoleSpec = _f(RoleSpec, doc="Policy training (FSDP2 when replicas > 1).")
    critic: RoleSpec = _f(
        RoleSpec, doc="Value model training; used only by algorithms that need a critic (ppo)."
    )
    reference: RoleSpec = _f(
        RoleSpec, doc="Frozen reference policy for the KL term; used when the algorithm needs one."
    )
    reward: RoleSpec = _f(RoleSpec, doc="Reward workers (reward functions and the reward model).")
    rollout: RolloutRoleSpec = _f(RolloutRoleSpec, doc="Generation engines (disaggregated placement).")


@dataclass
class NodePoolSpec:
    """A group of nodes that roles can be placed on."""

    name: str = _f(doc="Name referred to by `roles.*.nodePool`.", pattern=DNS_LABEL_RE)
    node_selector: dict[str, str] = _f({}, doc="Node labels a pod of this pool requires.")
    tolerations: list[dict[str, Any]] = _f(
        [], doc="Tolerations (core/v1 Toleration) for the pool's taints.", free_form=True
    )
    affinity: dict[str, Any] = _f({}, doc="Pod affinity (core/v1 Affinity).", free_form=True)
    gpu_product: str | None = _f(
        None,
        doc="GPU model of the pool's nodes as NVIDIA's GPU feature discovery labels it "
        "(`nvidia.com/gpu.product`, e.g. NVIDIA-H100-80GB-HBM3, NVIDIA-L4): `rlhf validate` plans each "
        "role's GPU memory against it. Unset: the nodeSelector's `nvidia.com/gpu.product`, or the "
        "nodes' labels with `rlhf validate --nodes`.",
        min_length=1,
    )
    gpu_memory: str | None = _f(
        None,
        doc="Memory of one GPU of the pool (Kubernetes quantity, e.g. 80Gi); overrides what `gpuProduct` "
        "is known to have. For a GPU `rlhf validate` does not know.",
        pattern=QUANTITY_RE,
    )


@dataclass
class ControllerResourcesSpec:
    """Resources of the controller pod (the Ray head and the single controller loop; no GPUs)."""

    cpu: str = _f("1", doc="CPU request (Kubernetes quantity).", pattern=QUANTITY_RE)
    memory: str = _f("2Gi", doc="Memory request and limit (Kubernetes quantity).", pattern=QUANTITY_RE)
    shm: str = _f("1Gi", doc="Size of the memory-backed /dev/shm (Ray's object store).", pattern=QUANTITY_RE)
    ephemeral_storage: str | None = _f(
        None,
        doc=f"`ephemeral-storage` request: the node disk behind {POD_TMP_DIR}, the default "
        f"{POD_WORKSPACE_DIR}, emptyDir volumes and logs (Kubernetes quantity); unset: none.",
        pattern=QUANTITY_RE,
    )


@dataclass
class ControllerSpec:
    """The controller pod: Ray head plus the single controller that runs the dataflow (cluster only)."""

    resources: ControllerResourcesSpec = _f(
        ControllerResourcesSpec, doc="Resources of the controller pod.", immutable=True
    )
    node_pool: str | None = _f(
        None, doc="Name of an entry of `nodePools` to place the controller pod on.", immutable=True
    )
    pod: PodSettingsSpec = _f(
        PodSettingsSpec,
        doc="Env, labels, annotations and volumes of the controller pod, added to `spec.pod`'s.",
        immutable=True,
    )


@dataclass
class SchedulingSpec:
    """Gang scheduling and queueing."""

    timeout_seconds: int = _f(
        300, doc="How long all of a gang's pods may wait to be scheduled before `Unschedulable`.", minimum=1
    )
    image_pull_timeout_seconds: int = _f(
        1800,
        doc=(
            "How long a pod bound to a node may stay in ContainerCreating/PodInitializing (pulling its "
            "image: a trainer image is many GB) before it counts as a start failure (PodStartTimeout, "
            "naming the image); until then a slow pull is neither a failure nor a gang restart. Other "
            "bound pods that are not Running get `timeoutSeconds`. Pull errors (ErrImagePull, "
            "ImagePullBackOff) are failures at once."
        ),
        minimum=1,
    )
    on_timeout: Literal["wait", "fail"] = _f(
        "wait", doc="After the timeout: keep waiting (reported) or fail the job."
    )
    scheduler_name: str | None = _f(None, doc="schedulerName of every pod.", immutable=True)
    priority_class_name: str | None = _f(None, doc="priorityClassName of every pod.", immutable=True)
    queue_name: str | None = _f(
        None,
        doc="Kueue LocalQueue: the gang is one Kueue pod group (without the rollout fleet, whose pods Kueue admits one by one); see docs/operator.md, Kueue.",
        immutable=True,
    )
    pod_group: Literal["none", "scheduler-plugins", "volcano"] = _f(
        "none", doc="Also create a PodGroup for this gang scheduler.", immutable=True
    )


#: Why a pod of the training gang stopped counting, as `failurePolicy.rules[].onReasons` names it
#: (the operator's `failure_policy.py` sorts every failure into one of these).
FailureReason = Literal[
    "NodeLost",
    "Evicted",
    "Preempted",
    "PodDeletedByUser",
    "ContainerExitCode",
    "OOMKilled",
    "ImagePullFailed",
    "PodStartFailed",
    "PodStartTimeout",
    "WorkerExited",
    "PodFailed",
]
FAILURE_REASONS: tuple[str, ...] = get_args(FailureReason)
FailureAction = Literal["RestartGang", "RestartGangNoCount", "FailJob"]
FAILURE_ACTIONS: tuple[str, ...] = get_args(FailureAction)


#: The spec paths of the pods a job places (each role's, and the controller's): rules that
#: apply to every one of them are generated per path.
_PLACED_PODS = (
    "roles.actor",
    "roles.critic",
    "roles.reference",
    "roles.reward",
    "roles.rollout",
    "controller",
)


@dataclass
class FailurePolicyRuleSpec:
    """A failure-policy rule: what a failure of the training gang whose reason is in `onReasons`
    does. Rules are tried in order and the first that matches decides; a failure no rule matches
    restarts the gang (counted), except ImagePullFailed, which fails the job."""

    action: FailureAction = _f(
        doc="RestartGang: restart the gang from the last checkpoint, counted against maxRestarts; "
        "RestartGangNoCount: restart it without counting (e.g. preemption, node loss); "
        "FailJob: fail the job at once."
    )
    on_reasons: list[FailureReason] = _f(
        [],
        doc="Failure reasons the rule matches (empty: every reason): NodeLost (the pod's node went "
        "away, or the pod vanished), Evicted (node pressure, a drain), Preempted (by the scheduler), "
        "PodDeletedByUser (deleted without a disruption reason), ContainerExitCode (a container exited "
        "non-zero, see exitCodes), OOMKilled, ImagePullFailed, PodStartFailed, PodStartTimeout, "
        "WorkerExited (a worker pod exited 0 before the controller), PodFailed (anything else).",
    )
    exit_codes: list[int] = _f(
        [],
        doc="With ContainerExitCode in onReasons: only these exit codes (1-255) match; empty: any.",
    )

    CEL_RULES: ClassVar[list[tuple[Any, ...]]] = [
        (
            "size(self.exitCodes) == 0 || 'ContainerExitCode' in self.onReasons",
            "failurePolicy.rules[].exitCodes needs ContainerExitCode in onReasons",
            {"fieldPath": ".exitCodes"},
        ),
        (
            "self.exitCodes.all(c, c >= 1 && c <= 255)",
            "failurePolicy.rules[].exitCodes: exit codes are 1 to 255",
            {
                "fieldPath": ".exitCodes",
                "messageExpression": "'failurePolicy.rules[].exitCodes: exit codes are 1 to 255; got ' + "
                + cel_int("self.exitCodes.filter(c, c < 1 || c > 255)[0]"),
            },
        ),
    ]


@dataclass
class FailurePolicySpec:
    """Restarts of the training gang."""

    max_restarts: int = _f(
        3, doc="Gang restarts from the last checkpoint before the job is Failed.", minimum=0
    )
    backoff_seconds: int = _f(10, doc="First restart delay; doubled after each restart.", minimum=0)
    max_backoff_seconds: int = _f(300, doc="Upper bound of the restart delay.", minimum=0)
    rules: list[FailurePolicyRuleSpec] = _f(
        [],
        doc="Per-reason actions, tried in order (the first match decides): restart counted, restart "
        "not counted against maxRestarts, or fail the job.",
    )


@dataclass
class PrometheusSpec:
    """Where the autoscaler reads its signal."""

    url: str = _f(doc="Base URL of the Prometheus HTTP API, e.g. http://prometheus.monitoring:9090.")
    query: str | None = _f(
        None,
        doc="PromQL override for the signal; `{job}` and `{namespace}` are substituted. The operator "
        "sends it only where it allows custom queries (chart autoscaler.allowCustomQueries).",
    )


@dataclass
class AutoscalingSpec:
    """Metric-driven scaling of the rollout fleet (one policy shared by the operator and `rlhf run`)."""

    enabled: bool = _f(
        False, doc="Let the autoscaler set rollout.replicas within [minReplicas, maxReplicas]."
    )
    metric: Literal["rollout_wait_fraction", "queue_depth", "tokens_per_second"] = _f(
        "rollout_wait_fraction",
        doc="Signal: fraction of step time waiting for rollouts (default), queued prompts, or tokens/s per replica.",
    )
    target: float = _f(0.2, doc="Target value of the signal per replica.", exclusive_minimum=0.0)
    tolerance: float = _f(0.1, doc="No change while |signal/target - 1| is within this.", minimum=0.0)
    period_seconds: int = _f(15, doc="How often the policy is evaluated.", minimum=1)
    stabilization_window_seconds: int = _f(
        60, doc="Scale down only to the highest recommendation within this window.", minimum=0
    )
    cooldown_seconds: int = _f(30, doc="No decision for this long after a reshard completes.", minimum=0)
    prometheus: PrometheusSpec | None = _f(
        None, doc="Read the signal from Prometheus; otherwise scrape the controller's /metrics."
    )
