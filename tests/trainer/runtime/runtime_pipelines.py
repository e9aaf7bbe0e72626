"""A user pipeline (`spec.pipeline: runtime_pipelines:build`) in the seed tutorial's style."""

from __future__ import annotations

from typing import Any

from rlhf_trainer.dataflow import (
    ConditionalUpdateOperator,
    DataStream,
    FilterOperator,
    OnlineDPOUpdateOperator,
    PPOUpdateOperator,
    RewardModelScorer,
    RolloutOperator,
    group_mean_at_least,
)


def build(ctx: Any) -> DataStream:
    """PPO on prompts whose samples did well on average, online DPO on the rest."""
    return (
        DataStream()
        .add_operator(RolloutOperator(ctx))
        .add_operator(RewardModelScorer(ctx))
        .add_operator(FilterOperator(threshold=-1.0))
        .add_operator(
            ConditionalUpdateOperator(
                group_mean_at_least(0.25),
                true_branch=PPOUpdateOperator(ctx, klCoef=0.01),
                false_branch=OnlineDPOUpdateOperator(ctx),
            )
        )
    )
