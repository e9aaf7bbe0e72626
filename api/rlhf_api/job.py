"""`JobSpec`, the spec of an RLTrainingJob, its cross-field CEL rules, and what is derived from a
whole spec (the roles in use, the pods each role gets, the model length, the reward model's dtype);
`RLTrainingJob`, a loaded job.

Importable without torch, Ray or a Kubernetes client.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from rlhf_api import algorithm_params, algorithm_schema
from rlhf_api.contract import (
    CONTROLLER_ROLE,
    ROLES,
)
from rlhf_api.fields import IMPORT_PATH_RE, MAX_PODS_PER_JOB, _f, cel_int, cel_names
from rlhf_api.pods import ImagePullSecretSpec, PodSettingsSpec, VolumeSpec
from rlhf_api.roles import (
    _JOB_PODS_CEL,
    _PLACED_PODS,
    AutoscalingSpec,
    ControllerSpec,
    FailurePolicySpec,
    NodePoolSpec,
    RolesSpec,
    SchedulingSpec,
)
from rlhf_api.sections import (
    AlgorithmSpec,
    CheckpointSpec,
    DataSpec,
    EvalSpec,
    ModelSpec,
    OutputSpec,
    RewardModelSpec,
    RewardSpec,
    RolloutSpec,
    TrainingSpec,
)


@dataclass
class JobSpec:
    """The spec of an RLTrainingJob."""

    model: ModelSpec = _f(doc="The policy model.")
    data: DataSpec = _f(doc="Prompts.")
    reward: RewardSpec = _f(doc="Rewards.")
    algorithm: AlgorithmSpec = _f(AlgorithmSpec, doc="RL algorithm.")
    rollout: RolloutSpec = _f(RolloutSpec, doc="Sampling.")
    training: TrainingSpec = _f(TrainingSpec, doc="Optimisation.")
    checkpoint: CheckpointSpec = _f(CheckpointSpec, doc="Checkpoints.")
    output: OutputSpec = _f(OutputSpec, doc="Logs, metrics and report.")
    roles: RolesSpec = _f(RolesSpec, doc="Roles, replicas and placement.")
    eval: EvalSpec | None = _f(None, doc="Evaluation on held-out prompts (absent: none).")
    pipeline: str | None = _f(
        None,
        doc="Import path `package.module:build` of a function returning a custom DataStream.",
        pattern=IMPORT_PATH_RE,
        immutable=True,  # which roles get pods depends on it (`unused_roles`)
    )
    # Cluster-only sections: `rlhf run` validates them and ignores them.
    image: str = _f(
        "",
        doc="Trainer container image (cluster only); empty: the operator's default trainer image (the "
        "Helm chart's `trainerImage` values). A job without one on an operator without a default fails "
        "with the condition InvalidSpec.",
        cluster_only=True,
        immutable=True,
    )
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] | None = _f(
        None,
        doc="imagePullPolicy of every pod's container; unset: Kubernetes' default (Always for a `:latest` "
        "tag, otherwise IfNotPresent) (cluster only).",
        cluster_only=True,
        immutable=True,
    )
    image_pull_secrets: list[ImagePullSecretSpec] = _f(
        [], doc="Secrets every pod pulls the image with (cluster only).", cluster_only=True, immutable=True
    )
    pod: PodSettingsSpec = _f(
        PodSettingsSpec,
        doc="Env, labels, annotations and volumes of every pod of the job, the controller's included (cluster only).",
        cluster_only=True,
        immutable=True,
    )
    controller: ControllerSpec = _f(
        ControllerSpec,
        doc="The controller pod's resources, node pool and settings (cluster only).",
        cluster_only=True,
    )
    node_pools: list[NodePoolSpec] = _f(
        [], doc="Node pools the roles are placed on (cluster only).", cluster_only=True, immutable=True
    )
    scheduling: SchedulingSpec = _f(SchedulingSpec, doc="Gang scheduling (cluster only).", cluster_only=True)
    failure_policy: FailurePolicySpec = _f(
        FailurePolicySpec, doc="Restarts (cluster only).", cluster_only=True
    )
    autoscaling: AutoscalingSpec = _f(AutoscalingSpec, doc="Rollout autoscaling.")
    suspend: bool = _f(
        False,
        doc="Remove the pods, keeping checkpoints; set back to false to resume (cluster only).",
        cluster_only=True,
    )
    ttl_seconds_after_finished: int | None = _f(
        None,
        doc="Delete the job this long after it Succeeded or Failed (cluster only).",
        minimum=0,
        cluster_only=True,
    )

    # The job's cross-field rules, once: the API server enforces them, `rlhf validate` and the
    # loader evaluate the same expressions (`admission`). `fieldPath` makes the message name the field.
    CEL_RULES: ClassVar[list[tuple[Any, ...]]] = [
        (
            "self.roles.actor.replicas >= 1",
            "spec.roles.actor.replicas must be >= 1 (the actor trains the policy)",
            {
                "fieldPath": ".roles.actor.replicas",
                "messageExpression": "'spec.roles.actor.replicas must be >= 1 (the actor trains the policy); got ' + "
                + cel_int("self.roles.actor.replicas"),
            },
        ),
        (
            "!has(self.nodePools) || self.nodePools.all(p, self.nodePools.exists_one(q, q.name == p.name))",
            "spec.nodePools: names must be unique",
            {"fieldPath": ".nodePools"},
        ),
        *[
            (
                f"!has(self.{where}.nodePool)"
                f" || (has(self.nodePools) && self.nodePools.exists(p, p.name == self.{where}.nodePool))",
                f"spec.{where}.nodePool must name an entry of spec.nodePools",
                {
                    "fieldPath": f".{where}.nodePool",
                    "messageExpression": f"'spec.{where}.nodePool must name an entry of spec.nodePools: \"' + "
                    f"self.{where}.nodePool + '\" is not one; valid: ' + (has(self.nodePools) && "
                    "size(self.nodePools) > 0 ? " + cel_names("self.nodePools") + " : 'none defined')",
                },
            )
            for where in _PLACED_PODS
        ],
        (
            "self.training.miniBatchSize == 0 || (self.training.promptsPerStep * self.rollout.samplesPerPrompt)"
            " % self.training.miniBatchSize == 0",
            "spec.training.miniBatchSize must divide promptsPerStep × samplesPerPrompt",
            {
                "fieldPath": ".training.miniBatchSize",
                "messageExpression": "'spec.training.miniBatchSize must divide promptsPerStep × samplesPerPrompt = ' + "
                + cel_int("self.training.promptsPerStep * self.rollout.samplesPerPrompt")
                + " + ' responses (0: the whole batch); got ' + "
                + cel_int("self.training.miniBatchSize"),
            },
        ),
        (
            "self.rollout.engine != 'vllm' || self.roles.placement != 'disaggregated'"
            " || self.roles.rollout.resources.gpus >= 1",
            "spec.rollout.engine: vllm needs spec.roles.rollout.resources.gpus >= 1 (or engine: hf)",
            {"fieldPath": ".rollout.engine"},
        ),
        (
            "self.rollout.engine != 'vllm' || (self.roles.placement == 'disaggregated' ? "
            "self.roles.rollout.resources.gpus : self.roles.actor.resources.gpus) < 1 || "
            "self.rollout.tensorParallelSize <= (self.roles.placement == 'disaggregated' ? "
            "self.roles.rollout.resources.gpus : self.roles.actor.resources.gpus)",
            "spec.rollout.tensorParallelSize must be <= the GPUs of the pod that runs the engine",
            {
                "fieldPath": ".rollout.tensorParallelSize",
                "messageExpression": "'spec.rollout.tensorParallelSize must be <= the GPUs of the pod that runs the "
                "engine (' + (self.roles.placement == 'disaggregated' ? 'spec.roles.rollout.resources.gpus = ' + "
                + cel_int("self.roles.rollout.resources.gpus")
                + " : 'spec.roles.actor.resources.gpus = ' + "
                + cel_int("self.roles.actor.resources.gpus")
                + ") + '); got ' + "
                + cel_int("self.rollout.tensorParallelSize"),
            },
        ),
        (
            "self.rollout.maxStaleness == 0 || self.roles.placement == 'disaggregated'",
            "spec.rollout.maxStaleness > 0 needs spec.roles.placement: disaggregated (colocated rollouts "
            "share the actor's workers and cannot overlap training)",
            {
                "fieldPath": ".rollout.maxStaleness",
                "messageExpression": "'spec.rollout.maxStaleness: ' + "
                + cel_int("self.rollout.maxStaleness")
                + " + ' needs spec.roles.placement: disaggregated (colocated rollouts run in the actor "
                "workers and cannot overlap training); valid with colocated: 0'",
            },
        ),
        (
            "self.rollout.maxStaleness == 0 || (self.rollout.topP == 1.0 && self.rollout.topK == 0)",
            "spec.rollout.maxStaleness > 0 needs spec.rollout.topP: 1 and topK: 0 (the importance weight "
            "compares the trainer's log-probs with the engine's, which top-p/top-k renormalise); "
            "valid with topP < 1 or topK > 0: maxStaleness 0",
            {"fieldPath": ".rollout.maxStaleness"},
        ),
        algorithm_schema.group_size_rule(),
        algorithm_schema.reference_pods_rule(),
        (
            "!self.algorithm.dynamicSampling.enabled || self.rollout.samplesPerPrompt >= 2",
            "spec.algorithm.dynamicSampling.enabled needs spec.rollout.samplesPerPrompt >= 2 (a group of one "
            "has no reward variance: every group would be dropped)",
            {"fieldPath": ".algorithm.dynamicSampling.enabled"},
        ),
        (
            "!self.algorithm.rolloutCorrection.enabled || self.algorithm.name != 'online_dpo'",
            "spec.algorithm.rolloutCorrection.enabled: online_dpo has no policy-gradient term to weight; "
            "valid: a policy-gradient algorithm, or enabled: false",
            {"fieldPath": ".algorithm.rolloutCorrection.enabled"},
        ),
        (
            "!self.algorithm.rolloutCorrection.enabled || (self.rollout.topP == 1.0 && self.rollout.topK == 0)",
            "spec.algorithm.rolloutCorrection.enabled needs spec.rollout.topP: 1 and topK: 0 (the weight "
            "compares the trainer's log-probs with the engine's, which top-p/top-k renormalise)",
            {"fieldPath": ".algorithm.rolloutCorrection.enabled"},
        ),
        (
            # (with overlongMaxLength set, the algorithm's own rule compares the two)
            "!has(self.algorithm.params.overlongBufferLength) || has(self.algorithm.params.overlongMaxLength)"
            " || self.algorithm.params.overlongBufferLength < self.rollout.maxNewTokens",
            "spec.algorithm.params.overlongBufferLength must be < the longest response (overlongMaxLength, "
            "else spec.rollout.maxNewTokens)",
            {
                "fieldPath": ".algorithm.params.overlongBufferLength",
                "messageExpression": "'spec.algorithm.params.overlongBufferLength: ' + "
                + cel_int("self.algorithm.params.overlongBufferLength")
                + " + ' must be < the longest response (overlongMaxLength, else spec.rollout.maxNewTokens = ' + "
                + cel_int("self.rollout.maxNewTokens")
                + " + ')'",
            },
        ),
        (
            "self.algorithm.name != 'online_dpo' || self.rollout.samplesPerPrompt >= 2",
            "spec.rollout.samplesPerPrompt must be >= 2 for online_dpo (the best and worst samples of "
            "each prompt make its pair)",
            {
                "fieldPath": ".rollout.samplesPerPrompt",
                "messageExpression": "'spec.rollout.samplesPerPrompt must be >= 2 for online_dpo (the best and "
                "worst samples of each prompt make its pair); got ' + "
                + cel_int("self.rollout.samplesPerPrompt"),
            },
        ),
        (
            "!(self.algorithm.name in ['ppo', 'dynamic_kl_ppo']) || self.roles.critic.replicas >= 1",
            "spec.roles.critic.replicas must be >= 1 for ppo and dynamic_kl_ppo (they train a critic)",
            {
                "fieldPath": ".roles.critic.replicas",
                "messageExpression": "'spec.roles.critic.replicas must be >= 1 for ' + self.algorithm.name + "
                "' (it trains a critic); got 0'",
            },
        ),
        *[
            (
                f"self.{where}.pod.volumes.all(v, !self.pod.volumes.exists(w, w.{key} == v.{key}))",
                f"spec.{where}.pod.volumes: a {key} already used by spec.pod.volumes",
                {
                    "fieldPath": f".{where}.pod.volumes",
                    "messageExpression": f"'spec.{where}.pod.volumes: ' + self.{where}.pod.volumes.filter(v, "
                    f"self.pod.volumes.exists(w, w.{key} == v.{key})).map(v, v.{key}).join(', ') + "
                    f"' already used as a volume {key} in spec.pod.volumes'",
                },
            )
            for where in _PLACED_PODS
            for key in ("name", "mountPath")
        ],
        (
            f"{_JOB_PODS_CEL} <= {MAX_PODS_PER_JOB}",
            f"spec.roles: a job has at most {MAX_PODS_PER_JOB} pods (the controller, the replicas of every role "
            "and rollout.maxReplicas)",
            {
                "fieldPath": ".roles",
                "messageExpression": f"'spec.roles: a job has at most {MAX_PODS_PER_JOB} pods (the controller, "
                "the replicas of every role and rollout.maxReplicas); this one asks for ' + "
                + cel_int(_JOB_PODS_CEL)
                + " + ' pods'",
            },
        ),
        (
            "self.failurePolicy.maxBackoffSeconds >= self.failurePolicy.backoffSeconds",
            "spec.failurePolicy.maxBackoffSeconds must be >= backoffSeconds",
            {
                "fieldPath": ".failurePolicy.maxBackoffSeconds",
                "messageExpression": "'spec.failurePolicy.maxBackoffSeconds must be >= backoffSeconds (' + "
                + cel_int("self.failurePolicy.backoffSeconds")
                + " + '); got ' + "
                + cel_int("self.failurePolicy.maxBackoffSeconds"),
            },
        ),
    ]

    # -- pods (the operator builds them from these; `cluster_storage_findings` checks them) --------

    def settings_path(self, role: str) -> str:
        """Manifest path of the pod settings of `role`'s pods (`controller` for the controller pod)."""
        return "spec.controller.pod" if role == CONTROLLER_ROLE else f"spec.roles.{role}.pod"

    def pod_settings(self, role: str) -> list[tuple[str, PodSettingsSpec]]:
        """What is added to `role`'s pods, in the order it applies: `spec.pod`, then the role's own."""
        own = self.controller.pod if role == CONTROLLER_ROLE else getattr(self.roles, role).pod
        return [("spec.pod", self.pod), (self.settings_path(role), own)]

    def pod_volumes(self, role: str) -> list[VolumeSpec]:
        """The volumes the spec mounts into `role`'s pods."""
        return [v for _, settings in self.pod_settings(role) for v in settings.volumes]


