"""`ActorWorker`: one rank of the policy. It trains the policy, scores batches with it
(`old_log_probs`), exports its weights, and in `colocated` placement also generates the
rollouts itself (the hybrid engine: an `HFRolloutEngine` over the same weights, or the
`rollout.engine` asked for, e.g. a vLLM engine in this process that gets the weights after
every update).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from rlhf_trainer.algorithms import off_policy
from rlhf_trainer.workers import lora, modeling
from rlhf_trainer.workers.training import TrainableWorker, UpdateBranch, branch_losses


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
    the other ranks are still waiting in. Floating tensors are sent in `dtype` (the engines'
    compute dtype: the fp32 master weights are not what they serve, and cost twice the bytes)."""

    def __init__(self, params: Sequence[tuple[str, Tensor]], dtype: torch.dtype | None = None):
        self.params = params
        self.dtype = dtype
        self.done = 0

    def wire_dtype(self, t: Tensor) -> torch.dtype:
        return self.dtype if self.dtype is not None and t.is_floating_point() else t.dtype

    def metas(self, tp_rank: int, dtypes: Any) -> list[Any]:
        from rlhf_trainer.sync import TensorMeta

        return [
            TensorMeta(name, tuple(int(s) for s in p.shape), str(self.wire_dtype(p)).removeprefix("torch."))
            for name, p in self.params
        ]

    def transform(self, tp_rank: int) -> Any:
        def count(name: str, full: Tensor) -> Tensor:
            self.done += 1
            return full.to(self.wire_dtype(full))

        return count


