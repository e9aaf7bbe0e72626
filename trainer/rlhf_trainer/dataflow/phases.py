"""The phases of a training step, each a short function of the context and the batch.

    prompts = sample_prompts(ctx)                    # data
    batch   = generate(ctx, prompts)                 # rollout
    batch   = score(ctx, batch)                      # reward
    batch   = reference_log_probs(ctx, batch, algo)  # reference   (algorithms with a KL term)
    batch   = critic_values(ctx, batch, algo)        # critic      (algorithms with a critic)
    batch   = drop_stale(ctx, batch)                 # staleness  (asynchronous rollouts: older than maxStaleness out)
    batch   = policy_log_probs(ctx, batch, algo)     # old log-probs (when the batch is reused)
    batch   = behaviour_log_probs(ctx, batch)        # stale samples: the engine's log-probs, for the IS weight
    batch   = greedy_baseline(ctx, batch, algo)      # baseline    (ReMax: greedy responses' rewards)
    batch   = compute_advantages(ctx, batch, algo)   # advantage
    batch   = update_policy(ctx, batch, algo)        # update
    reshard_if_needed(ctx, metrics)                  # elastic rollout (fleet.elastic boundary)
    sync_weights(ctx)                                # weight sync
    metrics, batches = evaluate(ctx, eval_prompts)   # evaluation (every eval.every steps)

The operators of `dataflow.operators` call these; the controller's loop calls the stream.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from rlhf_api.job import reference_in_actor
from rlhf_trainer.dataflow.batch import StepBatch
from rlhf_trainer.dataflow.context import TrainerContext

log = logging.getLogger(__name__)

#: Keys sent to training and scoring workers (texts and bookkeeping stay on the controller).
WORKER_KEYS = (
    "prompt_ids",
    "prompt_mask",
    "response_ids",
    "response_mask",
    "old_log_probs",
    "ref_log_probs",
    "old_values",
    "advantages",
    "returns",
    "scores",
    "group_index",
    "token_rewards",
    "chosen",
    "pair_index",
    "branch_index",
    "behaviour_log_probs",
    # The engine's log-probs of the sampled tokens: the actor logs how far its own are from them
    # (`rollout/logprob_mismatch`, `ActorWorker.micro_loss`).
    "rollout_log_probs",
    # (B,) bool: the response hit maxNewTokens without an end-of-sequence token (a loss may read it).
    "truncated",
    # (B, T): the rollout correction's importance weights (`rollout_correction`).
    "is_weights",
    # (B, T) multi-turn: 1 on the environment's tokens, attended to but not trained on.
    "observation_mask",
)


def _split(n: int, parts: int) -> list[range]:
    """`n` items as `parts` contiguous ranges (empty ones dropped)."""
    bounds = torch.tensor_split(torch.arange(n), parts)
    return [range(int(b[0]), int(b[-1]) + 1) for b in bounds if len(b)]


def worker_batch(batch: StepBatch) -> dict[str, Tensor]:
    return {k: v for k, v in batch.tensors.items() if k in WORKER_KEYS}


def sample_prompts(ctx: TrainerContext) -> list[Any]:
    """The step's prompts (`data.PromptItem`s); overlong ones are skipped and counted by the dataset."""
    return list(ctx.dataset.next_batch(ctx.spec.training.prompts_per_step))


