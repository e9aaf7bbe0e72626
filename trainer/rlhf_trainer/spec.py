"""The `spec` of an RLTrainingJob: one source of truth for `rlhf run`, the operator and the CRD.

Every section is a dataclass; every field carries its documentation and constraints in
`field(metadata=...)` (see `_f`). From these the module derives:

* the loader (`load_manifest`, `parse_job`, `parse_spec`): manifests use Kubernetes-style
  camelCase keys (`maxNewTokens`), fields are snake_case (`max_new_tokens`); an unknown key is an
  error naming its path and the valid keys; a wrong value names the field, the value and what is
  valid;
* the OpenAPI v3 schema of the CRD (`openapi_schema`), with a description on every field,
  defaults, enums, bounds, and `x-kubernetes-validations` (CEL) for immutable fields and
  cross-field rules (`CEL_RULES` on each class).

This module must stay importable without torch, Ray or a Kubernetes client.
"""

from __future__ import annotations

import dataclasses
import json
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal, Union, get_args, get_origin

import yaml

from rlhf_operator.labels import API_VERSION, KIND

#: Algorithms shipped with the library (`rlhf_trainer.algorithms`). A custom one is given by
#: import path, `my_pkg.algos:MyAlgo`.
BUILTIN_ALGORITHMS = ("ppo", "grpo", "rloo", "reinforce_plus_plus", "online_dpo", "dynamic_kl_ppo")
IMPORT_PATH_RE = r"^[A-Za-z_][A-Za-z0-9_.]*:[A-Za-z_][A-Za-z0-9_.]*$"
DNS_LABEL_RE = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
QUANTITY_RE = r"^([0-9]+(\.[0-9]+)?|\.[0-9]+)(m|k|Ki|M|Mi|G|Gi|T|Ti)?$"


class SpecError(ValueError):
    """An invalid manifest. `errors` holds one line per problem, each starting with the field path."""

    def __init__(self, errors: list[str]):
        self.errors = errors
        super().__init__("\n".join(f"  - {e}" for e in errors))


def _f(default: Any = dataclasses.MISSING, doc: str = "", **meta: Any) -> Any:
    """A documented field. `meta` keys: enum, minimum, maximum, exclusive_minimum, pattern,
    immutable (CEL `self == oldSelf` once the job exists), cluster_only, free_form (no schema)."""
    meta["doc"] = doc
    if isinstance(default, (list, dict)):
        value = default
        return field(default_factory=lambda: type(value)(value), metadata=meta)
    if dataclasses.is_dataclass(default) and isinstance(default, type):
        return field(default_factory=default, metadata=meta)
    return field(default=default, metadata=meta)


def camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(p[:1].upper() + p[1:] for p in rest)


# --------------------------------------------------------------------------------------------
# Sections
# --------------------------------------------------------------------------------------------


@dataclass
class ModelSpec:
    """The policy model. The actor, reference and rollout roles start from it; the critic too,
    with a value head."""

    path: str = _f(
        doc="Local directory (or hub id, on a cluster with a model cache) of the policy model.",
        immutable=True,
    )
    tokenizer: str | None = _f(None, doc="Tokenizer directory or hub id; defaults to `path`.", immutable=True)
    dtype: Literal["float32", "bfloat16", "float16"] = _f(
        "float32",
        doc="Parameter dtype for training and rollout. float32 on CPU; bfloat16 on GPUs.",
        immutable=True,
    )
    bootstrap: str | None = _f(
        None,
        doc="Name of a built-in recipe that creates a tiny model and tokenizer at `path` when that "
        "directory does not exist yet (the quickstart uses `tiny-arithmetic`). Never downloads anything.",
        immutable=True,
    )
    critic_path: str | None = _f(
        None, doc="Initial critic model; defaults to `path` with a fresh value head.", immutable=True
    )

    CEL_RULES: ClassVar[list[tuple[str, str]]] = [("size(self.path) > 0", "model.path must not be empty")]


