"""`RewardWorker`: scores decoded responses with the job's reward functions and reward model."""

from __future__ import annotations

from typing import Any

from rlhf_trainer.workers.base import Worker


class RewardWorker(Worker):
    role = "reward"

    def setup(self) -> None:
        from rlhf_trainer.rewards import CombinedReward

        self.reward = CombinedReward.from_spec(self.spec.reward, device=str(self.device))

    def score(self, prompts: list[str], responses: list[str], columns: list[dict[str, Any]]) -> Any:
        """A `RewardResult` (scores, valid, errors, per_reward) for these samples."""
        try:
            return self.reward.compute(prompts, responses, columns)
        except Exception as err:
            # Re-raised as a plain RuntimeError carrying the message: Ray re-creates exceptions from
            # their args, which garbles those whose constructor takes something else (RewardFailure).
            raise RuntimeError(f"{type(err).__name__}: {err}") from None
