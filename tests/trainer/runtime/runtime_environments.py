"""Environments used by the runtime tests (built by the workers from their import path)."""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any

from rlhf_trainer.environments import EnvStep, Episode
from rlhf_trainer.environments.calculator import CalculatorEnv


class FlakyCalculatorEnv(CalculatorEnv):
    """The calculator, but a flaky tool: with probability `flakiness` (drawn from Python's
    `random`, as a user's environment would) its answer is off by 1-9 and the call costs a random
    reward. So the episodes of a step depend on the environment's random draws.

    `hold`: a test knob that makes a run stop in the middle of an episode batch: when the file
    `hold` (the run's metrics.jsonl) has `hold_at` lines, the `hold_after`-th call after that one
    touches `<hold>.held` and sleeps, once per run directory (a resumed run finds the marker and
    goes on)."""

    def __init__(
        self,
        flakiness: float = 0.5,
        hold: str | None = None,
        hold_at: int = 0,
        hold_after: int = 4,
        **kwargs: Any,
    ):
        super().__init__(**kwargs)
        self.flakiness = flakiness
        self.hold = Path(hold) if hold else None
        self.hold_at, self.hold_after, self.calls_at = hold_at, hold_after, 0

    def step(self, episode: Episode) -> EnvStep:
        self._maybe_hold()
        answer = super().step(episode)
        if answer.done or random.random() >= self.flakiness:
            return answer
        wrong = answer.observation.replace(self.result_open, f"{self.result_open}{random.randint(1, 9)}", 1)
        return EnvStep(observation=wrong, reward=-random.random() / 10)

    def _maybe_hold(self) -> None:
        if self.hold is None:
            return
        marker = self.hold.with_name(self.hold.name + ".held")
        if marker.exists() or not self.hold.is_file():
            return
        if len(self.hold.read_text().splitlines()) < self.hold_at:
            return
        self.calls_at += 1
        if self.calls_at >= self.hold_after:
            marker.touch()
            time.sleep(600)  # the test kills the run here, episodes of this step half answered