def generate(
    ctx: TrainerContext,
    prompts: list[Any],
    n: int | None = None,
    greedy: bool = False,
    step: int | None = None,
    temperature: float | None = None,
) -> StepBatch:
    """Sample `n` (default `samplesPerPrompt`) responses per prompt on the generators, prompts
    split between them; `greedy`: temperature 0 (ReMax's baseline responses); `temperature`: in
    place of `rollout.temperature` (the evaluation's own). `step` (default the running one)
    seeds the sampling: a rollout generated ahead passes the step it is for."""
    from rlhf_trainer.rollout import RolloutBatch, decode_responses

    n = ctx.spec.rollout.samples_per_prompt if n is None else n
    step = ctx.step if step is None else step
    if ctx.fleet is not None:  # disaggregated: replicas lease prompts from the fleet's queue
        from rlhf_trainer.fleet.leasing import rollout_tensors

        rollout, version = rollout_tensors(
            *ctx.fleet.generate(prompts, n, step, greedy=greedy, temperature=temperature)
        )
    else:
        group = ctx.generators()
        chunks = _split(len(prompts), len(group))
        outputs = group.call_each(
            "generate",
            [([prompts[i].ids for i in c], n, step) for c in chunks],
            greedy=greedy,
            temperature=temperature,
        )
        versions = [out.pop("policy_version", None) for out in outputs]
        parts = [RolloutBatch.from_dict(out) for out in outputs]
        rollout = RolloutBatch.concat(parts, offset_prompt_index=True)
        version = torch.cat(
            [
                v if v is not None else torch.full((len(p),), ctx.policy_version)
                for v, p in zip(versions, parts)
            ]
        )
    items = [prompts[i] for i in rollout.prompt_index]
    tensors = {
        "prompt_ids": rollout.prompt_ids,
        "prompt_mask": rollout.prompt_mask,
        "response_ids": rollout.response_ids,
        "response_mask": rollout.response_mask.float(),
        "rollout_log_probs": rollout.log_probs,
        "group_index": torch.tensor(rollout.prompt_index, dtype=torch.long),
        "policy_version": version.long(),
    }
    lengths = rollout.response_mask.sum(-1)
    tensors["truncated"] = truncated_rows(rollout, ctx.spec.rollout.max_new_tokens)
    metrics = {
        "rollout/samples": float(len(rollout)),
        "rollout/tokens": float(lengths.sum()),
        "rollout/response_length": float(lengths.float().mean()),
        "rollout/policy_version_lag": float(ctx.policy_version - version.float().mean()),
    }
    if rollout.finished is not None:
        metrics["rollout/finished_fraction"] = float(rollout.finished.float().mean())
    if rollout.observation_mask is not None:  # multi-turn episodes
        from rlhf_trainer.rollout.multiturn import episode_metrics

        tensors.update(observation_mask=rollout.observation_mask, turn_rewards=rollout.turn_rewards)
        tensors["turns"] = rollout.turns
        metrics.update(episode_metrics(rollout))
    metrics["rollout/truncated_fraction"] = (
        float(tensors["truncated"].float().mean()) if len(rollout) else 0.0
    )
    return StepBatch(
        tensors=tensors,
        prompts=[it.text for it in items],
        responses=decode_responses(rollout, ctx.tokenizer),
        columns=[dict(it.columns) for it in items],
        metrics=metrics,
        messages=[it.messages for it in items],
    )


def truncated_rows(rollout: Any, max_new_tokens: int) -> Tensor:
    """(B,) bool: the response was cut at `max_new_tokens` without an end-of-sequence token. The
    engine says so (`RolloutBatch.finished`: EOS seen, hf; finish reason `stop`, vllm); an engine
    that does not is judged by length (a response of the full budget counts as truncated)."""
    if rollout.finished is not None:
        return ~rollout.finished.bool()
    return rollout.response_mask.sum(-1) >= max_new_tokens


def reward_columns(batch: StepBatch, tokenizer: Any = None) -> list[dict[str, Any]]:
    """Each row's columns as reward functions get them: the prompt's dataset columns plus what the
    rollout knows of the response (`rewards.RESPONSE_COLUMNS`: `truncated`, `response_length`),
    which win over a dataset column of the same name."""
    from rlhf_trainer.rewards import RESPONSE_COLUMNS

    columns = batch.columns or [{} for _ in range(len(batch))]
    lengths = batch["response_mask"].sum(-1).long().tolist()
    truncated = batch["truncated"].tolist() if "truncated" in batch else [None] * len(batch)
    truncated_key, length_key = RESPONSE_COLUMNS
    rows = [
        {**c, truncated_key: None if t is None else bool(t), length_key: int(n)}
        for c, t, n in zip(columns, truncated, lengths)
    ]
    if "observation_mask" in batch:  # multi-turn: the episode columns (`rollout.multiturn.EPISODE_COLUMNS`)
        from rlhf_trainer.rollout.multiturn import episode_columns

        rows = [{**r, **e} for r, e in zip(rows, episode_columns(batch, tokenizer))]
    return rows


