"""`hf` rollout engine: batched sampling from a transformers causal LM, on CPU or GPU.

A manual decoding loop over the model's KV cache: the left-padded prompts go through one
forward pass (each prompt once, its cache then repeated to its samples: `_prefill`), then one
token per step for every row until each row has produced EOS or
`max_new_tokens` tokens. Positions are counted from each row's first real token, so a prompt
gives the same tokens and log-probs alone or left-padded inside a batch.
"""

from __future__ import annotations

import inspect
import logging
import os
from collections.abc import Iterable
from typing import Any

import torch

from rlhf_trainer.rollout.batch import RolloutBatch
from rlhf_trainer.rollout.sampling import check_sampling_params, sample_tokens

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def torch_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; valid: {', '.join(DTYPES)}")
    return DTYPES[name]


def eos_token_ids_of(model: Any, tokenizer: Any) -> set[int]:
    """Every id that ends a response: the tokenizer's EOS and the model's generation-config EOS ids."""
    ids: set[int] = set()
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(int(tokenizer.eos_token_id))
    gen = getattr(model, "generation_config", None)
    cfg_eos = getattr(gen, "eos_token_id", None) if gen is not None else None
    if cfg_eos is None:
        cfg_eos = getattr(model.config, "eos_token_id", None)
    if isinstance(cfg_eos, int):
        ids.add(cfg_eos)
    elif cfg_eos:
        ids.update(int(i) for i in cfg_eos)
    if not ids:
        raise ValueError(
            "the tokenizer and the model config define no EOS token; the engine cannot stop rows"
        )
    return ids


def _cache_of(out: Any) -> Any:
    cache = getattr(out, "cache", None)
    return cache if cache is not None else out.past_key_values


def why_not_repeatable(cache: Any) -> str | None:
    """None when `cache.batch_repeat_interleave` repeats all of its state along the batch: a
    `DynamicCache` of plain or sliding-window attention layers. Other layers (linear attention's
    conv and recurrent states, static or quantized caches) keep state that method may leave
    unrepeated, so they are refused by name rather than trusted."""
    try:
        from transformers.cache_utils import DynamicCache, DynamicLayer, DynamicSlidingWindowLayer
    except ImportError:
        return "this transformers has no DynamicCache layers"
    if type(cache) is not DynamicCache:
        return f"the model's cache is a {type(cache).__name__}, not a DynamicCache"
    kinds = {type(layer) for layer in cache.layers} - {DynamicLayer, DynamicSlidingWindowLayer}
    if kinds:
        return f"the cache has {sorted(k.__name__ for k in kinds)} layers"
    return None


def why_not_repeated(cache: Any, rows: int) -> str | None:
    """None when every filled layer of the repeated `cache` holds `rows` rows (a layer the
    prefill left empty, e.g. one that shares another's cache, fills itself when used)."""
    filled = [layer for layer in cache.layers if layer.is_initialized and layer.keys.numel()]
    sizes = {(int(layer.keys.shape[0]), int(layer.values.shape[0])) for layer in filled}
    if not filled or sizes != {(rows, rows)}:
        return f"the repeated cache holds {sorted(sizes)} rows, not {rows}"
    return None


#: Decode steps between host reads of the stop flag on an accelerator (`finish_check_every`).
FINISH_CHECK_EVERY = 8