@dataclass
class DataSpec:
    """Prompts. Every other column of a row is passed to reward functions as a keyword argument
    (for example the reference answer)."""

    path: str = _f(doc="A JSONL or Parquet file, or a folder saved by `datasets.Dataset.save_to_disk`.")
    format: Literal["auto", "jsonl", "parquet", "datasets"] = _f(
        "auto", doc="File format; `auto` decides by extension."
    )
    prompt_field: str = _f("prompt", doc="Column holding the prompt text (or a list of chat messages).")
    chat_template: bool = _f(False, doc="Apply the tokenizer's chat template to each prompt.")
    max_prompt_length: int = _f(
        256, doc="Prompts longer than this many tokens are handled per `overlongPrompts`.", minimum=1
    )
    overlong_prompts: Literal["skip", "error"] = _f(
        "skip", doc="`skip`: drop the prompt, count it and log it; `error`: stop the job naming the prompt."
    )
    shuffle: bool = _f(True, doc="Shuffle prompts each epoch (seeded by `training.seed`).")


@dataclass
class RewardFunctionSpec:
    """A Python reward: a function `f(prompts, responses, **columns) -> list[float]` or a class
    implementing the `RewardCalculator` protocol (`compute_reward(prompts, responses, **kw)`)."""

    path: str = _f(doc="Import path `package.module:name`.", pattern=IMPORT_PATH_RE)
    weight: float = _f(1.0, doc="Weight of this reward in the weighted sum.")
    kwargs: dict[str, Any] = _f({}, doc="Keyword arguments for a class reward's constructor.", free_form=True)


@dataclass
class RewardModelSpec:
    """A sequence-classification reward model (`AutoModelForSequenceClassification`, 1 label)."""

    path: str = _f(doc="Local directory of the reward model.")
    weight: float = _f(1.0, doc="Weight of the reward model's score in the weighted sum.")
    batch_size: int = _f(16, doc="Sequences scored per forward pass.", minimum=1)


@dataclass
class RewardSpec:
    """How responses are scored. Function rewards and a reward model may be combined."""

    functions: list[RewardFunctionSpec] = _f([], doc="Python reward functions, summed with their weights.")
    model: RewardModelSpec | None = _f(None, doc="Optional reward model, added with its weight.")
    on_error: Literal["skip", "penalty", "fail"] = _f(
        "skip",
        doc="When a reward raises or returns NaN/inf: `skip` drops the sample from the update (counted "
        "and logged with the sample); `penalty` gives it `errorPenalty` (counted and logged); `fail` stops the job.",
    )
    error_penalty: float = _f(-1.0, doc="Reward given to a failed sample when `onError: penalty`.")

    CEL_RULES: ClassVar[list[tuple[str, str]]] = [
        ("size(self.functions) > 0 || has(self.model)", "reward needs at least one function or a model")
    ]


@dataclass
class AlgorithmSpec:
    """The RL algorithm: a built-in name or an import path to an `Algorithm` subclass."""

    name: str = _f(
        "grpo",
        doc="One of " + ", ".join(BUILTIN_ALGORITHMS) + ", or `package.module:Class` for a custom algorithm.",
        immutable=True,
    )
    params: dict[str, Any] = _f(
        {},
        doc="Hyperparameters of the algorithm (for example clipRatioLow, klCoef, lossAggMode); "
        "checked by the algorithm itself, which names any unknown key.",
        free_form=True,
    )

    CEL_RULES: ClassVar[list[tuple[str, str]]] = [
        (
            "self.name in " + "[" + ", ".join(f"'{a}'" for a in BUILTIN_ALGORITHMS) + "]"
            f" || self.name.matches('{IMPORT_PATH_RE}')",
            "algorithm.name must be one of "
            + ", ".join(BUILTIN_ALGORITHMS)
            + " or an import path package.module:Class",
        )
    ]