def score(ctx: TrainerContext, batch: StepBatch, rewards: str = "job") -> StepBatch:
    """Rewards for every sample, rows split between the reward workers; `rewards`: the reward
    set (`workers.reward.JOB_REWARDS`, or `EVAL_REWARDS`: the evaluation's own functions).

    Failures follow `reward.onError` inside `CombinedReward`: `fail` raises (the job stops, naming
    the sample), `skip` marks the sample invalid (`reward_valid` False, its score 0 here:
    `RewardOperator` drops it with `drop_invalid_rewards`), `penalty` gives it `errorPenalty`.
    Each failure is logged with its sample here.
    """
    chunks = _split(len(batch), len(ctx.reward))
    messages = batch.messages or [None] * len(batch)
    columns = reward_columns(batch, ctx.tokenizer if "observation_mask" in batch else None)
    results = ctx.reward.call_each(
        "score",
        [
            (
                [batch.prompts[i] for i in c],
                [batch.responses[i] for i in c],
                [columns[i] for i in c],
                [messages[i] for i in c],
                rewards,
            )
            for c in chunks
        ],
    )
    scores = torch.cat([torch.as_tensor(r.scores, dtype=torch.float32) for r in results])
    valid = torch.cat([torch.as_tensor(r.valid, dtype=torch.bool) for r in results])
    errors = [e for r in results for e in (r.errors or [])]
    for err in errors[:5]:  # CombinedReward logs each one with its sample; say which step it was
        log.warning("step %d: %s", ctx.step, err)
    if "turn_rewards" in batch:  # multi-turn: the environment's rewards join the episode's score
        from rlhf_trainer.rollout.multiturn import add_environment_rewards

        scores = add_environment_rewards(batch, scores)
    batch["scores"] = torch.where(valid, scores, torch.zeros_like(scores))
    batch["reward_valid"] = valid
    ok = scores[valid]
    batch.metrics.update(
        {
            "reward/mean": float(ok.mean()) if len(ok) else float("nan"),
            "reward/std": float(ok.std()) if len(ok) > 1 else 0.0,
            "reward/max": float(ok.max()) if len(ok) else float("nan"),
            "reward/min": float(ok.min()) if len(ok) else float("nan"),
            "reward/errors": float(len(errors)),
            "reward/invalid": float((~valid).sum()),
        }
    )
    for r in results[:1]:
        for name in getattr(r, "per_reward", {}) or {}:
            values = torch.cat([torch.as_tensor(x.per_reward[name], dtype=torch.float32) for x in results])
            batch.metrics[f"reward/{name}"] = float(values[valid].mean()) if valid.any() else float("nan")
    return batch


def drop_invalid_rewards(batch: StepBatch) -> StepBatch:
    """The samples whose reward failed (`reward_valid` False, `reward.onError: skip`) out of the
    batch, counted in `reward/dropped` (summed when called again). Under `onError: penalty` a
    failed sample is valid with its penalty, under `fail` the reward phase has raised: so no
    failed reward ever reaches an update, whatever operators a stream puts between the reward
    and the update (`RewardOperator` calls this, and every update operator again)."""
    if "reward_valid" not in batch:
        return batch
    valid = batch["reward_valid"].bool()
    dropped = int((~valid).sum())
    if dropped:
        batch = batch.select(valid)
    batch.metrics["reward/dropped"] = batch.metrics.get("reward/dropped", 0.0) + dropped
    return batch


def greedy_baseline(ctx: TrainerContext, batch: StepBatch, algorithm: Any) -> StepBatch:
    """`baseline_scores` (B,) for algorithms that `needs_baseline` (ReMax): one greedy response
    per prompt of the batch, generated by the policy that sampled the step (no update happened
    since) and scored with the job's rewards; each sample gets its prompt's greedy reward (a
    failed greedy reward counts as 0, in `baseline/invalid`)."""
    from rlhf_trainer.data import PromptItem

    if not getattr(algorithm, "needs_baseline", False) or "baseline_scores" in batch:
        return batch
    groups, inverse = torch.unique(batch["group_index"], return_inverse=True)  # (G,), (B,)
    first = torch.full((len(groups),), len(batch), dtype=torch.long).scatter_reduce(
        0, inverse, torch.arange(len(batch)), reduce="amin"
    )  # (G,): a row of each prompt
    items = []
    for g, row in enumerate(first.tolist()):
        ids = batch["prompt_ids"][row][batch["prompt_mask"][row].bool()].tolist()
        columns = batch.columns[row] if batch.columns else {}
        messages = batch.messages[row] if batch.messages else None
        items.append(
            PromptItem(index=g, text=batch.prompts[row], ids=ids, columns=dict(columns), messages=messages)
        )
    greedy = score(ctx, generate(ctx, items, n=1, greedy=True))
    by_prompt = torch.zeros(len(groups))
    by_prompt[greedy["group_index"]] = greedy["scores"].float()  # (G,)
    batch["baseline_scores"] = by_prompt[inverse]  # (B,)
    batch.metrics["baseline/reward_mean"] = float(by_prompt.mean())
    batch.metrics["baseline/response_length"] = greedy.metrics["rollout/response_length"]
    batch.metrics["baseline/invalid"] = greedy.metrics["reward/invalid"]
    return batch


def reference_log_probs(ctx: TrainerContext, batch: StepBatch, algorithm: Any) -> StepBatch:
    """`ref_log_probs` from the frozen reference policy, when the algorithm has a KL term: the
    reference role, or with LoRA the actor's own base model (`spec.reference_in_actor`)."""
    if not algorithm.needs_reference or "ref_log_probs" in batch:
        return batch
    if reference_in_actor(ctx.spec):  # LoRA: the actor's base model, adapters disabled
        batch["ref_log_probs"] = _score_rows(ctx.actor, "compute_ref_log_probs", batch)
        return batch
    if ctx.reference is None:
        raise RuntimeError(f"algorithm {algorithm.name!r} needs a reference policy, but the job runs none")
    batch["ref_log_probs"] = _score_rows(ctx.reference, "compute_log_probs", batch, independent=True)
    return batch