def unused_roles(spec: JobSpec) -> dict[str, str]:
    """The roles this job runs no pods and no workers for, each with why, whatever their
    `replicas` say: the one rule of the operator (`roles_in_use`), `rlhf run` (the controller
    starts no worker of these) and `rlhf validate` (a note per role a manifest gave replicas).

    A built-in algorithm declares, torch-free, whether it trains a critic (`USES_CRITIC`) and
    whether its params read the reference policy (`uses_reference`: klCoef 0 does not); a custom
    algorithm or pipeline is not imported here, so its roles are all kept."""
    out: dict[str, str] = {}
    if spec.roles.placement != "disaggregated":
        out["rollout"] = "placement colocated: generation runs inside the actor workers"
    name = spec.algorithm.name
    params_cls = algorithm_params.BUILTIN_PARAMS.get(name)
    params = None
    if params_cls is not None and spec.pipeline is None:
        try:
            # (the params' rules are the job's CEL, evaluated by admission or the API server)
            params = params_cls.from_dict(spec.algorithm.params, rules=False)
        except ValueError:  # reported by the schema
            params = None
    if params is not None:
        if not params.USES_CRITIC:
            out["critic"] = f"algorithm {name} trains no critic"
        if not params.uses_reference():
            out["reference"] = f"algorithm {name} with klCoef 0: no KL term reads the reference policy"
    if reference_in_actor(spec):
        out["reference"] = (
            "spec.model.lora: the reference policy is the actor's base model with its adapters disabled"
        )
    return out


