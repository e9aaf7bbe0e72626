"""The standard operators of a `DataStream`, each a thin wrapper over `phases`.

RolloutOperator(ctx)                     prompts -> sampled responses        (rollout)
RewardOperator(ctx) / RewardModelScorer  scores with the job's rewards       (reward)
UpdateOperator(ctx, algorithm)           reference / critic -> advantage -> update
PPOUpdateOperator(ctx, **params)         UpdateOperator with PPO
OnlineDPOUpdateOperator(ctx, **params)   UpdateOperator with online DPO
"""

from __future__ import annotations

from typing import Any

from rlhf_trainer.dataflow import phases
from rlhf_trainer.dataflow.batch import StepBatch
from rlhf_trainer.dataflow.context import TrainerContext, timed


class RolloutOperator:
    """Start of a step: the step's prompts, and `samplesPerPrompt` responses to each.

    With asynchronous rollouts (`ctx.ahead`, `rollout.maxStaleness` > 0) the batch is the one
    generated during the previous step, and the next step's rollout starts here, before this
    step's reward and update (`dataflow.rollout_ahead`); `timing/rollout` is then only the time
    the step waited for it. Samples older than `maxStaleness` versions are dropped (`phases.drop_stale`)."""

    def __init__(self, ctx: TrainerContext):
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

    def __init__(self, ctx: TrainerContext):
        self.ctx = ctx

    def __call__(self, batch: StepBatch | None) -> StepBatch:
        if batch is None:
            raise ValueError("RewardOperator: nothing to score (put it after a RolloutOperator)")
        with timed(batch.metrics, "reward"):
            return phases.drop_invalid_rewards(phases.score(self.ctx, batch))


#: The seed tutorial's name for the reward step (it scores with the reward model and functions).
RewardModelScorer = RewardOperator


class UpdateOperator:
    """Reference log-probs, critic values and old log-probs as `algorithm` needs them, then its
    advantages and one actor (and critic) update. `algorithm`: an `Algorithm`, or a name/import
    path built with `params`; None means the job's algorithm."""

    def __init__(self, ctx: TrainerContext, algorithm: Any = None, **params: Any):
        from rlhf_trainer.algorithms import build_algorithm

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