def critic_values(ctx: TrainerContext, batch: StepBatch, algorithm: Any) -> StepBatch:
    """`old_values` from the critic, for algorithms with a critic (GAE)."""
    if not algorithm.needs_critic or "old_values" in batch:
        return batch
    if ctx.critic is None:
        raise RuntimeError(f"algorithm {algorithm.name!r} needs a critic, but the job runs none")
    batch["old_values"] = _score_rows(ctx.critic, "compute_values", batch) * batch["response_mask"]
    return batch


def drop_stale(ctx: TrainerContext, batch: StepBatch) -> StepBatch:
    """Asynchronous rollouts: the samples whose generating policy is more than
    `rollout.maxStaleness` versions behind the policy about to train are never trained on; they
    are dropped and counted (`offpolicy/dropped`). When none is left the step's prompts are
    generated again by the current weights. Metrics: `offpolicy/staleness_mean` and
    `offpolicy/staleness_max` of the samples kept (asserted <= the bound), `rollout/policy_version_lag`."""
    from rlhf_trainer.algorithms.off_policy import stale_rows, staleness

    bound = ctx.spec.rollout.max_staleness
    old = stale_rows(batch["policy_version"], ctx.policy_version, bound)  # (B,)
    dropped = int(old.sum())
    if dropped == len(batch) and dropped:
        log.warning(
            "step %d: all %d samples are more than %d policy versions old; generating them again",
            ctx.step, dropped, bound,
        )  # fmt: skip
        prompts = sample_prompts_of(batch)
        fresh = generate(ctx, prompts)
        fresh.metrics = {**batch.metrics, **fresh.metrics}
        batch = fresh
    elif dropped:
        batch = batch.select(~old)
    lag = staleness(batch["policy_version"], ctx.policy_version).float()  # (B,)
    if bool((lag > bound).any()):
        raise AssertionError(
            f"step {ctx.step}: a sample {int(lag.max())} versions old survived maxStaleness {bound}"
        )
    batch.metrics["offpolicy/dropped"] = float(dropped)
    batch.metrics["offpolicy/staleness_mean"] = float(lag.mean()) if len(lag) else 0.0
    batch.metrics["offpolicy/staleness_max"] = float(lag.max()) if len(lag) else 0.0
    if len(batch):
        batch.metrics["offpolicy/behaviour_version_min"] = float(batch["policy_version"].min())
    batch.metrics["rollout/policy_version_lag"] = batch.metrics["offpolicy/staleness_mean"]
    return batch


def sample_prompts_of(batch: StepBatch) -> list[Any]:
    """The distinct prompts of `batch` as `data.PromptItem`s (in `group_index` order)."""
    from rlhf_trainer.data import PromptItem

    items: dict[int, Any] = {}
    for row, g in enumerate(batch["group_index"].tolist()):
        if g not in items:
            ids = batch["prompt_ids"][row][batch["prompt_mask"][row].bool()].tolist()
            items[g] = PromptItem(
                index=g,
                text=batch.prompts[row],
                ids=ids,
                columns=dict(batch.columns[row]) if batch.columns else {},
                messages=batch.messages[row] if batch.messages else None,
            )
    return [items[g] for g in sorted(items)]


def is_stale(ctx: TrainerContext, batch: StepBatch) -> bool:
    """Some sample of `batch` was generated by an older policy than the one about to train."""
    return "policy_version" in batch and bool((batch["policy_version"] < ctx.policy_version).any())


def policy_log_probs(ctx: TrainerContext, batch: StepBatch, algorithm: Any) -> StepBatch:
    """`old_log_probs` from the training policy, when they can differ from the log-probs the
    update computes or are needed before it.

    `old_log_probs_needed` says when: the batch is trained on more than once (several epochs or
    mini-batches: the weights move between optimizer steps) or the advantage reads them (a KL
    penalty in the reward). Otherwise no weight changes between this pass and the update's one
    forward pass, so they are the update's own log-probs, detached (ratio exactly 1): the actor
    takes those (`ActorWorker.micro_loss`) and this forward pass is saved. The step's metrics say
    which: `update/old_log_probs_skipped` 1.0 when saved, 0.0 when computed.

    A stale batch (asynchronous rollouts) follows the same rule: its old log-probs are the
    proximal policy's of the decoupled loss (the current weights before the update), which the
    update's own detached log-probs are when the batch is trained in one optimizer step; the
    off-policy correction against the behaviour policy is the actor's importance weight
    (`behaviour_log_probs`), computed from whichever old log-probs the loss uses.
    """
    if "old_log_probs" in batch:
        return batch
    if not old_log_probs_needed(ctx, len(batch), algorithm):
        batch.metrics.setdefault("update/old_log_probs_skipped", 1.0)
        return batch
    batch["old_log_probs"] = _score_rows(ctx.actor, "compute_log_probs", batch) * batch["response_mask"]
    batch.metrics["update/old_log_probs_skipped"] = 0.0
    return batch