def roles_in_use(spec: JobSpec) -> dict[str, int]:
    """Pods per role, as the operator creates them: the controller, then every role with
    replicas that `unused_roles` does not drop."""
    unused = unused_roles(spec)
    counts = {CONTROLLER_ROLE: 1}
    for role in ROLES:
        n = getattr(spec.roles, role).replicas
        if n and role not in unused:
            counts[role] = n
    return counts


def dropped_role_notes(spec: JobSpec) -> list[str]:
    """`rlhf validate`'s notes: each role the manifest gives replicas that the job does not run."""
    return [
        f"spec.roles.{role}: no pods and no workers ({why}), whatever its replicas say"
        for role, why in unused_roles(spec).items()
        if role != "rollout" and getattr(spec.roles, role).replicas > 0
    ]


#: Pods per role (the storage checks' name for `roles_in_use`).
_pod_counts = roles_in_use


def reference_in_actor(spec: JobSpec) -> bool:
    """With LoRA (`spec.model.lora`) the reference policy is the actor's base model with its
    adapters disabled: the job runs no reference role (no pods, no workers), whatever
    `spec.roles.reference.replicas` says. The operator and the controller both ask this."""
    return spec.model.lora is not None


def max_model_length(spec: JobSpec) -> int:
    """The rollout engines' longest sequence: `rollout.maxModelLength`, else the longest prompt
    the data admits plus the longest response (what a step can ask for, and no more KV)."""
    rollout = spec.rollout
    # A multi-turn turn starts from a context of up to the episode's tokens and may run a whole turn.
    turn = rollout.max_new_tokens if rollout.multi_turn else 0
    return rollout.max_model_length or spec.data.max_prompt_length + max_response_length(spec) + turn


def max_response_length(spec: JobSpec) -> int:
    """The longest response of a sample: `rollout.maxNewTokens`, or a multi-turn episode's
    `rollout.multiTurn.maxTotalTokens` (every turn, the environment's tokens included)."""
    rollout = spec.rollout
    return rollout.multi_turn.max_total_tokens if rollout.multi_turn else rollout.max_new_tokens


def reward_model_dtype(spec: JobSpec, model: RewardModelSpec) -> str:
    """The dtype a reward model (`reward.model`, or one of `reward.models`) is loaded in: its own
    `dtype`, else `model.dtype`."""
    return model.load_dtype(spec.model.dtype)


@dataclass
class RLTrainingJob:
    """A whole manifest (apiVersion, kind, metadata, spec)."""

    metadata_name: str
    namespace: str
    spec: JobSpec
    raw: dict[str, Any]
