"""`RewardWorker`: scores decoded responses with the job's reward functions and reward model, or
with the evaluation's own reward functions (`spec.eval.rewards`)."""

from __future__ import annotations

import dataclasses
from typing import Any

from rlhf_trainer.workers.base import Worker

#: The job's rewards (`spec.reward`), used for training (and for evaluation without its own).
JOB_REWARDS = "job"
#: The evaluation's reward functions (`spec.eval.rewards`).
EVAL_REWARDS = "eval"


class RewardWorker(Worker):
    role = "reward"

    def setup(self) -> None:
        from rlhf_trainer.rewards import CombinedReward

        self.rewards: dict[str, Any] = {
            # a reward model without a dtype of its own runs in model.dtype (`RewardModelSpec.load_dtype`)
            JOB_REWARDS: CombinedReward.from_spec(
                self.spec.reward, device=str(self.device), dtype=self.spec.model.dtype
            )
        }
        if self.spec.eval is not None and self.spec.eval.rewards:
            # Function rewards only, with the job's error policy.
            eval_spec = dataclasses.replace(
                self.spec.reward, functions=self.spec.eval.rewards, model=None, models=[]
            )
            self.rewards[EVAL_REWARDS] = CombinedReward.from_spec(eval_spec, device=str(self.device))

    def score(
        self,
        prompts: list[str],
        responses: list[str],
        columns: list[dict[str, Any]],
        messages: list[list[dict[str, Any]] | None] | None = None,
        rewards: str = JOB_REWARDS,
    ) -> Any:
        """A `RewardResult` (scores, valid, errors, per_reward) for these samples. `messages`:
        each prompt as chat messages (None for a plain-text prompt), for the reward model.
        `rewards`: which set scores them (`JOB_REWARDS`, or `EVAL_REWARDS` when the job has them)."""
        if rewards not in self.rewards:
            raise ValueError(f"unknown reward set {rewards!r}; valid: {', '.join(self.rewards)}")
        try:
            return self.rewards[rewards].compute(prompts, responses, columns, messages=messages)
        except Exception as err:
            # Re-raised as a plain RuntimeError carrying the message: Ray re-creates exceptions from
            # their args, which garbles those whose constructor takes something else (RewardFailure).
            raise RuntimeError(f"{type(err).__name__}: {err}") from None
