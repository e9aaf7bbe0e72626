"""The DataStream API: a training step as rollout -> reward -> filter -> update operators.

`rlhf run` builds the standard stream from the manifest (`startup.standard_stream`);
`spec.pipeline: my_pkg.flows:build` names a function `build(ctx) -> DataStream` instead.
"""

from rlhf_trainer.dataflow.batch import StepBatch
from rlhf_trainer.dataflow.context import TrainerContext
from rlhf_trainer.dataflow.operators import (
    DynamicSamplingOperator,
    OnlineDPOUpdateOperator,
    PPOUpdateOperator,
    RewardModelScorer,
    RewardOperator,
    RolloutOperator,
    UpdateOperator,
)
from rlhf_trainer.dataflow.stream import (
    ConditionalUpdateOperator,
    DataStream,
    FilterOperator,
    Operator,
    group_mean_at_least,
)

__all__ = [
    "ConditionalUpdateOperator",
    "DataStream",
    "DynamicSamplingOperator",
    "FilterOperator",
    "OnlineDPOUpdateOperator",
    "Operator",
    "PPOUpdateOperator",
    "RewardModelScorer",
    "RewardOperator",
    "RolloutOperator",
    "StepBatch",
    "TrainerContext",
    "UpdateOperator",
    "group_mean_at_least",
]
