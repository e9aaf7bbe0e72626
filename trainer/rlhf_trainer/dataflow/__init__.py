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

#: The seed tutorials' class names that are spelled otherwise here: importing one fails naming
#: the class to use (the scorer keeps the seeds' name, `RewardModelScorer`).
VERL_NAMES = {
    "DPOUpdateOperator": "OnlineDPOUpdateOperator (online DPO on pairs from each prompt's samples)",
}


def __getattr__(name: str) -> object:
    if name in VERL_NAMES:  # ImportError, not AttributeError: `from ... import` keeps its message
        raise ImportError(f"rlhf_trainer.dataflow has no {name}: it is {VERL_NAMES[name]}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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
