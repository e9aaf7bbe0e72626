"""`RewardWorker`: scores decoded responses with the job's reward functions and reward model."""

from __future__ import annotations

from typing import Any

from rlhf_trainer.workers.base import Worker


class RewardWorker(Worker):
    role = "reward"

    def setup(self) -> None:
        try:
            from rlhf_trainer.rewards import CombinedReward
        except ImportError:  # TEMPORARY until rlhf_trainer.rewards lands
            from rlhf_trainer.workers._standin import CombinedReward  # type: ignore[assignment]

        self.reward = CombinedReward.from_spec(self.spec.reward)

    def score(self, prompts: list[str], responses: list[str], columns: list[dict[str, Any]]) -> Any:
        """A `RewardResult` (scores, valid, errors, per_reward) for these samples."""
        return self.reward.compute(prompts, responses, columns)