@dataclass
class RolloutSpec:
    """Sampling of responses."""

    engine: Literal["hf", "vllm"] = _f("hf", doc="`hf` (transformers, CPU or GPU) or `vllm` (GPU only).")
    temperature: float = _f(1.0, doc="Sampling temperature; 0 means greedy.", minimum=0.0)
    top_p: float = _f(1.0, doc="Nucleus sampling mass, in (0, 1].", exclusive_minimum=0.0, maximum=1.0)
    top_k: int = _f(0, doc="Keep only the k most likely tokens; 0 disables.", minimum=0)
    max_new_tokens: int = _f(64, doc="Longest response, in tokens.", minimum=1)
    samples_per_prompt: int = _f(
        4, doc="Responses sampled per prompt (the group size of GRPO/RLOO).", minimum=1
    )
    tensor_parallel_size: int = _f(1, doc="Tensor-parallel degree of each rollout engine (vllm).", minimum=1)
    gpu_memory_utilization: float = _f(
        0.5, doc="Fraction of GPU memory a vllm engine may use.", exclusive_minimum=0.0, maximum=1.0
    )


@dataclass
class TrainingSpec:
    """The optimisation loop."""

    steps: int = _f(20, doc="Training steps (one rollout batch and its updates per step).", minimum=1)
    prompts_per_step: int = _f(
        8,
        doc="Prompts sampled per step; the batch holds promptsPerStep × samplesPerPrompt responses.",
        minimum=1,
    )
    mini_batch_size: int = _f(
        0, doc="Responses per optimizer step; 0 means the whole batch (one update per epoch).", minimum=0
    )
    micro_batch_size: int = _f(
        8, doc="Responses per forward/backward pass (gradient accumulation).", minimum=1
    )
    epochs_per_batch: int = _f(1, doc="Passes over each rollout batch (PPO epochs).", minimum=1)
    learning_rate: float = _f(1e-5, doc="Actor learning rate.", exclusive_minimum=0.0)
    critic_learning_rate: float = _f(1e-5, doc="Critic learning rate.", exclusive_minimum=0.0)
    lr_schedule: Literal["constant", "linear", "cosine"] = _f(
        "constant", doc="Learning-rate schedule after warm-up."
    )
    warmup_steps: int = _f(0, doc="Optimizer steps of linear warm-up.", minimum=0)
    weight_decay: float = _f(0.0, doc="AdamW weight decay.", minimum=0.0)
    grad_clip: float = _f(1.0, doc="Clip the global gradient norm to this value; 0 disables.", minimum=0.0)
    seed: int = _f(0, doc="Seed of every random generator (data order, sampling, initialisation).", minimum=0)


@dataclass
class CheckpointSpec:
    """Checkpoints: policy, critic, optimizers, schedulers, RNG states, data position, algorithm state."""

    dir: str | None = _f(
        None,
        doc="Checkpoint directory; defaults to `<output.dir>/checkpoints`. A shared volume on a cluster.",
    )
    every: int = _f(
        10, doc="Write a checkpoint every this many steps (and at the end); 0 only at the end.", minimum=0
    )
    keep: int = _f(2, doc="Complete checkpoints kept; older ones are deleted.", minimum=1)
    resume: bool = _f(True, doc="Resume from the latest complete checkpoint when one exists.")


@dataclass
class OutputSpec:
    """Where a run writes its logs, metrics and report."""

    dir: str = _f("runs/{name}", doc="Run directory; `{name}` is replaced by the job's name.")
    metrics_port: int = _f(
        0,
        doc="Port of the controller's Prometheus /metrics endpoint; 0 picks a free port (written to the run dir).",
        minimum=0,
        maximum=65535,
    )
    report: bool = _f(True, doc="Write report.html with plots at the end of the run.")
    progress: bool = _f(True, doc="Show a live progress bar on a terminal.")


@dataclass
class ResourcesSpec:
    """Resources of each pod of a role."""

    gpus: int = _f(0, doc="`nvidia.com/gpu` per pod (requests = limits).", minimum=0)
    cpu: str = _f("1", doc="CPU request per pod (Kubernetes quantity).", pattern=QUANTITY_RE)
    memory: str = _f(
        "4Gi", doc="Memory request and limit per pod (Kubernetes quantity).", pattern=QUANTITY_RE
    )
    shm: str = _f("1Gi", doc="Size of the memory-backed /dev/shm.", pattern=QUANTITY_RE)