def behaviour_log_probs(ctx: TrainerContext, batch: StepBatch) -> StepBatch:
    """A stale batch (asynchronous rollouts): `behaviour_log_probs` (B, T), the rollout engine's
    log-probs of the sampled tokens under the version that generated them (`rollout_log_probs`).
    The actor weights each token's policy-gradient term by min(pi_prox / pi_behav,
    `importanceWeightCap`) (`algorithms.off_policy`, `ActorWorker.micro_loss`). A batch of the
    current policy gets none: today's on-policy loss, unchanged."""
    if "behaviour_log_probs" in batch or not is_stale(ctx, batch) or correction_on(ctx):
        return batch  # (the rollout correction weighs every batch against the engine itself)
    if "rollout_log_probs" not in batch:
        raise RuntimeError("behaviour_log_probs: the stale batch has no rollout_log_probs (behaviour policy)")
    batch["behaviour_log_probs"] = batch["rollout_log_probs"].float() * batch["response_mask"]
    return batch


def correction_on(ctx: TrainerContext) -> bool:
    """`spec.algorithm.rolloutCorrection.enabled`."""
    return bool(ctx.spec.algorithm.rollout_correction.enabled)


def rollout_correction(ctx: TrainerContext, batch: StepBatch) -> StepBatch:
    """`is_weights` (B, T): the truncated importance weights of the trainer's log-probs
    (`old_log_probs`, which `policy_log_probs` computes whenever the correction is on) over the
    rollout engine's (`rollout_log_probs`), per `spec.algorithm.rolloutCorrection`
    (`algorithms.off_policy.rollout_importance_weights`); the policy-gradient loss multiplies the
    advantages by them. Their statistics go to the step's metrics (`rollout/is_weight_*`)."""
    from rlhf_trainer.algorithms.off_policy import rollout_importance_weights

    spec = ctx.spec.algorithm.rollout_correction
    if not spec.enabled or "is_weights" in batch or not len(batch):
        return batch
    for key in ("old_log_probs", "rollout_log_probs"):
        if key not in batch:
            raise RuntimeError(f"rollout_correction: the batch has no {key!r}")
    weights, metrics = rollout_importance_weights(
        batch["old_log_probs"].float(),
        batch["rollout_log_probs"].float(),
        batch["response_mask"],
        cap=spec.cap,
        level=spec.level,
        mode=spec.mode,
    )
    batch["is_weights"] = weights
    batch.metrics.update(metrics)
    return batch


def old_log_probs_needed(ctx: TrainerContext, rows: int, algorithm: Any) -> bool:
    """The old-log-prob pass is needed: the update makes several optimizer steps over the batch
    (`epochsPerBatch` > 1, or `miniBatchSize` below the batch's rows), or the algorithm's
    advantages read `old_log_probs` (`advantages_read_old_log_probs`: a KL penalty in the reward)."""
    t = ctx.spec.training
    reused = t.epochs_per_batch > 1 or bool(t.mini_batch_size and t.mini_batch_size < rows)
    if correction_on(ctx):  # the importance weights compare them with the engine's
        return True
    return reused or bool(getattr(algorithm, "advantages_read_old_log_probs", algorithm.needs_reference))


def compute_advantages(ctx: TrainerContext, batch: StepBatch, algorithm: Any) -> StepBatch:
    """The algorithm's advantages (or pairs). When it returns `train_rows` (B,) bool (online
    DPO: the samples that belong to a pair), only those rows go on to the update; the others
    are counted in `update/untrained_samples`."""
    out = algorithm.compute_advantages(batch.algorithm_batch())
    for key, value in out.items():
        if isinstance(value, Tensor):
            batch[key] = value
        elif isinstance(value, (int, float)) and "/" in key:
            batch.metrics[key] = float(value)
    if "train_rows" in batch:
        keep = batch.tensors.pop("train_rows").bool()
        batch.metrics["update/untrained_samples"] = float((~keep).sum())
        batch = batch.select(keep)
    if "advantages" in batch:  # preference algorithms pair samples up instead
        adv = batch["advantages"][batch["response_mask"] > 0]
        batch.metrics["advantage/mean"] = float(adv.mean()) if len(adv) else 0.0
        batch.metrics["advantage/std"] = float(adv.std()) if len(adv) > 1 else 0.0
    return batch


