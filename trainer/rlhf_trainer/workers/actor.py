"""`ActorWorker`: one rank of the policy. It trains the policy, scores batches with it
(`old_log_probs`), exports its weights, and in `colocated` placement also generates the
rollouts itself (the hybrid engine: an `HFRolloutEngine` over the same weights).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from torch import Tensor, nn

from rlhf_trainer.workers import modeling
from rlhf_trainer.workers.training import TrainableWorker


class AlgorithmCache:
    """`Algorithm` instances by (name, params), with the controller's state loaded before use.

    The controller owns the algorithm (advantages, KL-controller state); workers hold copies
    for the loss and receive the current state with every update call.
    """

    def __init__(self) -> None:
        self._built: dict[str, Any] = {}

    def get(self, name: str, params: dict[str, Any], state: dict[str, Any] | None) -> Any:
        from rlhf_trainer.algorithms import build_algorithm

        key = name + json.dumps(params, sort_keys=True, default=str)
        if key not in self._built:
            self._built[key] = build_algorithm(name, params)
        algorithm = self._built[key]
        if state is not None:
            algorithm.load_state_dict(state)
        return algorithm


class GatherCounter:
    """A one-rank, whole-tensor `sync.ReshardPlan` for `SyncGroup.push` whose transform counts
    the tensors materialized so far: after a failed stream the source knows how many FSDP gathers
    the other ranks are still waiting in."""

    def __init__(self, params: Sequence[tuple[str, Tensor]]):
        self.params = params
        self.done = 0

    def metas(self, tp_rank: int, dtypes: Any) -> list[Any]:
        from rlhf_trainer.sync import TensorMeta

        return [TensorMeta.of(name, p) for name, p in self.params]

    def transform(self, tp_rank: int) -> Any:
        def count(name: str, full: Tensor) -> Tensor:
            self.done += 1
            return full

        return count


class ActorWorker(TrainableWorker):
    role = "actor"

    def __init__(self, *args: Any, colocated: bool = False, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.colocated = colocated
        self.engine: Any = None
        self.sync: Any = None
        self.algorithms = AlgorithmCache()

    def build_model(self) -> nn.Module:
        return modeling.load_policy(self.model_path, self.spec.model.dtype)

    def setup(self) -> None:
        super().setup()
        if self.colocated:
            self.engine = self._build_engine()

    def _build_engine(self) -> Any:
        """The hybrid engine. One rank: it samples from the training module itself (no copy, no
        sync). Several ranks: the training module is sharded, so the engine keeps an unsharded copy
        refreshed by `sync_engine` after each update (the training -> inference reshard)."""
        from transformers import AutoTokenizer

        from rlhf_trainer.rollout.hf import HFRolloutEngine

        r = self.spec.rollout
        model = (
            self.model
            if self.world_size == 1
            else modeling.load_policy(self.model_path, self.spec.model.dtype)
        )
        model = model.to(self.device)
        tokenizer = AutoTokenizer.from_pretrained(self.spec.model.tokenizer or self.model_path)
        return HFRolloutEngine(
            model,
            tokenizer,
            max_new_tokens=r.max_new_tokens,
            temperature=r.temperature,
            top_p=r.top_p,
            top_k=r.top_k,
            seed=self.spec.training.seed,
        )

    # -- rollout (colocated) -------------------------------------------------------------------
    def generate(self, prompt_ids: list[list[int]], n: int, step: int) -> dict[str, Any]:
        if self.engine is None:
            raise RuntimeError("ActorWorker.generate: this actor has no engine (placement is not colocated)")
        from rlhf_trainer.workers.distributed import step_seed

        self.engine.set_seed(step_seed(self.spec.training.seed, step, self.rank, stream=1))
        return self.engine.generate(prompt_ids, n).to_dict()  # type: ignore[no-any-return]

    def sync_engine(self) -> None:
        """Copy the trained weights into the colocated engine (a collective when sharded)."""
        if self.engine is None or self.engine.model is self.model:
            return
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        full = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True))
        self.engine.load_weights(full.items())

    # -- weight sync to the rollout fleet (`sync.SyncGroup`; rank 0 is the source) -------------
    def start_sync(self, timeout: float) -> tuple[str, int]:
        """Host the sync group's store (rank 0) and return its address for the replicas."""
        from rlhf_trainer.sync import SyncGroup, connect_store
        from rlhf_trainer.workers.distributed import pick_store_address

        host, port = pick_store_address()
        store = connect_store(host, port, is_source=True, timeout=max(60.0, timeout))
        self.sync = SyncGroup(store, "actor", timeout=timeout, hostname=host)
        return host, port

    def sync_rebuild(self, members: list[str], generation: int) -> None:
        """Rank 0: build membership `generation` (`members[0]` is this rank)."""
        self.sync.rebuild(members, generation)

    def sync_push(self, version: int, verify: bool = False) -> dict[str, Any] | None:
        """Send the current weights to every member; a collective over the actor ranks.

        The FSDP2 shards are gathered one parameter at a time as the stream reaches them (rank
        0 streams, the other ranks `drain_full_tensors` alongside), so no rank holds more than
        the bucket buffers and one full parameter. When an attempt fails (a member died), rank 0
        completes the gathers the stream did not reach, tells the other ranks over the actor
        group to gather once more, and streams again to the survivors. Rank 0 returns what the
        push reported, and with `verify` the weights' digest (one more gather pass)."""
        from rlhf_trainer.sync import SyncError, drain_full_tensors, materialize, tensor_digest

        params = list(self.model.named_parameters())
        if self.rank != 0:
            while True:
                drain_full_tensors(params)
                if not self._sync_retry_flag(False):
                    break
            if verify:
                drain_full_tensors(params)
            return None
        sync, counter = self.sync, GatherCounter(params)
        before = [m for m in sync.members if m != sync.me]
        attempts, limit = 0, sync.max_attempts
        sync.max_attempts = 1  # one stream per gather pass: the retries are driven from here
        try:
            while True:
                attempts += 1
                counter.done = 0
                try:
                    res = sync.push(params, version, plan=counter)  # type: ignore[arg-type]
                    break
                except SyncError:
                    drain_full_tensors(params[counter.done :])  # the gathers the others still wait in
                    if not self._sync_retry_flag(attempts < limit):
                        raise
        finally:
            sync.max_attempts = limit
        self._sync_retry_flag(False)
        return {
            "members": res.members,
            "dropped": [m for m in before if m not in res.members],
            "attempts": attempts,
            "generation": res.generation,
            "epoch": res.epoch,
            "seconds": res.stats.seconds,
            "bytes": res.stats.bytes,
            "peak_extra_bytes": res.stats.peak_extra_bytes,
            # gathered in the stream's order, as the other ranks drain them
            "digest": tensor_digest([(n, materialize(t)) for n, t in params]) if verify else None,
        }

    def _sync_retry_flag(self, retry: bool) -> bool:
        """Rank 0's word to the other actor ranks after a sync attempt: gather again, or done."""
        import torch
        import torch.distributed as dist

        if self.world_size == 1:
            return retry
        flag = torch.tensor([1 if retry else 0])
        dist.broadcast(flag, src=0)
        return bool(flag.item())

    # -- scoring and training ------------------------------------------------------------------
    def compute_log_probs(self, batch: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
        """`old_log_probs` of this rank's share of the batch (see `Worker.forward_shard`)."""
        self.model.eval()
        temperature = self.spec.rollout.temperature
        return self.forward_shard(batch, lambda b: modeling.token_log_probs(self.model, b, temperature)[0])

    def update(
        self,
        batch: dict[str, Tensor],
        step: int,
        algorithm: str,
        params: dict[str, Any],
        state: dict[str, Any],
    ) -> dict[str, float]:
        """The policy update of one training step with `algorithm`'s loss."""
        algo = self.algorithms.get(algorithm, params, state)
        temperature = self.spec.rollout.temperature

        def loss_fn(micro: dict[str, Any]) -> dict[str, Any]:
            log_probs, entropy = modeling.token_log_probs(self.model, micro, temperature, with_entropy=True)
            micro = {**micro, "log_probs": log_probs, "entropy": entropy}
            if micro.get("old_log_probs") is None:
                # One update per batch: the sampling policy is the current one (ratio 1).
                micro["old_log_probs"] = log_probs.detach()
            return algo.compute_loss(micro)  # type: ignore[no-any-return]

        return self.train_batch(batch, step, loss_fn)
