"""Role workers (one class per role) and `WorkerGroup`, which runs N ranks of a role on Ray.

| role | class | process group | does |
|---|---|---|---|
| actor | `ActorWorker` | yes (FSDP2 when > 1 rank) | trains the policy; generates in colocated placement |
| critic | `CriticWorker` | yes (FSDP2 when > 1 rank) | trains the value model; scores `old_values` |
| reference | `ReferenceWorker` | no | scores `ref_log_probs` with the frozen initial policy |
| reward | `RewardWorker` | no | runs the reward functions and the reward model |
| rollout | `RolloutWorker` | no | generates in disaggregated placement; receives weights |

Importing this package imports torch; Ray is imported by `group` only.
"""

from rlhf_trainer.workers.actor import ActorWorker
from rlhf_trainer.workers.critic import CriticWorker
from rlhf_trainer.workers.reference import ReferenceWorker
from rlhf_trainer.workers.reward import RewardWorker
from rlhf_trainer.workers.rollout import RolloutWorker

__all__ = ["ActorWorker", "CriticWorker", "ReferenceWorker", "RewardWorker", "RolloutWorker", "WorkerGroup"]


def __getattr__(name: str) -> object:
    if name == "WorkerGroup":
        from rlhf_trainer.workers.group import WorkerGroup

        return WorkerGroup
    raise AttributeError(name)