def skip_update(ctx: TrainerContext, batch: StepBatch) -> StepBatch:
    """A step with nothing to train on (fewer samples than actor ranks, or online DPO without a
    pair): no update, said in `update/skipped`; the policy version is reported unchanged."""
    batch.metrics["update/skipped"] = 1.0
    batch.metrics["actor/policy_version"] = float(ctx.policy_version)
    return batch


def update_policy(ctx: TrainerContext, batch: StepBatch, algorithm: Any) -> StepBatch:
    """One training step of the actor (and critic) on `batch`; the controller's algorithm then
    sees the step's metrics (`update_step`: adaptive KL)."""
    return update_branches(ctx, batch, [Branch("", algorithm)])


@dataclass(frozen=True)
class Branch:
    """One algorithm of a training step and the batch keys its rows lack (`merge_branches`)."""

    label: str
    """Metric prefix ("" for a step with one algorithm)."""
    algorithm: Any
    filler_keys: tuple[str, ...] = ()


def update_branches(ctx: TrainerContext, batch: StepBatch, branches: list[Branch]) -> StepBatch:
    """ONE update of the actor (and critic) over `batch`, each row trained by the loss of
    `branches[batch["branch_index"][row]]` (every row by `branches[0]` when there is one).

    One optimizer and scheduler step per optimizer step of the schedule, whatever the number
    of branches; each branch's algorithm then gets its own metrics (`update_step`). A branch's
    metrics come back prefixed with its label (`true/actor/pg_loss`); the shared ones
    (`actor/loss`, `actor/lr`, `actor/grad_norm`, `actor/optimizer_steps`) are not."""
    import ray

    from rlhf_trainer.workers.group import get
    from rlhf_trainer.workers.training import BRANCH_INDEX, UpdateBranch

    if len(branches) > 1 and BRANCH_INDEX not in batch:
        raise ValueError(f"update_branches: {len(branches)} branches but the batch has no {BRANCH_INDEX!r}")
    specs = [
        UpdateBranch(*_algorithm_args(ctx, b.algorithm), label=b.label, filler_keys=b.filler_keys)
        for b in branches
    ]
    data = ray.put(worker_batch(batch))
    actor_runs = [w.update.remote(data, ctx.step, specs) for w in ctx.actor.workers]
    critic_runs = []
    critic_ks = [k for k, b in enumerate(branches) if b.algorithm.needs_critic]
    if critic_ks and ctx.critic is not None:
        critic_data, critic_specs = data, specs
        if len(branches) > 1:  # the critic trains on the rows of the branches that have one
            index = batch[BRANCH_INDEX]
            rows = torch.isin(index, torch.tensor(critic_ks))
            part = batch.select(rows)
            part[BRANCH_INDEX] = torch.searchsorted(torch.tensor(critic_ks), index[rows])
            critic_data, critic_specs = ray.put(worker_batch(part)), [specs[k] for k in critic_ks]
        critic_runs = [w.update.remote(critic_data, ctx.step, critic_specs) for w in ctx.critic.workers]
    results = get(actor_runs + critic_runs)
    metrics: dict[str, float] = dict(results[0])  # ranks all-reduce their metrics: rank 0 holds the job's
    if critic_runs:
        metrics.update(results[len(actor_runs)])
    metrics["batch/num_samples"] = float(len(batch))
    for k, b in enumerate(branches):
        if not b.label:
            b.algorithm.update_step(metrics)
            continue
        prefix = b.label + "/"
        own = {key[len(prefix) :]: v for key, v in metrics.items() if key.startswith(prefix)}
        own["batch/num_samples"] = float((batch[BRANCH_INDEX] == k).sum())
        b.algorithm.update_step(own)
    ctx.policy_version += 1
    batch.metrics.update(metrics)
    batch.metrics["actor/policy_version"] = float(ctx.policy_version)
    return batch


