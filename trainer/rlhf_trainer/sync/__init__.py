"""Weight transport from the actor to the rollout fleet: bucketed broadcast (`buckets`), resharding
to tensor-parallel inference layouts (`reshard`), the membership-generation process group with its
failure path (`group`), and the controller's side of it over Ray handles (`push`).

Who is in the fleet and which prompts each member holds is the business of `rlhf_trainer.fleet`,
which drives this package (never the other way round). See docs/elastic-rollout.md for the protocol
the controller and the operator follow.
"""

from .buckets import (
    DEFAULT_BUCKET_BYTES,
    SyncStats,
    TensorMeta,
    WeightReceiver,
    bucketed_broadcast,
    default_pack_below,
    drain_full_tensors,
    materialize,
    plan_messages,
    receive_broadcast,
    tensor_digest,
)
from .group import DroppedError, PushResult, SyncError, SyncGroup, connect_store
from .reshard import ReshardPlan, ShardRule, ShardSpec, default_tp_rules

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "DroppedError",
    "PushResult",
    "ReshardPlan",
    "ShardRule",
    "ShardSpec",
    "SyncError",
    "SyncGroup",
    "SyncStats",
    "TensorMeta",
    "WeightReceiver",
    "bucketed_broadcast",
    "connect_store",
    "default_pack_below",
    "default_tp_rules",
    "drain_full_tensors",
    "materialize",
    "plan_messages",
    "receive_broadcast",
    "tensor_digest",
]
