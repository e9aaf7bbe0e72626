"""The RL algorithm library: pure tensor math over masked (B, T) response tensors, plus registries.

One family per module — `advantages`, `policy_loss`, `value_loss`, `kl`, `entropy`,
`aggregation`, `preference` — each formula a function of tensors registered by name in
`registry`; `base` defines the `Algorithm` interface the trainer calls, and `builtin` the
shipped algorithms (ppo, grpo, gspo, dr_grpo, rloo, reinforce_plus_plus, remax, online_dpo,
dynamic_kl_ppo).

    from rlhf_trainer.algorithms import build_algorithm
    algo = build_algorithm("grpo", {"klCoef": 0.001, "lossAggMode": "seq-mean-token-mean"})
"""

from . import advantages, aggregation, entropy, kl, policy_loss, preference, value_loss
from .aggregation import aggregate
from .base import (
    Algorithm,
    AlgorithmParams,
    Batch,
    bind_call,
    build_algorithm,
    describe_params,
    list_algorithms,
    param,
)
from .builtin import (
    GRPO,
    GSPO,
    PPO,
    RLOO,
    DrGRPO,
    DynamicKLPPO,
    OnlineDPO,
    PolicyGradientAlgorithm,
    ReinforcePlusPlus,
    ReMax,
)
from .entropy import entropy_from_logits
from .masking import count_normalizers, masked_mean, masked_sum, masked_whiten
from .registry import (
    ADVANTAGE_ESTIMATORS,
    ALGORITHMS,
    KL_CONTROLLERS,
    KL_ESTIMATORS,
    LOSS_AGGREGATIONS,
    POLICY_LOSSES,
    PREFERENCE_LOSSES,
    Registry,
    UnknownNameError,
)

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "ALGORITHMS",
    "GRPO",
    "GSPO",
    "KL_CONTROLLERS",
    "KL_ESTIMATORS",
    "LOSS_AGGREGATIONS",
    "POLICY_LOSSES",
    "PPO",
    "PREFERENCE_LOSSES",
    "RLOO",
    "Algorithm",
    "AlgorithmParams",
    "Batch",
    "DrGRPO",
    "DynamicKLPPO",
    "OnlineDPO",
    "PolicyGradientAlgorithm",
    "Registry",
    "ReMax",
    "ReinforcePlusPlus",
    "UnknownNameError",
    "advantages",
    "aggregate",
    "aggregation",
    "bind_call",
    "build_algorithm",
    "count_normalizers",
    "describe_params",
    "entropy",
    "entropy_from_logits",
    "kl",
    "list_algorithms",
    "masked_mean",
    "masked_sum",
    "masked_whiten",
    "param",
    "policy_loss",
    "preference",
    "value_loss",
]
