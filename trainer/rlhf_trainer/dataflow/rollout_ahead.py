"""Asynchronous rollouts: the disaggregated fleet generates step k+1 while the actor trains step k
(`spec.rollout.maxStaleness` > 0, one-step-off-policy).

A step with a rollout ahead, as the controller runs it:

    batch = ahead.take(k)       # the rollout of step k, launched during step k-1 (weights v_k - 1)
    ahead.launch(k + 1)         # step k+1's prompts, generated in the background (weights v_k)
    ... reward, reference, old log-probs, advantages, update (v_k -> v_k + 1) ...
    ahead.settle()              # wait for step k+1's rollout: the fleet is free again
    boundary, weight sync (v_k + 1), evaluation, log, checkpoint (with the settled batch)

So a step takes about max(rollout, reward + update) instead of their sum, and every sample is
trained one policy version after the one that generated it (`algorithms.off_policy` corrects
for it). One rollout is in flight at most: the weight sync needs the replicas idle, and a deeper
pipeline would push weights between generations that are already queued.

The fleet's prompt queue and sync group are driven by one caller at a time: the background
thread runs `phases.generate`, and everything else that touches the fleet (the step boundary,
the sync, evaluation, ReMax's greedy baseline) runs after `settle` (the fleet's own lock makes
a forgotten `settle` wait instead of racing).

Exact resume: a checkpoint is written after the settle, and holds the batch generated ahead
(`state`/`restore`); the resumed run trains step k on that batch, as the uninterrupted run did.
"""

from __future__ import annotations

import contextlib
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from torch import Tensor

from rlhf_trainer.dataflow.batch import StepBatch
from rlhf_trainer.dataflow.context import TrainerContext

#: Keys of the checkpoint's controller tensors that hold the batch generated ahead.
TENSOR_PREFIX = "rollout_ahead/"


class RolloutAhead:
    """At most one rollout in flight on the fleet, for the step after the one training."""

    def __init__(self, ctx: TrainerContext):
        self.ctx = ctx
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rollout-ahead")
        self.pending: Future[StepBatch] | None = None
        self.pending_step = -1
        self.ready: StepBatch | None = None
        """The settled (or restored) batch of step `ready_step`."""
        self.ready_step = -1

    def launch(self, step: int) -> None:
        """Sample step `step`'s prompts (here: the prompt source is not thread-safe) and start
        generating them on the fleet in the background, with the weights it holds now."""
        from rlhf_trainer.dataflow import phases

        if self.pending is not None or self.ready is not None:
            raise RuntimeError(f"rollout ahead: step {step} launched while step {self.pending_step} is held")
        prompts = phases.sample_prompts(self.ctx)
        if not prompts:
            return  # the step itself will say that the prompt source is empty
        self.pending = self.pool.submit(self._generate, prompts, step)
        self.pending_step = step

    def _generate(self, prompts: list[Any], step: int) -> StepBatch:
        from rlhf_trainer.dataflow import phases

        start = time.perf_counter()
        batch = phases.generate(self.ctx, prompts, step=step)
        batch.metrics["rollout/ahead_seconds"] = time.perf_counter() - start
        batch.metrics["data/skipped_prompts"] = float(getattr(self.ctx.dataset, "skipped", 0))
        return batch

    def settle(self) -> float:
        """Wait for the rollout in flight (its error raises here); returns the seconds waited."""
        if self.pending is None:
            return 0.0
        start = time.perf_counter()
        future, self.pending = self.pending, None
        self.ready, self.ready_step = future.result(), self.pending_step
        return time.perf_counter() - start

    def take(self, step: int) -> tuple[StepBatch | None, float]:
        """The batch generated ahead for `step` (waiting for it), or None when there is none;
        and the seconds waited."""
        waited = self.settle()
        if self.ready is None:
            return None, waited
        if self.ready_step != step:
            raise RuntimeError(f"rollout ahead: holds step {self.ready_step}'s batch, step {step} asked")
        batch, self.ready = self.ready, None
        return batch, waited

    # -- checkpoint ------------------------------------------------------------------------------
    def state(self) -> tuple[dict[str, Any], dict[str, Tensor]]:
        """The settled batch for the checkpoint: (JSON-able part, tensors); empty without one."""
        self.settle()
        if self.ready is None:
            return {}, {}
        b = self.ready
        info = {
            "step": self.ready_step,
            "prompts": b.prompts,
            "responses": b.responses,
            "columns": b.columns,
            "messages": b.messages,
            "metrics": b.metrics,
        }
        return info, {TENSOR_PREFIX + k: v.contiguous() for k, v in b.tensors.items()}

    def restore(self, info: dict[str, Any], tensors: dict[str, Tensor]) -> None:
        """Hold the batch a checkpoint saved (`state`) for its step."""
        if not info:
            return
        own = {k[len(TENSOR_PREFIX) :]: v for k, v in tensors.items() if k.startswith(TENSOR_PREFIX)}
        self.ready = StepBatch(
            tensors=own,
            prompts=list(info["prompts"]),
            responses=list(info["responses"]),
            columns=[dict(c) for c in info["columns"]],
            metrics={k: float(v) for k, v in info["metrics"].items()},
            messages=list(info["messages"]),
        )
        self.ready_step = int(info["step"])

    def shutdown(self) -> None:
        """Stop the thread; a rollout still in flight is waited for (its replicas are busy)."""
        if self.pending is not None:
            # The run is ending anyway; an error of this rollout was raised already or is moot.
            with contextlib.suppress(Exception):
                self.pending.result()
            self.pending = None
        self.pool.shutdown(wait=True)
