"""The standard operators of a `DataStream`, each a thin wrapper over `phases`.

RolloutOperator(ctx)                     prompts -> sampled responses        (rollout)
RewardOperator(ctx) / RewardModelScorer  scores with the job's rewards       (reward)
DynamicSamplingOperator(ctx)             groups with reward variance, oversampled (DAPO)
UpdateOperator(ctx, algorithm)           reference / critic -> advantage -> update
PPOUpdateOperator(ctx, **params)         UpdateOperator with PPO
OnlineDPOUpdateOperator(ctx, **params)   UpdateOperator with online DPO
"""

from __future__ import annotations

from typing import Any

import torch

from rlhf_trainer.dataflow import phases
from rlhf_trainer.dataflow.batch import StepBatch
from rlhf_trainer.dataflow.context import TrainerContext, timed

#: The seed tutorials' operator keywords (verl builds the models and passes them in): here the
#: manifest holds each of them, so an operator given one fails naming the field.
SEED_SETTINGS = {
    "model": "spec.model.path",
    "tokenizer": "spec.model.tokenizer",
    "max_new_tokens": "spec.rollout.maxNewTokens",
    "temperature": "spec.rollout.temperature",
    "top_p": "spec.rollout.topP",
    "dynamic_batch_size": "spec.training.maxTokensPerMicroBatch",
    "min_batch_size": "spec.training.maxTokensPerMicroBatch",
    "max_batch_size": "spec.training.maxTokensPerMicroBatch",
    "rm_model": "spec.reward.model.path",
    "use_vllm": "spec.rollout.engine",
    "actor": "spec.model.path",
    "critic": "spec.roles.critic (the algorithm decides whether one trains: grpo is critic-free)",
}


def refuse_seed_settings(operator: str, given: dict[str, Any]) -> None:
    """A TypeError naming the manifest field of each seed keyword in `given` (`SEED_SETTINGS`)."""
    seeds = [key for key in given if key in SEED_SETTINGS]
    if seeds:
        where = "; ".join(f"{key}: {SEED_SETTINGS[key]}" for key in seeds)
        raise TypeError(
            f"{operator}(ctx) takes its models and settings from the job, not as arguments; in the "
            f"manifest: {where} (docs/from-verl.md)"
        )
    if given:
        raise TypeError(f"{operator}(ctx) got unexpected arguments: {', '.join(given)}")


class RolloutOperator:
    """Start of a step: the step's prompts, and `samplesPerPrompt` responses to each.

    With asynchronous rollouts (`ctx.ahead`, `rollout.maxStaleness` > 0) the batch is the one
    generated during the previous step, and the next step's rollout starts here, before this
    step's reward and update (`dataflow.rollout_ahead`); `timing/rollout` is then only the time
    the step waited for it. Samples older than `maxStaleness` versions are dropped (`phases.drop_stale`)."""

    def __init__(self, ctx: TrainerContext, **seed_settings: Any):
        refuse_seed_settings("RolloutOperator", seed_settings)
        self.ctx = ctx

    def __call__(self, batch: StepBatch | None = None) -> StepBatch:
        ctx, ahead = self.ctx, self.ctx.ahead
        metrics: dict[str, float] = {}
        out, waited = ahead.take(ctx.step) if ahead is not None else (None, 0.0)
        if out is None:
            with timed(metrics, "data"):
                prompts = phases.sample_prompts(ctx)
            if not prompts:
                raise RuntimeError("the prompt source yielded no prompts (every prompt skipped?)")
            with timed(metrics, "rollout"):
                out = phases.generate(ctx, prompts)
            out.metrics["data/skipped_prompts"] = float(getattr(ctx.dataset, "skipped", 0))
        else:
            metrics["timing/rollout"] = waited
        if (
            ahead is not None
            and ctx.spec.rollout.max_staleness > 0
            and ctx.step + 1 < ctx.spec.training.steps
        ):
            with timed(metrics, "data"):
                ahead.launch(ctx.step + 1)  # generated while this step trains
        out.metrics.update(metrics)
        return phases.drop_stale(ctx, out)


class RewardOperator:
    """Scores every sample with the job's reward functions and reward model (`spec.reward`).
    A sample whose reward failed under `onError: skip` leaves the batch here, counted in
    `reward/dropped` (`phases.drop_invalid_rewards`): no later operator sees it as a 0."""

    def __init__(self, ctx: TrainerContext, **seed_settings: Any):
        refuse_seed_settings("RewardModelScorer (RewardOperator)", seed_settings)
        self.ctx = ctx

    def __call__(self, batch: StepBatch | None) -> StepBatch:
        if batch is None:
            raise ValueError("RewardOperator: nothing to score (put it after a RolloutOperator)")
        with timed(batch.metrics, "reward"):
            return phases.drop_invalid_rewards(phases.score(self.ctx, batch))


#: The seed tutorial's name for the reward step (it scores with the reward model and functions).
RewardModelScorer = RewardOperator