class HFRolloutEngine:
    """Sampling with KV cache from a `transformers` causal LM.

    The model may be shared with a training worker (colocated placement): the engine never
    changes `requires_grad`, and restores the model's train/eval mode after each call.
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int = 0,
        eos_token_ids: Iterable[int] | None = None,
        max_model_len: int | None = None,
    ):
        """`eos_token_ids` overrides the stop tokens (default: the tokenizer's EOS and the model's
        generation-config EOS ids). `max_model_len`: the longest prompt + response, as vLLM's
        `max_model_len` (a longer prompt is refused, a response stops at the bound)."""
        check_sampling_params(max_new_tokens, temperature, top_p)
        self.max_model_len = max_model_len
        self.model = model
        self.tokenizer = tokenizer
        self.max_new_tokens = max_new_tokens
        self.temperature = temperature
        self.top_p = top_p
        self.top_k = top_k
        self.eos_ids = set(eos_token_ids) if eos_token_ids is not None else eos_token_ids_of(model, tokenizer)
        pad = getattr(tokenizer, "pad_token_id", None)
        self.pad_token_id = int(pad if pad is not None else min(self.eos_ids, default=0))
        self.device = next(model.parameters()).device
        self.generator = torch.Generator(device=self.device)
        #: Decode steps between checks of "has every row stopped?". The check reads a flag back
        #: to the host, which on an accelerator waits for every queued kernel: once per token it
        #: would stall the GPU's queue each step. On the CPU the read costs nothing.
        self.finish_check_every = 1 if self.device.type == "cpu" else FINISH_CHECK_EVERY
        self.set_seed(seed)
        self.weights_version = 0
        # transformers 5 renamed `past_key_values` to `cache` and `num_logits_to_keep` to
        # `logits_to_keep`; use whichever this model's forward accepts.
        params = inspect.signature(model.forward).parameters
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"
        keep = next((k for k in ("logits_to_keep", "num_logits_to_keep") if k in params), None)
        self._keep_last: dict[str, int] = {keep: 1} if keep else {}
        #: Prefill each prompt once and repeat its KV cache to its samples (`_prefill`); turned
        #: off, with a log line, the first time the model's cache cannot be repeated.
        self.share_prefill = True

    @classmethod
    def from_pretrained(
        cls,
        model_path: str,
        *,
        tokenizer_path: str | None = None,
        dtype: str | torch.dtype = "float32",
        device: str | torch.device = "cpu",
        **kwargs: Any,
    ) -> HFRolloutEngine:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model_path = os.path.expanduser(model_path)
        tokenizer = AutoTokenizer.from_pretrained(os.path.expanduser(tokenizer_path or model_path))
        model: Any = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch_dtype(dtype))
        model.to(device)
        model.eval()
        return cls(model, tokenizer, **kwargs)

    def set_seed(self, seed: int) -> None:
        """Reseed the sampling generator: the same seed, weights and prompts give the same batch."""
        self.generator.manual_seed(int(seed))

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.model.state_dict()

    @torch.no_grad()
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Copy new weights in place (names as in `model.state_dict()`); returns how many were loaded.

        Missing names keep their values (a partial update is allowed); an unknown name is an error.
        """
        own = self.model.state_dict()
        loaded = 0
        for name, tensor in named_tensors:
            if name not in own:
                raise KeyError(
                    f"load_weights: {name!r} is not a parameter of the rollout model (e.g. {next(iter(own))!r})"
                )
            if own[name].shape != tensor.shape:
                raise ValueError(
                    f"load_weights: {name!r} has shape {tuple(tensor.shape)}, the rollout model expects {tuple(own[name].shape)}"
                )
            own[name].copy_(tensor.to(own[name].device, own[name].dtype))
            loaded += 1
        self.weights_version += 1
        return loaded

    @torch.no_grad()
    def generate(
        self, prompt_ids: list[list[int]], n: int = 1, greedy: bool = False, temperature: float | None = None
    ) -> RolloutBatch:
        """Sample `n` responses per prompt (rows of one prompt adjacent). See `RolloutBatch`.
        `greedy`: decode with temperature 0 (argmax) whatever the engine's sampling settings;
        `temperature`: this call's temperature in place of the engine's (None: the engine's)."""
        if not prompt_ids:
            raise ValueError("generate: no prompts given")
        for i, p in enumerate(prompt_ids):
            if len(p) == 0:
                raise ValueError(f"generate: prompt {i} is empty (a prompt needs at least one token)")
        rows = [list(p) for p in prompt_ids for _ in range(n)]
        index = [i for i in range(len(prompt_ids)) for _ in range(n)]
        b, p_len = len(rows), max(len(r) for r in rows)
        if self.max_model_len is not None and p_len >= self.max_model_len:
            raise ValueError(
                f"generate: a prompt of {p_len} tokens leaves no room for a response within "
                f"spec.rollout.maxModelLength = {self.max_model_len}; valid: prompts shorter than that"
            )
        dev = self.device
        prompt = torch.full((b, p_len), self.pad_token_id, dtype=torch.long)
        prompt_mask = torch.zeros((b, p_len), dtype=torch.long)
        for r, ids in enumerate(rows):
            prompt[r, p_len - len(ids) :] = torch.tensor(ids, dtype=torch.long)
            prompt_mask[r, p_len - len(ids) :] = 1
        prompt, prompt_mask = prompt.to(dev), prompt_mask.to(dev)

        was_training = self.model.training
        self.model.eval()
        try:
            tokens, logps, alive_mask, finished = self._decode(
                prompt, prompt_mask, greedy, group=n, temperature=temperature
            )
        finally:
            self.model.train(was_training)
        return RolloutBatch(
            prompt_ids=prompt.cpu(),
            prompt_mask=prompt_mask.cpu(),
            response_ids=tokens.cpu(),
            response_mask=alive_mask.cpu(),
            log_probs=logps.cpu(),
            prompt_index=index,
            pad_token_id=self.pad_token_id,
            finished=finished.cpu(),
        )

    def _prefill(
        self, prompt: torch.Tensor, prompt_mask: torch.Tensor, positions: torch.Tensor, group: int
    ) -> tuple[Any, torch.Tensor]:
        """The prompts' forward pass: (KV cache, last position's logits `(B, V)`). The rows come
        in runs of `group` copies of one prompt (`generate`), so each prompt goes through the model
        once and its cache and logits are repeated to its run: what the copies would compute,
        since attention never mixes rows. Where the model's cache cannot be repeated along the
        batch, every row goes through the model (logged once)."""
        if group > 1 and self.share_prefill:
            first = slice(None, None, group)  # (B/G, P): one row per prompt
            out = self._forward_prompts(prompt[first], prompt_mask[first], positions[first])
            cache = _cache_of(out)
            why = why_not_repeatable(cache)
            if why is None:
                cache.batch_repeat_interleave(group)
                why = why_not_repeated(cache, prompt.shape[0])
            if why is None:
                return cache, out.logits[:, -1, :].repeat_interleave(group, dim=0)  # (B, V)
            log.info("hf engine: each prompt is prefilled once per sample: %s", why)
            self.share_prefill = False
        out = self._forward_prompts(prompt, prompt_mask, positions)
        return _cache_of(out), out.logits[:, -1, :]  # (B, V)

    def _forward_prompts(self, prompt: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor) -> Any:
        return self.model(
            input_ids=prompt, attention_mask=mask, position_ids=positions, use_cache=True, **self._keep_last
        )

    def _decode(
        self,
        prompt: torch.Tensor,
        prompt_mask: torch.Tensor,
        greedy: bool = False,
        group: int = 1,
        temperature: float | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        b = prompt.shape[0]
        temperature = 0.0 if greedy else (self.temperature if temperature is None else temperature)
        dev = prompt.device
        eos = torch.tensor(sorted(self.eos_ids), device=dev)
        attention = prompt_mask
        positions = (prompt_mask.cumsum(-1) - 1).clamp(min=0)  # (B, P): 0 at each row's first real token
        cache, logits = self._prefill(prompt, prompt_mask, positions, group)
        next_pos = positions[:, -1:] + 1  # (B, 1)
        finished = torch.zeros(b, dtype=torch.bool, device=dev)
        toks, lps, alive = [], [], []
        steps = self.max_new_tokens
        if self.max_model_len is not None:
            steps = min(steps, self.max_model_len - prompt.shape[1])
        for step in range(steps):
            tok, lp = sample_tokens(logits, temperature, self.top_k, self.top_p, self.generator)
            tok = tok.masked_fill(finished, self.pad_token_id)
            lp = lp.masked_fill(finished, 0.0)
            toks.append(tok)
            lps.append(lp)
            alive.append((~finished).float())
            finished = finished | torch.isin(tok, eos)
            if step == steps - 1:
                break
            if (step + 1) % self.finish_check_every == 0 and bool(finished.all()):
                break
            attention = torch.cat([attention, torch.ones((b, 1), dtype=attention.dtype, device=dev)], dim=1)
            out = self.model(
                input_ids=tok[:, None],
                attention_mask=attention,
                position_ids=next_pos,
                use_cache=True,
                **{self._cache_kwarg: cache},
            )
            cache = _cache_of(out)
            logits = out.logits[:, -1, :]
            next_pos = next_pos + 1
        tokens, logps, alive_mask = torch.stack(toks, 1), torch.stack(lps, 1), torch.stack(alive, 1)  # (B, T)
        if self.finish_check_every > 1:
            # Steps decoded after every row had stopped (between two checks) are columns of
            # padding: cut, so the batch is what a check after every token gives.
            width = int(alive_mask.any(0).nonzero().max()) + 1
            tokens, logps, alive_mask = tokens[:, :width], logps[:, :width], alive_mask[:, :width]
        return tokens, logps, alive_mask, finished