def merge_branches(parts: list[tuple[str, StepBatch]]) -> tuple[StepBatch, list[tuple[str, ...]]]:
    """The rows of several branches as one batch with `branch_index` (B,) = the part each row
    came from, and for each part the keys it lacks (filled with zeros, or False; a missing
    `pair_index` gets a distinct negative label per row, so those rows are single units).

    parts: (label, batch) with the same response width T. Metrics are not merged."""
    from rlhf_trainer.workers.training import BRANCH_INDEX

    keys: dict[str, Tensor] = {}
    for _, part in parts:
        for key, value in part.tensors.items():
            if value.dim() > 0 and value.shape[0] == len(part):
                keys.setdefault(key, value)
    tensors: dict[str, Tensor] = {}
    fillers: list[tuple[str, ...]] = [tuple(sorted(k for k in keys if k not in p.tensors)) for _, p in parts]
    next_label = -1
    for key, like in keys.items():
        pieces = []
        for _, part in parts:
            if key in part.tensors:
                pieces.append(part[key])
            elif key == "pair_index":
                pieces.append(torch.arange(next_label, next_label - len(part), -1, dtype=like.dtype))
                next_label -= len(part)
            else:
                pieces.append(torch.zeros((len(part), *like.shape[1:]), dtype=like.dtype))
        tensors[key] = torch.cat(pieces)
    tensors[BRANCH_INDEX] = torch.cat(
        [torch.full((len(p),), k, dtype=torch.long) for k, (_, p) in enumerate(parts)]
    )
    merged = StepBatch(
        tensors=tensors,
        prompts=[t for _, p in parts for t in p.prompts],
        responses=[t for _, p in parts for t in p.responses],
        columns=[c for _, p in parts for c in p.columns],
        messages=[m for _, p in parts for m in p.messages] if all(p.messages for _, p in parts) else [],
    )
    return merged, fillers


def sync_weights(ctx: TrainerContext) -> dict[str, float]:
    """Make the generators sample from the updated policy; returns the sync's metrics.

    Colocated: nothing to call. Each actor refreshes its hybrid engine at the end of the call
    that changed its weights (`ActorWorker.update`, `ActorWorker.load`): the phase runs fused
    into those calls, on the same workers, and saves a round trip to every rank per step (one
    rank: the engine samples from the training module itself, nothing to move at all).
    Disaggregated: a bucketed broadcast from actor rank 0 to every member of the fleet's weight-sync
    group, confirmed by every receiver (`fleet.elastic.RolloutFleet.sync`).
    """
    if ctx.fleet is None:
        return {}
    return ctx.fleet.sync(ctx.policy_version, ctx.step)


def reshard_if_needed(ctx: TrainerContext, metrics: dict[str, float]) -> None:
    """The elastic-rollout phase at the step boundary: the fleet asks its membership source (the
    autoscaling policy locally, the operator's `status.rollout` on a cluster) for a target and
    follows the resharding protocol when it must change. Colocated jobs have no fleet."""
    if ctx.fleet is None:
        return
    metrics.update(ctx.fleet.boundary(ctx.step, metrics))


def _algorithm_args(ctx: TrainerContext, algorithm: Any) -> tuple[str, dict[str, Any], dict[str, Any]]:
    """How workers rebuild `algorithm`: its name or import path, its params (all of them, with
    the defaults the job filled in: `job_defaults`) and its state."""
    if algorithm is ctx.algorithm:
        name = ctx.spec.algorithm.name
    else:
        cls = type(algorithm)
        name = cls.name or f"{cls.__module__}:{cls.__qualname__}"
    return name, algorithm.params.as_dict(), algorithm.state_dict()


def _score_rows(group: Any, method: str, batch: StepBatch, independent: bool = False) -> Tensor:
    """Run a scoring method over all rows: one shared batch for a sharded group (each rank takes
    its share), or contiguous row ranges for independent replicas."""
    from rlhf_trainer.workers.base import stitch

    data = worker_batch(batch)
    if independent and len(group) > 1:
        chunks = _split(len(batch), len(group))
        parts = group.call_each(
            method, [({k: v[c.start : c.stop] for k, v in data.items()},) for c in chunks]
        )
        results = [(rows + c.start, values) for (rows, values), c in zip(parts, chunks)]
    else:
        import ray

        results = group.call(method, ray.put(data))
    out = stitch(results, len(batch))
    width = batch["response_mask"].shape[1]
    return torch.nn.functional.pad(out, (0, width - out.shape[1]))[:, :width]


# --------------------------------------------------------------------------------------------
# Evaluation (spec.eval)
# --------------------------------------------------------------------------------------------


def eval_modes(eval_spec: Any) -> list[tuple[str, int, bool]]:
    """(name, responses per prompt, greedy) of each way `spec.eval` evaluates, headline first."""
    modes = []
    if eval_spec.greedy:
        modes.append(("greedy", 1, True))
    if eval_spec.samples:
        modes.append(("sampled", eval_spec.samples, False))
    return modes