class ActorWorker(TrainableWorker):
    role = "actor"

    def __init__(self, *args: Any, colocated: bool = False, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.colocated = colocated
        self.engine: Any = None
        self.sync: Any = None
        self.algorithms = AlgorithmCache()

    def build_model(self, meta: bool = False) -> nn.Module:
        model = modeling.load_policy(self.model_path, "float32", meta=meta)  # master weights; see `compute`
        lora_spec = self.spec.model.lora
        if lora_spec is None:
            return model
        # Adapters only: the base weights are frozen, and are the reference policy (`reference_mode`).
        # A is initialised at random: seeded, so every FSDP rank (each shards its own copy) and every
        # restart start from the same adapter.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.spec.training.seed)
            return lora.apply_lora(
                model, lora_spec.rank, lora_spec.alpha, lora_spec.dropout, lora_spec.target_modules
            )

    @property
    def uses_lora(self) -> bool:
        return self.spec.model.lora is not None

    @property
    def sharded_checkpoints(self) -> bool:
        """LoRA keeps the gathered part: the merged weights for `rlhf export`, the (small) adapter
        and its optimizer state for resume."""
        return super().sharded_checkpoints and not self.uses_lora

    def merged_weights(self) -> list[tuple[str, Tensor]]:
        """LoRA: the policy's parameters with the adapters merged in, under the base model's names
        and in the base model's parameter order (tied weights once), as the engines load them.
        A collective when sharded (every rank gathers the full state and gets the result)."""
        if self.world_size == 1:
            state = {k: v.detach() for k, v in self.model.state_dict().items()}
        else:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

            state = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True))
        merged = lora.merge_lora_state(state, lora.scaling_of(self.model))
        names = lora.base_parameter_names([n for n, _ in self.model.named_parameters()])
        return [(n, merged[n]) for n in names]

    def setup(self) -> None:
        super().setup()
        if self.colocated:
            self.engine = self._build_engine()

    def write_model_files(self, out: Path) -> None:
        """The checkpoint's actor part carries what `rlhf export` turns into a Hugging Face model
        directory besides the weights: `config.json`, `generation_config.json`, `tokenizer/`."""
        import copy

        from transformers import AutoTokenizer

        model: Any = self.model  # a transformers model (FSDP2 keeps its attributes)
        # The weights train in fp32 (master weights); the model is the job's compute dtype, which
        # `rlhf export --dtype auto` writes.
        config = copy.deepcopy(model.config)
        config.dtype = modeling.compute_dtype(self.spec.model.dtype)
        config.save_pretrained(out)
        generation = getattr(model, "generation_config", None)
        if generation is not None:
            generation.save_pretrained(out)
        tokenizer = getattr(self.engine, "tokenizer", None) or AutoTokenizer.from_pretrained(
            self.spec.model.tokenizer or self.model_path
        )
        tokenizer.save_pretrained(out / "tokenizer")

    def _build_engine(self) -> Any:
        """The hybrid engine. One rank: it samples from the training module itself (no copy, no
        sync). Several ranks: the training module is sharded, so the engine keeps an unsharded copy
        refreshed by `sync_engine` after each update (the training -> inference reshard)."""
        from transformers import AutoTokenizer

        from rlhf_api.job import max_model_length
        from rlhf_trainer.rollout.hf import HFRolloutEngine

        r = self.spec.rollout
        if r.engine != "hf":
            # Any other engine (`vllm`) holds its own copy of the weights, loaded from the model
            # path and refreshed by `sync_engine` after every update and load.
            from rlhf_trainer.rollout import build_engine

            return build_engine(
                r,
                self.model_path,
                self.spec.model.dtype,
                self.device,
                seed=self.spec.training.seed,
                tokenizer_path=self.spec.model.tokenizer,
                max_model_len=max_model_length(self.spec),
                colocated=True,
            )
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
            max_model_len=max_model_length(self.spec),
        )

    # -- rollout (colocated) -------------------------------------------------------------------
    def generate(
        self,
        prompt_ids: list[list[int]],
        n: int,
        step: int,
        greedy: bool = False,
        temperature: float | None = None,
    ) -> dict[str, Any]:
        """`n` samples per prompt; `greedy`: temperature 0 (ReMax's baseline responses);
        `temperature`: in place of the rollout's (the evaluation's own; None: the rollout's)."""
        if self.engine is None:
            raise RuntimeError("ActorWorker.generate: this actor has no engine (placement is not colocated)")
        self.seed_generation(self.engine, step)
        episodes = self.episodes()
        if hasattr(self.engine, "llm"):  # vLLM runs its own dtype: no autocast around its forward
            out = episodes.generate(
                self.engine, prompt_ids, n, greedy=greedy, temperature=temperature
            ).to_dict()
        else:
            with self.compute():  # one rank: samples from the fp32 training module in the compute dtype
                out = episodes.generate(
                    self.engine, prompt_ids, n, greedy=greedy, temperature=temperature
                ).to_dict()
        sleep = getattr(self.engine, "sleep", None)
        if sleep is not None:  # vllm colocated on a GPU: its memory goes to training until the sync
            sleep()
        return out  # type: ignore[no-any-return]

    def episodes(self) -> Any:
        """The generator of samples or multi-turn episodes (`rollout.multiturn.EpisodeGenerator`)."""
        if getattr(self, "_episodes", None) is None:
            from rlhf_trainer.rollout.multiturn import EpisodeGenerator

            self._episodes = EpisodeGenerator(self.spec.rollout)
        return self._episodes

    def sync_engine(self) -> None:
        """Copy the trained weights into the colocated engine (a collective when sharded). Every
        call that changes the weights ends with it (`update`, `load`), on every rank alike."""
        if self.engine is None or getattr(self.engine, "model", None) is self.model:
            return
        if self.uses_lora:  # the engine is a plain copy of the base model: it gets merged weights
            self.engine.load_weights(self.merged_weights())
            return
        if self.world_size == 1:  # a separate engine (vllm) over an unsharded model: every name
            self.engine.load_weights((k, v.detach()) for k, v in self.model.state_dict().items())
            return
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        full = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True))
        self.engine.load_weights(full.items())

    # -- weight sync to the rollout fleet (`sync.SyncGroup`; rank 0 is the source) -------------
    def start_sync(self, timeout: float, backend: str = "gloo") -> tuple[str, int]:
        """Host the sync group's store (rank 0) and return its address for the replicas. `backend`
        nccl streams from this rank's GPU (the store stays the control channel)."""
        from rlhf_trainer.sync import SyncGroup, connect_store
        from rlhf_trainer.workers.distributed import pick_store_address

        host, port = pick_store_address()
        store = connect_store(host, port, is_source=True, timeout=max(60.0, timeout))
        device = self.device if backend == "nccl" else None
        self.sync = SyncGroup(store, "actor", timeout=timeout, hostname=host, backend=backend, device=device)  # type: ignore[arg-type]
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

        if self.uses_lora:
            return self._sync_push_merged(version, verify)
        params = list(self.model.named_parameters())
        if self.rank != 0:
            while True:
                drain_full_tensors(params)
                if not self._sync_retry_flag(False):
                    break
            if verify:
                drain_full_tensors(params)
            return None
        wire = modeling.compute_dtype(self.spec.model.dtype)
        sync, counter = self.sync, GatherCounter(params, wire)
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
            "digest": tensor_digest([(n, counter.transform(0)(n, materialize(t))) for n, t in params])
            if verify
            else None,
        }

    def _sync_push_merged(self, version: int, verify: bool) -> dict[str, Any] | None:
        """LoRA: every rank gathers the full state once (`merged_weights`); rank 0 merges and
        streams the merged base-named weights, retrying on its own (nothing left to gather)."""
        from rlhf_trainer.sync import tensor_digest

        params = self.merged_weights()
        if self.rank != 0:
            return None
        sync = self.sync
        counter = GatherCounter(params, modeling.compute_dtype(self.spec.model.dtype))
        before = [m for m in sync.members if m != sync.me]
        res = sync.push(params, version, plan=counter)  # type: ignore[arg-type]
        return {
            "members": res.members,
            "dropped": [m for m in before if m not in res.members],
            "attempts": res.attempts,
            "generation": res.generation,
            "epoch": res.epoch,
            "seconds": res.stats.seconds,
            "bytes": res.stats.bytes,
            "peak_extra_bytes": res.stats.peak_extra_bytes,
            "digest": tensor_digest([(n, counter.transform(0)(n, t)) for n, t in params]) if verify else None,
        }

    def _sync_retry_flag(self, retry: bool) -> bool:
        """Rank 0's word to the other actor ranks after a sync attempt: gather again, or done."""
        import torch
        import torch.distributed as dist

        if self.world_size == 1:
            return retry
        from rlhf_trainer.workers.distributed import group_device

        flag = torch.tensor([1 if retry else 0], device=group_device())  # NCCL: on the rank's GPU
        dist.broadcast(flag, src=0)
        return bool(flag.item())

    # -- scoring and training ------------------------------------------------------------------
    def compute_log_probs(self, batch: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
        """`old_log_probs` of this rank's share of the batch (see `Worker.forward_shard`)."""
        self.model.eval()
        temperature = self.spec.rollout.temperature
        return self.forward_shard(
            batch, lambda b: modeling.token_log_probs(self.model, b, temperature, layout=self.layout)[0]
        )

    def compute_ref_log_probs(self, batch: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
        """LoRA: `ref_log_probs` of this rank's share, from the base model (adapters disabled),
        the reference policy without a second copy of the model."""
        if not self.uses_lora:
            raise RuntimeError(
                "ActorWorker.compute_ref_log_probs: only with spec.model.lora (else a reference role)"
            )
        self.model.eval()
        temperature = self.spec.rollout.temperature
        with lora.reference_mode(self.model):
            return self.forward_shard(
                batch, lambda b: modeling.token_log_probs(self.model, b, temperature, layout=self.layout)[0]
            )

    # -- checkpoint: LoRA keeps merged weights for `rlhf export` and the adapter for resume -----
    def write_weights(self, out: Path, model_state: dict[str, Tensor]) -> None:
        if not self.uses_lora:
            return super().write_weights(out, model_state)
        from safetensors.torch import save_file

        merged = lora.merge_lora_state(model_state, lora.scaling_of(self.model))
        save_file({k: v.detach().contiguous().clone() for k, v in merged.items()}, out / "model.safetensors")
        lora.save_adapter(self.model, model_state, out / lora.ADAPTER_DIR)

    def load_weights(self, src: Path) -> None:
        if not self.uses_lora:
            return super().load_weights(src)
        if not (src / lora.ADAPTER_DIR / "adapter_model.safetensors").is_file():
            raise FileNotFoundError(
                f"{src}: no {lora.ADAPTER_DIR}/adapter_model.safetensors; spec.model.lora is set, so the "
                "checkpoint must come from a LoRA run (spec.model.lora is immutable)"
            )
        modeling.load_full_state_dict(
            self.model, lora.load_adapter_state(src / lora.ADAPTER_DIR), strict=False
        )

    def update(self, batch: dict[str, Tensor], step: int, branches: list[UpdateBranch]) -> dict[str, float]:
        """The policy update of one training step: each row trained by its branch's algorithm
        (one branch, or `batch["branch_index"]` choosing), one forward pass per micro-batch."""
        algos = [self.algorithms.get(b.algorithm, b.params, b.state) for b in branches]
        metrics = self.train_batch(
            batch, step, lambda micro: self.micro_loss(micro, branches, algos), branches=len(branches)
        )
        self.sync_engine()  # colocated: the weight-sync phase, fused into this call
        return metrics

    def load(self, step_dir: str) -> None:
        """Restore a checkpoint (`TrainableWorker.load`), and the colocated engine's copy with it."""
        super().load(step_dir)
        self.sync_engine()

    def micro_loss(
        self, micro: dict[str, Any], branches: Sequence[UpdateBranch], algos: Sequence[Any]
    ) -> dict[str, Any]:
        """The loss of one micro-batch (with grad): one forward pass of the policy over the
        response positions, then each branch's `compute_loss`.

        Without `old_log_probs` in the batch (`phases.policy_log_probs` skipped that pass: the
        batch is trained once, in one optimizer step, so no weight changed since the rollout) the
        old log-probs are this pass's own, detached: the ratio is exactly 1, as the skipped pass
        would have made it. The entropy is computed only for algorithms that read it.

        With `behaviour_log_probs` in the batch (a stale batch of asynchronous rollouts,
        `phases.behaviour_log_probs`) each token's advantage is multiplied by its truncated
        importance weight min(pi_old / pi_behav, `rollout.importanceWeightCap`), pi_old the old
        log-probs the loss uses (the proximal policy): the decoupled PPO loss of
        `algorithms.off_policy`, whose gradient is the one of pi_theta / pi_behav. With the old
        log-probs this pass's own (skipped pass) that is exact too: the weights do not move
        within the batch's one optimizer step."""
        with_entropy = any(getattr(a, "needs_entropy", True) for a in algos)
        log_probs, entropy = modeling.token_log_probs(
            self.model, micro, self.spec.rollout.temperature, with_entropy=with_entropy, layout=self.layout
        )
        micro = {**micro, "log_probs": log_probs}
        if entropy is not None:
            micro["entropy"] = entropy

        def loss_of(algo: Any, rows: dict[str, Any]) -> dict[str, Any]:
            if rows.get("old_log_probs") is None:
                rows = {**rows, "old_log_probs": rows["log_probs"].detach()}
            behaviour = rows.get("behaviour_log_probs")
            if behaviour is None:
                return algo.compute_loss(rows)  # type: ignore[no-any-return]
            rows = {k: v for k, v in rows.items() if k != "behaviour_log_probs"}
            weights, corrected = off_policy.truncated_importance_weights(
                rows["old_log_probs"],
                behaviour,
                rows["response_mask"],
                cap=self.spec.rollout.importance_weight_cap,
            )
            if rows.get("advantages") is not None:
                rows["advantages"] = off_policy.weighted_advantages(rows["advantages"], weights)
            return {**algo.compute_loss(rows), **corrected}

        out = branch_losses(micro, branches, algos, loss_of, self.role)
        engine_lp = micro.get("rollout_log_probs")
        if engine_lp is not None:
            # `rollout/logprob_mismatch`: mean |trainer - rollout engine| log-prob per response
            # token. Exactly the engine-vs-trainer gap when the batch is trained in one optimizer
            # step; with several, later ones add the policy's own drift since the rollout.
            mask = micro["response_mask"]
            tokens = float(mask.sum())
            if tokens > 0:
                gap = ((log_probs.detach() - engine_lp.to(log_probs.dtype)).abs() * mask).sum() / tokens
                out["rollout/logprob_mismatch"] = float(gap)
                out["metric_tokens"] = {**out.get("metric_tokens", {}), "rollout/logprob_mismatch": tokens}
        return out
