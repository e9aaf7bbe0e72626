"""Activation checkpointing over padded rows (found by the device check's `layouts` stage, on CPU
too): the recompute in backward must see the same sequence as the forward. With the model's KV
cache on, the forward's cache grew again during the recompute (keys of 2x the length) and the
backward raised on any batch with padding; `modeling.response_logits` runs without the cache."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import torch

STAGES = Path(__file__).resolve().parents[1] / "gpu" / "stages"


def _ragged_batch(vocab: int) -> dict[str, torch.Tensor]:
    """The `layouts` stage's own ragged batch (left-padded prompts, right-padded responses)."""
    sys.path.insert(0, str(STAGES))
    try:
        from layouts import ragged_batch
    finally:
        sys.path.remove(str(STAGES))
    return ragged_batch(vocab, rows=6, p=5, t=4)  # type: ignore[no-any-return]


def test_checkpointing_on_padded_rows_gives_the_gradients_of_checkpointing_off() -> None:
    from rlhf_trainer.tiny_model import build_char_tokenizer, build_tiny_model
    from rlhf_trainer.workers import modeling

    torch.manual_seed(0)
    model = build_tiny_model(build_char_tokenizer(), hidden_size=32, seed=0)
    modeling.disable_dropout(model)
    batch = _ragged_batch(model.config.vocab_size)
    assert (batch["prompt_mask"] == 0).any() and (batch["response_mask"] == 0).any()
    grads = {}
    for on in (False, True):
        m = copy.deepcopy(model).train()
        if on:
            modeling.enable_activation_checkpointing(m)
        logp, _ = modeling.token_log_probs(m, batch)
        (-(logp * batch["response_mask"]).sum()).backward()
        grads[on] = {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}
    assert grads[True].keys() == grads[False].keys() and grads[True]
    for name, g in grads[False].items():
        torch.testing.assert_close(grads[True][name], g, rtol=1e-5, atol=1e-6)
