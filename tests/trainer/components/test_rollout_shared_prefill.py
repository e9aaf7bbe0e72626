"""The `hf` engine prefills each prompt once and repeats its KV cache to the prompt's samples:
the same tokens (same seed, or greedy) and log-probs as prefilling every sample's copy (the
engine's path before, still its fallback), within 1e-6 in fp32."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch

from rlhf_trainer.rollout import hf
from rlhf_trainer.rollout.hf import HFRolloutEngine

PROMPTS = ["1+2=", "13+4=", "hello, world", "7", "99+1="]
FIELDS = ("response_ids", "response_mask", "finished", "prompt_ids", "prompt_mask")


def _ids(tok: Any) -> list[list[int]]:
    return [tok(t).input_ids for t in PROMPTS]


def _engine(tiny_lm: tuple[Any, Any], share: bool, **kw: Any) -> HFRolloutEngine:
    model, tok = tiny_lm
    engine = HFRolloutEngine(model, tok, **{"max_new_tokens": 10, "seed": 7, **kw})
    engine.share_prefill = share
    return engine


def _prefill_rows(engine: HFRolloutEngine, prompts: list[list[int]], n: int) -> tuple[Any, int]:
    """The batch, and how many rows the first forward pass (the prefill) took."""
    rows: list[int] = []
    hook = engine.model.register_forward_pre_hook(
        lambda _m, _a, kw: rows.append(kw["input_ids"].shape[0]), with_kwargs=True
    )
    try:
        batch = engine.generate(prompts, n=n)
    finally:
        hook.remove()
    return batch, rows[0]


def _assert_same(a: Any, b: Any) -> None:
    for key in FIELDS:
        assert torch.equal(getattr(a, key), getattr(b, key)), key
    gap = float((a.log_probs - b.log_probs).abs().max())
    assert gap <= 1e-6, f"log-probs differ by {gap:.3g}"


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p", "n"),
    [(1.0, 0, 1.0, 4), (0.7, 20, 0.9, 3), (1.3, 5, 1.0, 8), (0.0, 0, 1.0, 2)],
)
def test_one_prefill_per_prompt_gives_the_repeated_prefills_batch(
    tiny_lm: tuple[Any, Any], temperature: float, top_k: int, top_p: float, n: int
) -> None:
    prompts = _ids(tiny_lm[1])
    kw = {"temperature": temperature, "top_k": top_k, "top_p": top_p}
    shared, rows = _prefill_rows(_engine(tiny_lm, True, **kw), prompts, n)
    repeated, all_rows = _prefill_rows(_engine(tiny_lm, False, **kw), prompts, n)
    assert (rows, all_rows) == (len(prompts), n * len(prompts))
    _assert_same(shared, repeated)
    if temperature > 0:  # the samples of a prompt differ: each row decodes from its own cache copy
        assert not torch.equal(shared.response_ids[0::n], shared.response_ids[1::n])


def test_a_cache_repeated_to_the_wrong_rows_is_seen(
    tiny_lm: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The control: the comparison above catches a broken share (each prompt's cache tiled over
    the batch, `repeat` instead of `repeat_interleave`, so samples decode from other prompts)."""
    from transformers.cache_utils import DynamicCache

    def tiled(cache: Any, repeats: int) -> None:
        for layer in cache.layers:
            layer.keys, layer.values = (
                layer.keys.repeat(repeats, 1, 1, 1),
                layer.values.repeat(repeats, 1, 1, 1),
            )

    prompts = _ids(tiny_lm[1])
    repeated = _engine(tiny_lm, False, temperature=0.0).generate(prompts, n=2)
    monkeypatch.setattr(DynamicCache, "batch_repeat_interleave", tiled)
    broken = _engine(tiny_lm, True, temperature=0.0).generate(prompts, n=2)
    with pytest.raises(AssertionError):
        _assert_same(broken, repeated)


def test_a_cache_that_cannot_be_repeated_falls_back_once_with_a_log_line(
    tiny_lm: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    prompts = _ids(tiny_lm[1])
    expected = _engine(tiny_lm, False).generate(prompts, n=3)
    monkeypatch.setattr(hf, "why_not_repeatable", lambda cache: "the cache is a test's refusal")
    engine = _engine(tiny_lm, True)
    with caplog.at_level(logging.INFO, logger=hf.__name__):
        _assert_same(engine.generate(prompts, n=3), expected)
        engine.set_seed(7)
        _, rows = _prefill_rows(engine, prompts, 3)
    assert not engine.share_prefill and rows == 3 * len(prompts)
    assert caplog.text.count("prefilled once per sample: the cache is a test's refusal") == 1


def test_only_caches_whose_whole_state_repeats_are_shared(tiny_lm: tuple[Any, Any]) -> None:
    from transformers.cache_utils import DynamicCache, StaticCache

    model, tok = tiny_lm
    ids = torch.tensor([tok("1+2=").input_ids])
    with torch.no_grad():
        cache = hf._cache_of(model(input_ids=ids, use_cache=True))
    assert type(cache) is DynamicCache and hf.why_not_repeatable(cache) is None
    cache.batch_repeat_interleave(3)
    assert hf.why_not_repeated(cache, 3) is None and "not 4" in str(hf.why_not_repeated(cache, 4))
    static = StaticCache(config=model.config, max_cache_len=8)
    assert "StaticCache" in str(hf.why_not_repeatable(static))

    class OwnCache(DynamicCache):
        pass

    assert "OwnCache" in str(hf.why_not_repeatable(OwnCache()))
