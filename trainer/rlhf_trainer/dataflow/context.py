"""`TrainerContext`: what the operators of a step reach for — the job, the role groups, the
prompt source and the policy version. A plain record: the behaviour lives in `phases`."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from rlhf_api.job import JobSpec

if TYPE_CHECKING:
    from torch import Tensor
    from transformers import PreTrainedTokenizerBase

    from rlhf_trainer.algorithms.base import Algorithm
    from rlhf_trainer.data import PromptDataset
    from rlhf_trainer.dataflow.batch import StepBatch
    from rlhf_trainer.fleet.elastic import RolloutFleet
    from rlhf_trainer.workers.group import WorkerGroup


class Ahead(Protocol):
    """What a step sees of the rollout generated ahead (`dataflow.rollout_ahead.RolloutAhead`):
    the context holds one without depending on the module that runs it."""

    def launch(self, step: int) -> None: ...
    def settle(self) -> float: ...
    def take(self, step: int) -> tuple[StepBatch | None, float]: ...
    def state(self) -> tuple[dict[str, Any], dict[str, Tensor]]: ...
    def restore(self, info: dict[str, Any], tensors: dict[str, Tensor]) -> None: ...
    def shutdown(self) -> None: ...


@dataclass
class TrainerContext:
    spec: JobSpec
    job_name: str
    run_dir: Path
    tokenizer: PreTrainedTokenizerBase
    dataset: PromptDataset
    """The prompt source, with a resumable position."""
    algorithm: Algorithm
    """The job's algorithm (advantages, KL-controller state); workers hold copies for the loss."""
    actor: WorkerGroup = field(init=False, repr=False)
    """`ActorWorker` ranks (they generate too, in colocated placement). Set by
    `startup.start_workers`, after the stream is built (the stream says which roles run)."""
    reward: WorkerGroup = field(init=False, repr=False)
    """`RewardWorker` replicas. Set by `startup.start_workers`."""
    critic: WorkerGroup | None = None
    """`CriticWorker` ranks, when an algorithm of the stream needs a critic."""
    reference: WorkerGroup | None = None
    """`ReferenceWorker` replicas, when an algorithm of the stream has a KL term."""
    rollout: WorkerGroup | None = None
    """`RolloutWorker` replicas, disaggregated placement only."""
    fleet: RolloutFleet | None = None
    """The elastic fleet over `rollout` (`fleet.elastic`): prompt leases, the weight-sync group, and
    the source of membership changes (the local policy, or the operator on a cluster)."""
    ahead: Ahead | None = None
    """Asynchronous rollouts (`rollout.maxStaleness` > 0, disaggregated): the rollout of the next
    step, generated while this one trains (`dataflow.rollout_ahead`)."""
    step: int = 0
    policy_version: int = 0
    """Bumped by every policy update; rollout workers tag each sample with the version they ran."""
    eval_prompts: list[Any] = field(default_factory=list)
    """The evaluation's prompts (`data.PromptItem`s of `spec.eval.path`), in file order."""

    @property
    def colocated(self) -> bool:
        return self.rollout is None

    def generators(self) -> WorkerGroup:
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
