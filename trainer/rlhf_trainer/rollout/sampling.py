"""The sampling distribution of the rollout engines, as one pure function.

`sampling_log_probs(logits, temperature, top_k, top_p)` turns next-token logits into the
log-probabilities the engine samples from:

1. divide by `temperature` (temperature 0 means greedy: no scaling, no filtering, see below);
2. top-k: keep the `top_k` largest logits (0 disables; ties at the k-th value are kept);
3. top-p (nucleus): sort by probability, keep the smallest prefix whose mass reaches `top_p`
   (the most likely token is always kept);
4. log-softmax over the kept tokens; filtered tokens get -inf.

`RolloutBatch.log_probs` holds the value of this distribution at each sampled token. For greedy
decoding (temperature 0) the engine takes the argmax and reports its log-prob under the plain
model distribution `log_softmax(logits)` (temperature 1, unfiltered), so it stays informative.
"""

from __future__ import annotations

import torch


def check_sampling_params(max_new_tokens: int, temperature: float, top_p: float) -> None:
    """The checks every engine makes on its sampling settings, each naming the bad value."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must lie in (0, 1], got {top_p}")


def sampling_log_probs(
    logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0
) -> torch.Tensor:
    """Log-probs of the sampling distribution.

    logits: (..., V) next-token logits. Returns (..., V) float32 log-probs, -inf where filtered.
    """
    logits = logits.float()
    if temperature <= 0:
        return torch.log_softmax(logits, dim=-1)
    logits = logits / temperature
    vocab = logits.shape[-1]
    if 0 < top_k < vocab:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]  # (..., 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)  # (..., V)
        probs = torch.softmax(sorted_logits, dim=-1)
        mass_before = probs.cumsum(-1) - probs  # mass of strictly more likely tokens
        drop_sorted = mass_before >= top_p
        drop_sorted[..., 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return torch.log_softmax(logits, dim=-1)


def sample_tokens(
    logits: torch.Tensor,
    temperature: float,
    top_k: int = 0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row. logits: (B, V). Returns `(tokens (B,) long, log_probs (B,) float32)`."""
    logp = sampling_log_probs(logits, temperature, top_k, top_p)  # (B, V)
    if temperature <= 0:
        tokens = logits.argmax(dim=-1)
    else:
        tokens = torch.multinomial(logp.exp(), 1, generator=generator).squeeze(-1)
    return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)