def eval_summary(scores: Tensor, valid: Tensor, group: Tensor, lengths: Tensor) -> dict[str, float]:
    """Reward statistics of one evaluation mode.

    scores: (B,) rewards, valid: (B,) bool (False: every reward of the sample failed under
    `onError: skip`), group: (B,) prompt of each sample, lengths: (B,) response tokens.
    `best_of_n`: the mean over prompts of the best valid sample of each prompt (prompts without
    a valid sample count as missing); NaN where no sample is valid."""
    ok = scores[valid]
    nan = float("nan")
    out = {
        "reward_mean": float(ok.mean()) if len(ok) else nan,
        "reward_std": float(ok.std()) if len(ok) > 1 else 0.0,
        "reward_min": float(ok.min()) if len(ok) else nan,
        "reward_max": float(ok.max()) if len(ok) else nan,
        "reward_invalid": float((~valid).sum()),
        "response_length": float(lengths.float().mean()) if len(lengths) else nan,
        "samples": float(len(scores)),
    }
    if len(ok):
        groups, inverse = torch.unique(group[valid], return_inverse=True)  # (G,), (V,)
        best = torch.full((len(groups),), -torch.inf).scatter_reduce(0, inverse, ok.float(), reduce="amax")
        out["best_of_n"] = float(best.mean())  # (G,) -> mean over prompts
    else:
        out["best_of_n"] = nan
    return out


def _eval_chunks(ctx: TrainerContext, prompts: list[Any], n: int) -> list[list[Any]]:
    """`prompts` in pieces of about a training step's responses (what the generators hold at once)."""
    per_step = ctx.spec.training.prompts_per_step * ctx.spec.rollout.samples_per_prompt
    size = max(1, per_step // n)
    return [prompts[i : i + size] for i in range(0, len(prompts), size)]


def evaluate(ctx: TrainerContext, prompts: list[Any]) -> tuple[dict[str, float], dict[str, StepBatch]]:
    """The evaluation phase: `prompts` answered by the current policy in each mode of `spec.eval`
    (greedy, and/or `samples` sampled responses per prompt) and scored with the evaluation's
    rewards (`eval.rewards`, else the job's). Returns the metrics `eval/<mode>/<stat>`
    (`eval_summary`), `eval/reward_mean` (the first mode's mean), `eval/prompts`, and each mode's
    scored samples (for the sample log). The sampled mode samples at `eval.temperature` when set
    (else the rollout's). Nothing here touches the training data's position."""
    from rlhf_trainer.workers.reward import EVAL_REWARDS, JOB_REWARDS

    spec = ctx.spec.eval
    if spec is None:
        return {}, {}
    rewards = EVAL_REWARDS if spec.rewards else JOB_REWARDS
    metrics: dict[str, float] = {"eval/prompts": float(len(prompts))}
    batches: dict[str, StepBatch] = {}
    for mode, n, greedy in eval_modes(spec):
        temperature = None if greedy else spec.temperature
        parts, offset = [], 0
        for chunk in _eval_chunks(ctx, prompts, n):
            rollout = generate(ctx, chunk, n=n, greedy=greedy, temperature=temperature)
            part = score(ctx, rollout, rewards=rewards)
            part["group_index"] = part["group_index"] + offset  # prompt numbers across chunks
            offset += len(chunk)
            parts.append(part)
        batch = StepBatch(
            tensors={
                "scores": torch.cat([p["scores"] for p in parts]),
                "reward_valid": torch.cat([p["reward_valid"] for p in parts]),
                "group_index": torch.cat([p["group_index"] for p in parts]),
                # (B,): response widths differ between chunks
                "response_length": torch.cat([p["response_mask"].sum(-1) for p in parts]),
            },
            prompts=[t for p in parts for t in p.prompts],
            responses=[t for p in parts for t in p.responses],
        )
        summary = eval_summary(
            batch["scores"], batch["reward_valid"], batch["group_index"], batch["response_length"]
        )
        metrics.update({f"eval/{mode}/{k}": v for k, v in summary.items()})
        batches[mode] = batch
    headline = f"eval/{eval_modes(spec)[0][0]}/reward_mean"
    metrics["eval/reward_mean"] = metrics[headline]
    return metrics, batches


def spread_rows(n: int, k: int) -> list[int]:
    """`k` row indices spread evenly over `n` rows (all of them when `k >= n`), first and last included."""
    if k <= 0 or n <= 0:
        return []
    if k >= n:
        return list(range(n))
    if k == 1:
        return [0]
    return sorted({round(i * (n - 1) / (k - 1)) for i in range(k)})


def sample_rows(batch: StepBatch | None, k: int, step: int, split: str) -> list[dict[str, Any]]:
    """Up to `k` rows of `batch` for the sample log: step, split (`train`, `eval/greedy`, ...),
    prompt, response and reward (None where the sample's reward failed)."""
    if batch is None or not batch.responses or "scores" not in batch:
        return []
    n = len(batch.responses)
    valid = batch["reward_valid"] if "reward_valid" in batch else torch.ones(n, dtype=torch.bool)
    rows = []
    for i in spread_rows(n, k):
        rows.append(
            {
                "step": step,
                "split": split,
                "prompt": batch.prompts[i],
                "response": batch.responses[i],
                "reward": float(batch["scores"][i]) if bool(valid[i]) else None,
            }
        )
    return rows