@dataclass
class RoleSpec:
    """One role: `replicas` pods (or, locally, Ray workers), each a rank of the role's process group."""

    replicas: int = _f(
        1,
        doc="Pods of this role; each is one rank of the role's torch.distributed group.",
        minimum=0,
        immutable=True,
    )
    resources: ResourcesSpec = _f(ResourcesSpec, doc="Resources per pod.", immutable=True)
    node_pool: str | None = _f(
        None, doc="Name of an entry of `nodePools` to place the pods on.", immutable=True
    )


@dataclass
class RolloutRoleSpec:
    """The rollout fleet: elastic between `minReplicas` and `maxReplicas` (the CRD's /scale subresource)."""

    replicas: int = _f(
        1, doc="Current rollout engines (the /scale subresource: kubectl scale, HPA, KEDA).", minimum=0
    )
    min_replicas: int = _f(1, doc="Lower bound for autoscaling.", minimum=0)
    max_replicas: int = _f(1, doc="Upper bound for autoscaling.", minimum=1)
    resources: ResourcesSpec = _f(ResourcesSpec, doc="Resources per rollout pod.", immutable=True)
    node_pool: str | None = _f(
        None, doc="Name of an entry of `nodePools` to place the pods on.", immutable=True
    )

    CEL_RULES: ClassVar[list[tuple[str, str]]] = [
        ("self.minReplicas <= self.maxReplicas", "rollout.minReplicas must be <= rollout.maxReplicas"),
        (
            "self.replicas >= self.minReplicas && self.replicas <= self.maxReplicas",
            "rollout.replicas must lie in [minReplicas, maxReplicas]",
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


@dataclass
class SchedulingSpec:
    """Gang scheduling and queueing."""

    timeout_seconds: int = _f(
        300, doc="How long all of a gang's pods may wait to be scheduled before `Unschedulable`.", minimum=1
    )
    on_timeout: Literal["wait", "fail"] = _f(
        "wait", doc="After the timeout: keep waiting (reported) or fail the job."
    )
    scheduler_name: str | None = _f(None, doc="schedulerName of every pod.")
    priority_class_name: str | None = _f(None, doc="priorityClassName of every pod.")
    queue_name: str | None = _f(
        None, doc="Kueue LocalQueue; pods then carry Kueue's plain pod-group label and annotations."
    )
    pod_group: Literal["none", "scheduler-plugins", "volcano"] = _f(
        "none", doc="Also create a PodGroup for this gang scheduler."
    )


@dataclass
class FailurePolicySpec:
    """Restarts of the training gang."""

    max_restarts: int = _f(
        3, doc="Gang restarts from the last checkpoint before the job is Failed.", minimum=0
    )
    backoff_seconds: int = _f(10, doc="First restart delay; doubled after each restart.", minimum=0)
    max_backoff_seconds: int = _f(300, doc="Upper bound of the restart delay.", minimum=0)


@dataclass
class PrometheusSpec:
    """Where the autoscaler reads its signal."""

    url: str = _f(doc="Base URL of the Prometheus HTTP API, e.g. http://prometheus.monitoring:9090.")
    query: str | None = _f(
        None, doc="PromQL override for the signal; `{job}` and `{namespace}` are substituted."
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
    pipeline: str | None = _f(
        None,
        doc="Import path `package.module:build` of a function returning a custom DataStream.",
        pattern=IMPORT_PATH_RE,
    )
    # Cluster-only sections: `rlhf run` validates them and ignores them.
    image: str = _f(
        "ghcr.io/rlhf-operator/trainer:0.1.0",
        doc="Trainer container image (cluster only).",
        cluster_only=True,
    )
    node_pools: list[NodePoolSpec] = _f(
        [], doc="Node pools the roles are placed on (cluster only).", cluster_only=True
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

    # The CRD's counterparts of `validate` (the API server enforces them; messages name the field).
    CEL_RULES: ClassVar[list[tuple[str, str]]] = [
        (
            "self.roles.actor.replicas >= 1",
            "spec.roles.actor.replicas must be >= 1 (the actor trains the policy)",
        ),
        (
            "self.nodePools.all(p, self.nodePools.exists_one(q, q.name == p.name))",
            "spec.nodePools: names must be unique",
        ),
        *[
            (
                f"!has(self.roles.{role}.nodePool) || self.nodePools.exists(p, p.name == self.roles.{role}.nodePool)",
                f"spec.roles.{role}.nodePool must name an entry of spec.nodePools",
            )
            for role in ("actor", "critic", "reference", "reward", "rollout")
        ],
        (
            "self.training.miniBatchSize == 0 || (self.training.promptsPerStep * self.rollout.samplesPerPrompt)"
            " % self.training.miniBatchSize == 0",
            "spec.training.miniBatchSize must divide promptsPerStep × samplesPerPrompt",
        ),
        (
            "self.rollout.engine != 'vllm' || self.roles.placement != 'disaggregated'"
            " || self.roles.rollout.resources.gpus >= 1",
            "spec.rollout.engine: vllm needs spec.roles.rollout.resources.gpus >= 1",
        ),
        (
            "self.failurePolicy.maxBackoffSeconds >= self.failurePolicy.backoffSeconds",
            "spec.failurePolicy.maxBackoffSeconds must be >= backoffSeconds",
        ),
    ]

    def validate(self) -> list[str]:
        """Cross-field checks the schema cannot express per field; returns error lines."""
        errs: list[str] = []
        algo = self.algorithm.name
        if algo not in BUILTIN_ALGORITHMS and not re.match(IMPORT_PATH_RE, algo):
            errs.append(
                f"spec.algorithm.name: unknown algorithm {algo!r}; valid: {', '.join(BUILTIN_ALGORITHMS)} "
                "or an import path package.module:Class"
            )
        ro = self.roles.rollout
        if ro.min_replicas > ro.max_replicas:
            errs.append(
                f"spec.roles.rollout: minReplicas ({ro.min_replicas}) must be <= maxReplicas ({ro.max_replicas})"
            )
        elif not ro.min_replicas <= ro.replicas <= ro.max_replicas:
            errs.append(
                f"spec.roles.rollout.replicas: {ro.replicas} must lie in [minReplicas={ro.min_replicas}, maxReplicas={ro.max_replicas}]"
            )
        if not self.reward.functions and self.reward.model is None:
            errs.append("spec.reward: needs at least one entry in `functions` or a `model`")
        if self.roles.actor.replicas < 1:
            errs.append("spec.roles.actor.replicas: must be >= 1 (the actor trains the policy)")
        pools = {p.name for p in self.node_pools}
        if len(pools) != len(self.node_pools):
            errs.append("spec.nodePools: names must be unique")
        for role in ("actor", "critic", "reference", "reward", "rollout"):
            pool = getattr(self.roles, role).node_pool
            if pool is not None and pool not in pools:
                valid = ", ".join(sorted(pools)) or "none defined"
                errs.append(
                    f"spec.roles.{role}.nodePool: {pool!r} is not a name in spec.nodePools (defined: {valid})"
                )
        t = self.training
        batch = t.prompts_per_step * self.rollout.samples_per_prompt
        mini = t.mini_batch_size or batch
        if mini > batch or batch % mini:
            errs.append(
                f"spec.training.miniBatchSize: {t.mini_batch_size} must divide the batch of {batch} responses "
                f"(promptsPerStep {t.prompts_per_step} × samplesPerPrompt {self.rollout.samples_per_prompt})"
            )
        if (
            self.rollout.engine == "vllm"
            and self.roles.rollout.resources.gpus < 1
            and self.roles.placement == "disaggregated"
        ):
            errs.append(
                "spec.rollout.engine: vllm needs GPUs; set spec.roles.rollout.resources.gpus >= 1 or use engine `hf`"
            )
        if self.failure_policy.max_backoff_seconds < self.failure_policy.backoff_seconds:
            errs.append("spec.failurePolicy.maxBackoffSeconds: must be >= backoffSeconds")
        return errs


@dataclass
class RLTrainingJob:
    """A whole manifest (apiVersion, kind, metadata, spec)."""

    metadata_name: str
    namespace: str
    spec: JobSpec
    raw: dict[str, Any]


# --------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _unwrap_optional(tp: Any) -> tuple[Any, bool]:
    if get_origin(tp) in (Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        if len(args) == 1 and len(get_args(tp)) == 2:
            return args[0], True
    return tp, False


def _describe(tp: Any) -> str:
    tp, _ = _unwrap_optional(tp)
    if get_origin(tp) is Literal:
        return "one of " + ", ".join(repr(a) for a in get_args(tp))
    if dataclasses.is_dataclass(tp):
        return "a mapping"
    if get_origin(tp) is list:
        return "a list"
    if get_origin(tp) is dict:
        return "a mapping"
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false"}.get(tp, str(tp))


def _convert(tp: Any, value: Any, path: str, errs: list[str], meta: dict[str, Any]) -> Any:
    inner, optional = _unwrap_optional(tp)
    if value is None:
        if optional:
            return None
        errs.append(f"{path}: must not be null; expected {_describe(inner)}")
        return None
    origin = get_origin(inner)
    if dataclasses.is_dataclass(inner):
        if not isinstance(value, dict):
            errs.append(f"{path}: expected a mapping, got {value!r}")
            return None
        return _build(inner, value, path, errs)
    if origin is Literal:
        if value not in get_args(inner):
            errs.append(
                f"{path}: {value!r} is not valid; valid: {', '.join(str(a) for a in get_args(inner))}"
            )
        return value
    if origin is list:
        if not isinstance(value, list):
            errs.append(f"{path}: expected a list, got {value!r}")
            return []
        (item,) = get_args(inner)
        return [_convert(item, v, f"{path}[{i}]", errs, {}) for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            errs.append(f"{path}: expected a mapping, got {value!r}")
            return {}
        _, vt = get_args(inner)
        if vt is Any:
            return dict(value)
        return {k: _convert(vt, v, f"{path}.{k}", errs, {}) for k, v in value.items()}
    if inner is Any:
        return value
    ok = (
        (inner is bool and isinstance(value, bool))
        or (inner is int and isinstance(value, int) and not isinstance(value, bool))
        or (inner is float and isinstance(value, (int, float)) and not isinstance(value, bool))
        or (inner is str and isinstance(value, str))
    )
    if not ok:
        errs.append(f"{path}: {value!r} is not {_describe(inner)}")
        return value
    if inner is float:
        value = float(value)
    _check_bounds(value, path, errs, meta)
    return value


def _check_bounds(value: Any, path: str, errs: list[str], meta: dict[str, Any]) -> None:
    if "minimum" in meta and value < meta["minimum"]:
        errs.append(f"{path}: {value!r} is below the minimum {meta['minimum']}")
    if "exclusive_minimum" in meta and value <= meta["exclusive_minimum"]:
        errs.append(f"{path}: {value!r} must be greater than {meta['exclusive_minimum']}")
    if "maximum" in meta and value > meta["maximum"]:
        errs.append(f"{path}: {value!r} is above the maximum {meta['maximum']}")
    if "pattern" in meta and isinstance(value, str) and not re.match(meta["pattern"], value):
        errs.append(f"{path}: {value!r} does not match {meta['pattern']}")


def _build(cls: Any, data: dict[str, Any], path: str, errs: list[str]) -> Any:
    hints = _hints(cls)
    fields = {camel(f.name): f for f in dataclasses.fields(cls)}
    for key in data:
        if key not in fields:
            errs.append(f"{path}.{key}: unknown field; valid fields: {', '.join(fields)}")
    kwargs: dict[str, Any] = {}
    for key, f in fields.items():
        sub = f"{path}.{key}"
        if key in data:
            kwargs[f.name] = _convert(hints[f.name], data[key], sub, errs, dict(f.metadata))
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            errs.append(f"{sub}: required field is missing ({f.metadata.get('doc', '')})")
    try:
        return cls(**kwargs)
    except TypeError:
        return None  # missing required fields, already reported


def parse_spec(spec: dict[str, Any], path: str = "spec") -> JobSpec:
    """Build and validate a JobSpec from the `spec` mapping of a manifest. Raises SpecError."""
    errs: list[str] = []
    if not isinstance(spec, dict):
        raise SpecError([f"{path}: expected a mapping, got {spec!r}"])
    job = _build(JobSpec, spec, path, errs)
    if job is not None and not errs:
        errs.extend(job.validate())
    if errs:
        raise SpecError(errs)
    return typing.cast(JobSpec, job)


def parse_job(doc: dict[str, Any]) -> RLTrainingJob:
    """Validate a whole RLTrainingJob object (as read from YAML or the API server)."""
    errs = []
    if not isinstance(doc, dict):
        raise SpecError([f"manifest: expected a mapping, got {type(doc).__name__}"])
    if doc.get("apiVersion") != API_VERSION:
        errs.append(f"apiVersion: {doc.get('apiVersion')!r} is not valid; expected {API_VERSION!r}")
    if doc.get("kind") != KIND:
        errs.append(f"kind: {doc.get('kind')!r} is not valid; expected {KIND!r}")
    meta = doc.get("metadata") or {}
    name = meta.get("name")
    if not isinstance(name, str) or not re.match(DNS_LABEL_RE, name) or len(name) > 50:
        errs.append(
            f"metadata.name: {name!r} must be a DNS label of at most 50 characters (lowercase letters, digits, '-')"
        )
    for key in doc:
        if key not in ("apiVersion", "kind", "metadata", "spec", "status"):
            errs.append(f"{key}: unknown top-level field; valid: apiVersion, kind, metadata, spec")
    spec: JobSpec | None = None
    try:
        spec = parse_spec(doc.get("spec"))  # type: ignore[arg-type]
    except SpecError as err:
        errs.extend(err.errors)
    if errs or spec is None:
        raise SpecError(errs)
    return RLTrainingJob(
        metadata_name=str(name), namespace=meta.get("namespace") or "default", spec=spec, raw=doc
    )


def load_manifest(path: str | Path) -> RLTrainingJob:
    """Read a YAML file holding one RLTrainingJob. Raises SpecError with every problem found."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as err:
        raise SpecError([f"{p}: cannot read the manifest: {err.strerror}"]) from err
    try:
        docs = [d for d in yaml.safe_load_all(text) if d is not None]
    except yaml.YAMLError as err:
        raise SpecError([f"{p}: not valid YAML: {err}"]) from err
    jobs = [d for d in docs if isinstance(d, dict) and d.get("kind") == KIND]
    if len(jobs) != 1:
        raise SpecError([f"{p}: expected exactly one {KIND} document, found {len(jobs)}"])
    return parse_job(jobs[0])


def to_dict(obj: Any) -> Any:
    """The camelCase mapping of a spec object (defaults filled in), as it would appear in a manifest."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {
            camel(f.name): to_dict(getattr(obj, f.name))
            for f in dataclasses.fields(obj)
            if getattr(obj, f.name) is not None
        }
    if isinstance(obj, list):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj


# --------------------------------------------------------------------------------------------
# OpenAPI schema for the CRD
# --------------------------------------------------------------------------------------------


def _schema_for(tp: Any, meta: dict[str, Any]) -> dict[str, Any]:
    inner, optional = _unwrap_optional(tp)
    out: dict[str, Any] = {}
    origin = get_origin(inner)
    if meta.get("free_form"):
        out = {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
        if origin is list:
            out = {"type": "array", "items": {"type": "object", "x-kubernetes-preserve-unknown-fields": True}}
    elif dataclasses.is_dataclass(inner):
        out = openapi_schema(inner)
    elif origin is Literal:
        out = {"type": "string", "enum": list(get_args(inner))}
    elif origin is list:
        (item,) = get_args(inner)
        out = {"type": "array", "items": _schema_for(item, {})}
    elif origin is dict:
        _, vt = get_args(inner)
        out = {"type": "object", "additionalProperties": _schema_for(vt, {})}
    else:
        out = {
            bool: {"type": "boolean"},
            int: {"type": "integer", "format": "int64"},
            float: {"type": "number"},
            str: {"type": "string"},
        }[inner]
        out = dict(out)
    if "minimum" in meta:
        out["minimum"] = meta["minimum"]
    if "exclusive_minimum" in meta:
        out["minimum"] = meta["exclusive_minimum"]
        out["exclusiveMinimum"] = True
    if "maximum" in meta:
        out["maximum"] = meta["maximum"]
    if "pattern" in meta:
        out["pattern"] = meta["pattern"]
    if optional and not dataclasses.is_dataclass(inner):
        out["nullable"] = True
    return out


def openapi_schema(cls: Any = JobSpec) -> dict[str, Any]:
    """Structural OpenAPI v3 schema of a spec class, with descriptions, defaults, enums, bounds and CEL rules."""
    hints = _hints(cls)
    props: dict[str, Any] = {}
    required: list[str] = []
    for f in dataclasses.fields(cls):
        meta = dict(f.metadata)
        schema = _schema_for(hints[f.name], meta)
        schema["description"] = meta["doc"] + (
            " Immutable once the job exists." if meta.get("immutable") else ""
        )
        if f.default is not dataclasses.MISSING and f.default is not None:
            schema["default"] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = to_dict(f.default_factory())
            if default not in ({}, []) and not dataclasses.is_dataclass(hints[f.name]):
                schema["default"] = default
            elif dataclasses.is_dataclass(_unwrap_optional(hints[f.name])[0]):
                schema["default"] = {}
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            required.append(camel(f.name))
        if meta.get("immutable"):
            schema.setdefault("x-kubernetes-validations", []).append(
                {"rule": "self == oldSelf", "message": f"{camel(f.name)} is immutable once the job exists"}
            )
        props[camel(f.name)] = schema
    out: dict[str, Any] = {
        "type": "object",
        "description": (cls.__doc__ or "").strip().split("\n\n")[0],
        "properties": props,
    }
    if required:
        out["required"] = required
    rules = getattr(cls, "CEL_RULES", [])
    if rules:
        out["x-kubernetes-validations"] = [{"rule": r, "message": m} for r, m in rules]
    return out


# --------------------------------------------------------------------------------------------
# Manifest reference (docs/manifest-reference.md is generated from this)
# --------------------------------------------------------------------------------------------


def reference_markdown() -> str:
    """A Markdown table per section: field, type, default, description. `rlhf crd --reference` prints it."""
    lines = [
        "# RLTrainingJob manifest reference",
        "",
        "Generated from `trainer/rlhf_trainer/spec.py` by `rlhf validate --reference`; do not edit by hand.",
        "Keys are camelCase. Cluster-only fields are validated by `rlhf run` and otherwise ignored there.",
        "",
    ]

    def section(cls: Any, path: str) -> None:
        hints = _hints(cls)
        lines.extend(
            [
                f"## `{path}`",
                "",
                (cls.__doc__ or "").strip(),
                "",
                "| field | type | default | description |",
                "|---|---|---|---|",
            ]
        )
        nested: list[tuple[Any, str]] = []
        for f in dataclasses.fields(cls):
            tp, _ = _unwrap_optional(hints[f.name])
            key = camel(f.name)
            if f.default is not dataclasses.MISSING:
                default = "—" if f.default is None else f"`{json.dumps(f.default)}`"
            elif f.default_factory is not dataclasses.MISSING:
                value = to_dict(f.default_factory())
                default = "see below" if dataclasses.is_dataclass(tp) else f"`{json.dumps(value)}`"
            else:
                default = "**required**"
            doc = f.metadata["doc"] + (" *Immutable.*" if f.metadata.get("immutable") else "")
            lines.append(f"| `{key}` | {_describe(hints[f.name])} | {default} | {doc} |")
            item = get_args(tp)[0] if get_origin(tp) is list else tp
            if dataclasses.is_dataclass(item):
                nested.append((item, f"{path}.{key}" + ("[]" if item is not tp else "")))
        lines.append("")
        for sub, sub_path in nested:
            section(sub, sub_path)

    section(JobSpec, "spec")
    return "\n".join(lines).rstrip() + "\n"
