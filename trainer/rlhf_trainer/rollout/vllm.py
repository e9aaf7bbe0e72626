"""`vllm` rollout engine (GPU only), written against vLLM's offline `LLM` API.

vLLM is imported when an engine is built, never at module import, so CPU installs work without
it. Log-probs are requested as `processed_logprobs` (after temperature and top-k/top-p) so that
they mean the same as the `hf` engine's (`rollout.sampling`); vLLM versions without
`logprobs_mode` report raw model log-probs instead (noted in `logprobs_are_processed`).
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable
from typing import Any

import torch

from rlhf_trainer.rollout.batch import RolloutBatch
from rlhf_trainer.rollout.sampling import check_sampling_params


def _load_weights_on_worker(worker: Any, weights: list[tuple[str, torch.Tensor]]) -> int:
    """Runs inside each vLLM worker (via `collective_rpc`)."""
    model = worker.model_runner.model
    model.load_weights(weights=[(n, t.to(next(model.parameters()).device)) for n, t in weights])
    return len(weights)


class VLLMRolloutEngine:
    """Sampling with vLLM. Same surface as `HFRolloutEngine`."""

    def __init__(
        self,
        llm: Any,
        tokenizer: Any,
        *,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int = 0,
    ):
        check_sampling_params(max_new_tokens, temperature, top_p)
        self.llm = llm
        self.tokenizer = tokenizer
        self.max_new_tokens = max_new_tokens
        self.temperature = temperature
        self.top_p = top_p
        self.top_k = top_k
        self.seed = seed
        self._calls = 0
        self.logprobs_are_processed = False
        pad = getattr(tokenizer, "pad_token_id", None)
        self.pad_token_id = int(pad if pad is not None else tokenizer.eos_token_id)
        self.weights_version = 0

    @classmethod
    def from_pretrained(
        cls,
        model_path: str,
        *,
        tokenizer_path: str | None = None,
        dtype: str = "bfloat16",
        device: str | torch.device = "cuda",
        tensor_parallel_size: int = 1,
        gpu_memory_utilization: float = 0.5,
        **kwargs: Any,
    ) -> VLLMRolloutEngine:
        if not torch.cuda.is_available():
            raise RuntimeError("rollout engine `vllm` needs a CUDA GPU; use engine `hf` on CPU")
        try:
            from vllm import LLM
        except ImportError as err:
            raise RuntimeError(
                "rollout engine `vllm` needs the vllm package: pip install 'rlhf-operator[gpu]'"
            ) from err
        # `collective_rpc` ships `_load_weights_on_worker` to the engine's worker processes by
        # pickling it, which vLLM V1 allows only with this opt-in.
        os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
        llm_kwargs: dict[str, Any] = {
            "model": os.path.expanduser(model_path),
            "tokenizer": os.path.expanduser(tokenizer_path or model_path),
            "dtype": dtype,
            "seed": kwargs.get("seed", 0),
            "tensor_parallel_size": tensor_parallel_size,
            "gpu_memory_utilization": gpu_memory_utilization,
            "enable_prefix_caching": True,
        }
        processed = True
        try:
            llm = LLM(**llm_kwargs, logprobs_mode="processed_logprobs")
        except TypeError:  # vLLM without logprobs_mode
            llm = LLM(**llm_kwargs)
            processed = False
        engine = cls(llm, llm.get_tokenizer(), **kwargs)
        engine.logprobs_are_processed = processed
        return engine

    def set_seed(self, seed: int) -> None:
        self.seed = int(seed)
        self._calls = 0

    def state_dict(self) -> dict[str, torch.Tensor]:
        def _get(worker: Any) -> dict[str, torch.Tensor]:
            return {k: v.cpu() for k, v in worker.model_runner.model.state_dict().items()}

        return self.llm.collective_rpc(_get)[0]

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Push new weights into every vLLM worker (HF parameter names; vLLM maps them)."""
        weights = [(n, t.detach()) for n, t in named_tensors]
        if hasattr(self.llm, "collective_rpc"):
            counts = self.llm.collective_rpc(_load_weights_on_worker, args=(weights,))
            loaded = int(counts[0])
        else:  # older vLLM (V0 engine) with the driver worker in this process
            model = self.llm.llm_engine.model_executor.driver_worker.model_runner.model
            model.load_weights(weights)
            loaded = len(weights)
        if hasattr(self.llm, "reset_prefix_cache"):
            self.llm.reset_prefix_cache()  # cached KV was computed with the old weights
        self.weights_version += 1
        return loaded

    def generate(self, prompt_ids: list[list[int]], n: int = 1, greedy: bool = False) -> RolloutBatch:
        """`n` samples per prompt; `greedy`: temperature 0 whatever the engine's settings."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        if not prompt_ids:
            raise ValueError("generate: no prompts given")
        greedy = greedy or self.temperature <= 0
        params = SamplingParams(
            n=n,
            temperature=0.0 if greedy else self.temperature,
            top_p=self.top_p,
            top_k=self.top_k if self.top_k > 0 else -1,
            max_tokens=self.max_new_tokens,
            logprobs=0,  # the sampled token's log-prob only
            seed=self.seed + self._calls,
        )
        self._calls += 1
        outputs = self.llm.generate(
            [TokensPrompt(prompt_token_ids=list(p)) for p in prompt_ids], params, use_tqdm=False
        )
        rows: list[tuple[list[int], list[int], list[float], bool]] = []
        index: list[int] = []
        for i, (prompt, out) in enumerate(zip(prompt_ids, outputs)):
            for comp in out.outputs:
                ids = list(comp.token_ids)
                lps = []
                for tok, entry in zip(ids, comp.logprobs or []):
                    lp = entry[tok].logprob
                    lps.append(float(lp) if math.isfinite(lp) else 0.0)
                rows.append((list(prompt), ids, lps, comp.finish_reason == "stop"))
                index.append(i)
        b = len(rows)
        p_len = max(len(r[0]) for r in rows)
        t_len = max(1, max(len(r[1]) for r in rows))
        pad = self.pad_token_id
        prompt_t = torch.full((b, p_len), pad, dtype=torch.long)
        prompt_m = torch.zeros((b, p_len), dtype=torch.long)
        resp = torch.full((b, t_len), pad, dtype=torch.long)
        mask = torch.zeros((b, t_len), dtype=torch.float32)
        logp = torch.zeros((b, t_len), dtype=torch.float32)
        finished = torch.zeros(b, dtype=torch.bool)
        for r, (p, ids, lps, done) in enumerate(rows):
            prompt_t[r, p_len - len(p) :] = torch.tensor(p)
            prompt_m[r, p_len - len(p) :] = 1
            if ids:
                resp[r, : len(ids)] = torch.tensor(ids)
                mask[r, : len(ids)] = 1.0
                logp[r, : len(lps)] = torch.tensor(lps)
            finished[r] = done
        return RolloutBatch(prompt_t, prompt_m, resp, mask, logp, index, pad, finished)