class DynamicSamplingOperator:
    """DAPO's dynamic sampling (`spec.algorithm.dynamicSampling`), after the reward: the groups
    whose rewards all agree are dropped (their group-relative advantage is 0), and more prompts
    are sampled, generated and scored, `promptsPerStep` at a time, until the step holds
    `promptsPerStep` groups with reward variance or `maxExtraRounds` extra rounds ran; groups
    beyond `promptsPerStep` are left out. Metrics `dynamic_sampling/*`: `groups_generated` =
    `groups_kept` + `groups_uniform` + `groups_surplus`, and `rounds` (extra rounds run)."""

    def __init__(self, ctx: TrainerContext, max_extra_rounds: int | None = None):
        self.ctx = ctx
        spec = ctx.spec.algorithm.dynamic_sampling
        self.max_extra_rounds = spec.max_extra_rounds if max_extra_rounds is None else max_extra_rounds

    def __call__(self, batch: StepBatch | None) -> StepBatch:
        from rlhf_trainer.algorithms.dapo import groups_with_variance
        from rlhf_trainer.dataflow.batch import concat_batches

        if batch is None:
            raise ValueError("DynamicSamplingOperator: nothing to filter (put it after a RewardOperator)")
        want = self.ctx.spec.training.prompts_per_step
        counts = {"groups_generated": 0.0, "groups_uniform": 0.0, "groups_surplus": 0.0, "rounds": 0.0}
        kept: list[StepBatch] = []
        have = 0
        part: StepBatch | None = batch
        while part is not None:
            keep, varied = groups_with_variance(part["scores"], part["group_index"])  # (B,), (G,)
            counts["groups_generated"] += float(len(varied))
            counts["groups_uniform"] += float((~varied).sum())
            if keep.any():
                kept.append(part.select(keep))
                have += int(varied.sum())
            if have >= want or counts["rounds"] >= self.max_extra_rounds:
                break
            counts["rounds"] += 1
            part = self._round()  # None: the prompt source is exhausted
        out = concat_batches(kept) if kept else batch.select(torch.zeros(len(batch), dtype=torch.bool))
        out.metrics = dict(batch.metrics)
        out = self._trim(out, want, counts)
        counts["groups_kept"] = float(len(torch.unique(out["group_index"]))) if len(out) else 0.0
        out.metrics.update({f"dynamic_sampling/{k}": v for k, v in counts.items()})
        return out

    def _round(self) -> StepBatch | None:
        """One more round of prompts, generated and scored (failed rewards dropped); None when
        the prompt source has none left."""
        ctx = self.ctx
        prompts = phases.sample_prompts(ctx)
        if not prompts:
            return None
        return phases.drop_invalid_rewards(phases.score(ctx, phases.generate(ctx, prompts)))

    @staticmethod
    def _trim(batch: StepBatch, want: int, counts: dict[str, float]) -> StepBatch:
        """The first `want` groups of `batch` (in group order); the rest counted as surplus."""
        if not len(batch):
            return batch
        groups = torch.unique(batch["group_index"])  # (G,) sorted
        if len(groups) <= want:
            return batch
        counts["groups_surplus"] += float(len(groups) - want)
        return batch.select(torch.isin(batch["group_index"], groups[:want]))


class UpdateOperator:
    """Reference log-probs, critic values and old log-probs as `algorithm` needs them, then its
    advantages and one actor (and critic) update. `algorithm`: an `Algorithm`, or a name/import
    path built with `params`; None means the job's algorithm."""

    def __init__(self, ctx: TrainerContext, algorithm: Any = None, **params: Any):
        from rlhf_trainer.algorithms import build_algorithm

        refuse_seed_settings(type(self).__name__, {k: v for k, v in params.items() if k in SEED_SETTINGS})
        self.ctx = ctx
        if algorithm is None:
            algorithm = ctx.algorithm
        elif isinstance(algorithm, str):
            algorithm = build_algorithm(algorithm, params, job=ctx.spec)
        self.algorithm = algorithm

    def algorithms(self) -> list[Any]:
        return [self.algorithm]

    def __call__(self, batch: StepBatch | None) -> StepBatch:
        if batch is None:
            raise ValueError("UpdateOperator: nothing to train on (put it after a RolloutOperator)")
        batch = phases.drop_invalid_rewards(batch)  # a stream that scored with phases.score itself
        if len(batch) < len(self.ctx.actor):  # fewer samples than actor ranks: nothing sensible to do
            return phases.skip_update(self.ctx, batch)
        batch = self.prepare(batch)
        if len(batch) < len(self.ctx.actor):  # online DPO: too few pairs among the samples
            return phases.skip_update(self.ctx, batch)
        with timed(batch.metrics, "update"):
            batch = phases.update_policy(self.ctx, batch, self.algorithm)
        return batch

    def prepare(self, batch: StepBatch) -> StepBatch:
        """Everything before the update: reference log-probs, critic values, old log-probs (and
        the behaviour log-probs of a stale batch), the greedy baseline (ReMax) and the advantages (or pairs). `ConditionalUpdateOperator` prepares each branch with this,
        then trains all branches in one update."""
        ctx, algo, m = self.ctx, self.algorithm, batch.metrics
        with timed(m, "reference"):
            batch = phases.reference_log_probs(ctx, batch, algo)
        with timed(m, "critic"):
            batch = phases.critic_values(ctx, batch, algo)
        with timed(m, "old_log_probs"):
            batch = phases.policy_log_probs(ctx, batch, algo)
            batch = phases.behaviour_log_probs(ctx, batch)
            batch = phases.rollout_correction(ctx, batch)
        with timed(m, "baseline"):
            batch = phases.greedy_baseline(ctx, batch, algo)
        with timed(m, "advantage"):
            batch = phases.compute_advantages(ctx, batch, algo)
        return batch


class PPOUpdateOperator(UpdateOperator):
    def __init__(self, ctx: TrainerContext, **params: Any):
        super().__init__(ctx, "ppo", **params)


class OnlineDPOUpdateOperator(UpdateOperator):
    def __init__(self, ctx: TrainerContext, **params: Any):
        super().__init__(ctx, "online_dpo", **params)
