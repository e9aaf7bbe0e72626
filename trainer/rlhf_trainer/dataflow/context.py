"""`TrainerContext`: what the operators of a step reach for — the job, the role groups, the
prompt source and the policy version. A plain record: the behaviour lives in `phases`."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlhf_trainer.spec import JobSpec


@dataclass
class TrainerContext:
    spec: JobSpec
    job_name: str
    run_dir: Path
    tokenizer: Any
    dataset: Any
    """`data.PromptDataset`: the prompt source, with a resumable position."""
    algorithm: Any
    """The job's `Algorithm` (advantages, KL-controller state); workers hold copies for the loss."""
    actor: Any
    """`WorkerGroup` of `ActorWorker` (generates too, in colocated placement)."""
    reward: Any
    critic: Any = None
    reference: Any = None
    rollout: Any = None
    """`WorkerGroup` of `RolloutWorker`, disaggregated placement only."""
    fleet: Any = None
    """`elastic.RolloutFleet` over `rollout`: prompt leases, the weight-sync group, autoscaling."""
    step: int = 0
    policy_version: int = 0
    """Bumped by every policy update; rollout workers tag each sample with the version they ran."""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def colocated(self) -> bool:
        return self.rollout is None

    def generators(self) -> Any:
        """The group that samples responses: the actors (hybrid engine) or the rollout fleet."""
        return self.actor if self.rollout is None else self.rollout


@contextmanager
def timed(metrics: dict[str, float], phase: str) -> Iterator[None]:
    """Add the seconds spent in the block to `metrics["timing/<phase>"]` (the `rlhf_step_seconds` phases)."""
    start = time.perf_counter()
    try:
        yield
    finally:
        key = f"timing/{phase}"
        metrics[key] = metrics.get(key, 0.0) + time.perf_counter() - start
