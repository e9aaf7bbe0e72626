"""`RolloutWorker`: a generation engine of the disaggregated rollout fleet.

Weights arrive through the weight-sync group (`sync.SyncGroup`): `join_sync` connects the
replica to the group's store (hosted by actor rank 0), `sync_rebuild` joins a membership
generation, and `sync_receive` takes one bucketed broadcast straight into the engine's parameters.
Every sample carries the policy version it was generated with.
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch

from rlhf_trainer.workers.base import Worker
from rlhf_trainer.workers.distributed import rendezvous_host


class RolloutWorker(Worker):
    role = "rollout"

    def setup(self) -> None:
        from rlhf_api.job import max_model_length
        from rlhf_trainer.rollout import build_engine

        self.engine = build_engine(
            self.spec.rollout,
            self.model_path,
            self.spec.model.dtype,
            self.device,
            seed=self.spec.training.seed,
            tokenizer_path=self.spec.model.tokenizer,
            max_model_len=max_model_length(self.spec),
        )
        self.version = 0
        self.sync: Any = None
        from rlhf_trainer.rollout.multiturn import EpisodeGenerator

        self.episodes = EpisodeGenerator(self.spec.rollout)

    def pid(self) -> int:
        """This replica's process id (the kill tests and the logs name it)."""
        return os.getpid()

    # -- weight sync (`sync.SyncGroup`; the controller drives all members at once) -------------
    def join_sync(self, address: tuple[str, int], me: str, timeout: float, backend: str = "gloo") -> None:
        """Connect to the sync group's store at `address` as member `me` (no generation yet);
        `backend` nccl receives on this replica's GPU."""
        from rlhf_trainer.sync import SyncGroup, connect_store

        store = connect_store(address[0], address[1], is_source=False, timeout=max(60.0, timeout))
        # The gloo device binds to this pod's IP, where the source on the actor's pod reaches it.
        device = self.device if backend == "nccl" else None
        self.sync = SyncGroup(
            store,
            me,
            timeout=timeout,
            hostname=rendezvous_host(),
            backend=backend,  # type: ignore[arg-type]
            device=device,
        )

    def sync_rebuild(self, members: list[str], generation: int) -> bool:
        """Join membership `generation` (or leave the group when not listed); True when a member."""
        self.sync.rebuild(members, generation)
        return bool(self.sync.active)

    def sync_receive(self, verify: bool = False) -> dict[str, Any]:
        """Receive one weight sync into the engine. `dropped` when the source declared this replica
        dead (it then serves no more; the controller replaces it); `digest` (with `verify`) hashes
        the engine's weights after the sync, to compare with the actor's."""
        from rlhf_trainer.sync import DroppedError, WeightReceiver

        t0 = time.perf_counter()
        model = getattr(self.engine, "model", None)
        sink = WeightReceiver(model) if isinstance(model, torch.nn.Module) else WeightReceiver()
        try:
            stats = self.sync.receive(sink)
        except DroppedError:
            return {"dropped": True}
        if sink.targets is None:  # an engine without an nn.Module: load what was collected
            self.engine.load_weights(sink.tensors.items())
        self.version = int(stats.version)
        out: dict[str, Any] = {"version": self.version, "seconds": time.perf_counter() - t0}
        if verify:
            out["digest"] = self.weights_digest(sink.received)
        return out

    def weights_digest(self, names: list[str]) -> str:
        """SHA-256 of the engine's parameters (`sync.tensor_digest`): an engine with a module (hf)
        hashes its parameters; one without (vllm) its weights of `names`, the sync's."""
        from rlhf_trainer.sync import tensor_digest

        model = getattr(self.engine, "model", None)
        if isinstance(model, torch.nn.Module):
            return tensor_digest(model.named_parameters())
        named_weights = getattr(self.engine, "named_weights", None)  # vllm's
        if named_weights is None:
            raise RuntimeError(
                f"verify: rollout engine {type(self.engine).__name__} exposes no weights to hash"
            )
        return tensor_digest(named_weights(names))

    def generate(
        self,
        prompt_ids: list[list[int]],
        n: int,
        step: int,
        delay_per_prompt: float = 0.0,
        greedy: bool = False,
        temperature: float | None = None,
    ) -> dict[str, Any]:
        """`n` samples per prompt; `greedy`: temperature 0 (ReMax's baseline responses);
        `temperature`: in place of the rollout's (the evaluation's own; None: the rollout's).
        `delay_per_prompt` adds seconds per prompt (a test knob that makes a replica slower, to
        induce load on the fleet)."""
        if delay_per_prompt > 0:
            time.sleep(delay_per_prompt * len(prompt_ids))
        self.seed_generation(self.engine, step)
        out = self.episodes.generate(
            self.engine, prompt_ids, n, greedy=greedy, temperature=temperature
        ).to_dict()
        out["policy_version"] = torch.full((len(out["prompt_index"]),), self.version, dtype=torch.long)
        return out  # type: ignore[no-any-return]
