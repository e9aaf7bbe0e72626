"""The `hf` rollout engine and `RolloutBatch`: shapes, masks, stopping, determinism, padding, log-probs."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from rlhf_api.sections import RolloutSpec
from rlhf_trainer.rollout import (
    ENGINES,
    RolloutBatch,
    build_engine,
    decode_responses,
    sampling_log_probs,
)
from rlhf_trainer.rollout import engine_class as _engine_class
from rlhf_trainer.rollout.hf import HFRolloutEngine

PROMPTS = ["1+2=", "13+4=", "hello, world", "7"]


def _ids(tok: Any, texts: list[str]) -> list[list[int]]:
    return [tok(t).input_ids for t in texts]


def _engine(tiny_lm: tuple[Any, Any], **kw: Any) -> HFRolloutEngine:
    model, tok = tiny_lm
    args = {"max_new_tokens": 6, "temperature": 1.0, "seed": 0, **kw}
    return HFRolloutEngine(model, tok, **args)


def test_shapes_masks_and_padding(tiny_lm: tuple[Any, Any]) -> None:
    _, tok = tiny_lm
    prompt_ids = _ids(tok, PROMPTS)
    batch = _engine(tiny_lm).generate(prompt_ids, n=3)
    b, p_len = 3 * len(PROMPTS), max(len(p) for p in prompt_ids)
    assert batch.prompt_ids.shape == (b, p_len)
    assert batch.response_ids.shape == batch.response_mask.shape == batch.log_probs.shape
    assert batch.response_ids.shape[0] == b and 1 <= batch.response_ids.shape[1] <= 6
    assert batch.prompt_index == [i for i in range(len(PROMPTS)) for _ in range(3)]
    assert batch.response_mask.dtype == torch.float32
    for r in range(b):
        ids = prompt_ids[batch.prompt_index[r]]
        # left padding: pads first, then the prompt exactly
        assert batch.prompt_ids[r, p_len - len(ids) :].tolist() == ids
        assert batch.prompt_mask[r].tolist() == [0] * (p_len - len(ids)) + [1] * len(ids)
        assert set(batch.prompt_ids[r, : p_len - len(ids)].tolist()) <= {tok.pad_token_id}
        mask = batch.response_mask[r]
        n_alive = int(mask.sum())
        assert mask.tolist() == [1.0] * n_alive + [0.0] * (len(mask) - n_alive)  # ones, then zeros
        assert (batch.response_ids[r, n_alive:] == tok.pad_token_id).all()
        assert (batch.log_probs[r, n_alive:] == 0).all()
        assert (batch.log_probs[r, :n_alive] <= 0).all()
    assert batch.num_tokens == int(batch.response_mask.sum())
    seq, seq_mask = batch.sequences()
    assert seq.shape == (b, p_len + batch.response_ids.shape[1]) and seq_mask.shape == seq.shape


def test_stops_each_row_at_eos(tiny_lm: tuple[Any, Any]) -> None:
    _, tok = tiny_lm
    prompts = _ids(tok, PROMPTS)
    free = _engine(tiny_lm, temperature=0.0, max_new_tokens=8).generate(prompts)
    # Declare the token that row 0 greedily produces third to be EOS: row 0 must stop right there.
    stop = int(free.response_ids[0, 2])
    batch = _engine(tiny_lm, temperature=0.0, max_new_tokens=8, eos_token_ids=[stop]).generate(prompts)
    for r in range(len(prompts)):
        row = free.response_ids[r].tolist()
        cut = row.index(stop) + 1 if stop in row else len(row)
        assert batch.response_ids[r, :cut].tolist() == row[:cut]
        assert int(batch.response_mask[r].sum()) == cut
        assert bool(batch.finished[r]) == (stop in row)  # type: ignore[index]
    assert int(batch.response_mask[0].sum()) <= 3
    if all(stop in free.response_ids[r].tolist() for r in range(len(prompts))):
        assert batch.response_ids.shape[1] < 8  # the loop ends once every row has stopped


def test_greedy_is_deterministic_and_seeded_sampling_reproducible(tiny_lm: tuple[Any, Any]) -> None:
    _, tok = tiny_lm
    prompts = _ids(tok, PROMPTS)
    greedy = _engine(tiny_lm, temperature=0.0)
    a, b = greedy.generate(prompts, n=2), greedy.generate(prompts, n=2)
    assert torch.equal(a.response_ids, b.response_ids) and torch.equal(a.log_probs, b.log_probs)
    assert torch.equal(a.response_ids[0::2], a.response_ids[1::2])  # greedy: both samples equal

    engine = _engine(tiny_lm, temperature=1.0, seed=3)
    first = engine.generate(prompts, n=4)
    engine.set_seed(3)
    again = engine.generate(prompts, n=4)
    assert torch.equal(first.response_ids, again.response_ids)
    assert torch.allclose(first.log_probs, again.log_probs)


@pytest.mark.parametrize("every", [2, 5, 8])
def test_checking_for_the_stop_every_few_tokens_gives_the_same_batch(
    tiny_lm: tuple[Any, Any], every: int
) -> None:
    """On an accelerator the engine asks "has every row stopped?" only every few decode steps (a
    host read waits for the device); the extra steps' columns are cut, so the batch is the one a
    check after every token gives. Forced here on the CPU, with stop tokens that end every row
    within a few steps."""
    model, tok = tiny_lm
    stops = list(range(model.config.vocab_size))[::2]  # half the vocabulary: rows stop quickly
    prompts = _ids(tok, PROMPTS)
    each = _engine(tiny_lm, max_new_tokens=16, seed=5, eos_token_ids=stops)
    few = _engine(tiny_lm, max_new_tokens=16, seed=5, eos_token_ids=stops)
    few.finish_check_every = every
    a, b = each.generate(prompts, n=4), few.generate(prompts, n=4)
    assert a.response_ids.shape[1] < 16  # every row stopped early: the cut is exercised
    for key in ("response_ids", "response_mask", "log_probs", "finished"):
        assert torch.equal(getattr(a, key), getattr(b, key)), key


def test_left_padding_gives_the_same_greedy_output(tiny_lm: tuple[Any, Any]) -> None:
    _, tok = tiny_lm
    engine = _engine(tiny_lm, temperature=0.0, max_new_tokens=8, eos_token_ids=[])
    short = tok("7+1=").input_ids
    alone = engine.generate([short])
    batched = engine.generate([tok("a much longer prompt, 123+456=").input_ids, short])
    assert batched.prompt_mask[1].sum() == len(short) < batched.prompt_ids.shape[1]
    assert batched.response_ids[1].tolist() == alone.response_ids[0].tolist()
    torch.testing.assert_close(batched.log_probs[1], alone.log_probs[0], atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p"), [(1.0, 0, 1.0), (0.7, 20, 0.9), (1.3, 5, 1.0), (0.0, 0, 1.0)]
)
def test_log_probs_match_a_full_forward_pass(
    tiny_lm: tuple[Any, Any], temperature: float, top_k: int, top_p: float
) -> None:
    model, tok = tiny_lm
    engine = _engine(tiny_lm, temperature=temperature, top_k=top_k, top_p=top_p, max_new_tokens=6, seed=1)
    batch = engine.generate(_ids(tok, PROMPTS), n=2)
    ids, mask = batch.sequences()  # (B, P+T)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    p_len = batch.prompt_ids.shape[1]
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits  # (B, P+T, V)
    logp = sampling_log_probs(logits[:, p_len - 1 : -1], temperature, top_k, top_p)  # (B, T, V)
    expected = logp.gather(-1, batch.response_ids[..., None]).squeeze(-1) * batch.response_mask  # (B, T)
    torch.testing.assert_close(batch.log_probs, expected, atol=1e-4, rtol=0)
    assert torch.isfinite(batch.log_probs).all()


def _reference_filter(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """Plain-loop top-k / top-p over one row of logits (the vectorised version must agree)."""
    scaled = [v / temperature for v in logits.tolist()]
    order = sorted(range(len(scaled)), key=lambda i: -scaled[i])
    keep = set(order)
    if top_k:
        kth = scaled[order[top_k - 1]]
        keep = {i for i in keep if scaled[i] >= kth}
    kept_sorted = [i for i in order if i in keep]
    m = max(scaled[i] for i in kept_sorted)
    z = sum(torch.tensor(scaled[i] - m).exp().item() for i in kept_sorted)
    probs = {i: torch.tensor(scaled[i] - m).exp().item() / z for i in kept_sorted}
    if top_p < 1.0:
        mass, nucleus = 0.0, set()
        for i in kept_sorted:
            if mass >= top_p:
                break
            nucleus.add(i)
            mass += probs[i]
        keep = nucleus
    out = torch.full((len(scaled),), float("-inf"))
    m = max(scaled[i] for i in keep)
    z = sum(torch.tensor(scaled[i] - m).exp().item() for i in keep)
    for i in keep:
        out[i] = scaled[i] - m - torch.tensor(z).log().item()
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize(("temperature", "top_k", "top_p"), [(1.0, 3, 1.0), (0.5, 0, 0.8), (2.0, 10, 0.5)])
def test_sampling_filter_matches_reference_loop(
    seed: int, temperature: float, top_k: int, top_p: float
) -> None:
    torch.manual_seed(seed)
    logits = torch.randn(4, 17) * 3
    got = sampling_log_probs(logits, temperature, top_k, top_p)
    for row in range(4):
        want = _reference_filter(logits[row], temperature, top_k, top_p)
        assert torch.equal(torch.isinf(got[row]), torch.isinf(want))
        finite = torch.isfinite(want)
        torch.testing.assert_close(got[row][finite], want[finite], atol=1e-5, rtol=0)


def test_load_weights_and_state_dict(tiny_lm_dir: Any) -> None:
    engine = HFRolloutEngine.from_pretrained(str(tiny_lm_dir), max_new_tokens=4, temperature=0.0)
    prompts = [engine.tokenizer("2+2=").input_ids]
    before = engine.generate(prompts)
    state = {k: v.clone() for k, v in engine.state_dict().items()}
    name = "model.norm.weight"
    assert engine.load_weights([(name, torch.zeros_like(state[name]))]) == 1
    assert torch.count_nonzero(engine.state_dict()[name]) == 0
    engine.load_weights(state.items())
    torch.testing.assert_close(engine.generate(prompts).log_probs, before.log_probs)
    with pytest.raises(KeyError, match="not.a.param"):
        engine.load_weights([("not.a.param", torch.zeros(1))])
    with pytest.raises(ValueError, match="shape"):
        engine.load_weights([(name, torch.zeros(3))])


def test_build_engine_dispatches_through_the_registry(tiny_lm_dir: Any) -> None:
    spec = RolloutSpec(engine="hf", temperature=0.0, max_new_tokens=3)
    engine = build_engine(spec, str(tiny_lm_dir))
    assert isinstance(engine, HFRolloutEngine) and engine.max_new_tokens == 3
    assert set(ENGINES) == {"hf", "vllm"}
    with pytest.raises(ValueError, match=r"unknown rollout engine 'tgi'; valid: hf, vllm"):
        _engine_class("tgi")


def test_generate_rejects_bad_input(tiny_lm: tuple[Any, Any]) -> None:
    engine = _engine(tiny_lm)
    with pytest.raises(ValueError, match="no prompts"):
        engine.generate([])
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        engine.generate([[1, 2], []])


def test_engine_restores_the_models_training_mode(tiny_lm: tuple[Any, Any]) -> None:
    model, tok = tiny_lm
    model.train()
    try:
        _engine(tiny_lm).generate(_ids(tok, PROMPTS[:1]))
        assert model.training
    finally:
        model.eval()


def _batch(p: int, t: int, rows: int, pad: int = 0) -> RolloutBatch:
    return RolloutBatch(
        prompt_ids=torch.arange(rows * p).view(rows, p) + 5,
        prompt_mask=torch.ones(rows, p, dtype=torch.long),
        response_ids=torch.arange(rows * t).view(rows, t) + 5,
        response_mask=torch.ones(rows, t),
        log_probs=-torch.ones(rows, t),
        prompt_index=list(range(rows)),
        pad_token_id=pad,
    )


def test_rollout_batch_concat_select_and_dict_round_trip(tiny_lm: tuple[Any, Any]) -> None:
    a, b = _batch(2, 3, 2), _batch(4, 1, 1)
    c = RolloutBatch.concat([a, b], offset_prompt_index=True)
    assert c.prompt_ids.shape == (3, 4) and c.response_ids.shape == (3, 3)
    assert c.prompt_ids[0].tolist() == [0, 0, 5, 6]  # re-padded on the left
    assert c.prompt_mask[0].tolist() == [0, 0, 1, 1]
    assert c.response_ids[2].tolist() == [5, 0, 0]  # re-padded on the right
    assert c.response_mask[2].tolist() == [1.0, 0.0, 0.0] and c.log_probs[2].tolist() == [-1.0, 0.0, 0.0]
    assert c.prompt_index == [0, 1, 2]
    assert RolloutBatch.concat([a, b]).prompt_index == [0, 1, 0]
    again = RolloutBatch.from_dict(c.to_dict())
    assert torch.equal(again.response_ids, c.response_ids) and again.prompt_index == c.prompt_index
    sub = c.select([2, 0])
    assert sub.prompt_index == [2, 0] and torch.equal(sub.response_ids[1], c.response_ids[0])
    with pytest.raises(ValueError, match="rows"):
        RolloutBatch(a.prompt_ids, a.prompt_mask, b.response_ids, b.response_mask, b.log_probs)
    _, tok = tiny_lm
    real = _engine(tiny_lm, max_new_tokens=3).generate(_ids(tok, PROMPTS[:2]))
    assert len(decode_responses(real, tok)) == 2


@pytest.mark.gpu
def test_vllm_engine_generates_and_loads_weights(tiny_lm_dir: Any) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU (vLLM)")
    pytest.importorskip("vllm", reason="needs a GPU (vLLM)")
    spec = RolloutSpec(engine="vllm", temperature=1.0, max_new_tokens=4, gpu_memory_utilization=0.2)
    engine = build_engine(spec, str(tiny_lm_dir), dtype="float32", device="cuda")
    batch = engine.generate([[1, 20, 21], [1, 22]], n=2)
    assert batch.response_ids.shape[0] == 4 and (batch.log_probs <= 0).all()
    from transformers import AutoModelForCausalLM

    state = AutoModelForCausalLM.from_pretrained(tiny_lm_dir).state_dict()
    assert engine.load_weights(state.items()) == len(state)  # vLLM's IPC weight transfer
    assert engine.generate([[1, 20, 21]], n=1, greedy=True).response_ids.shape[0] == 1


def test_greedy_overrides_the_engine_temperature(tiny_lm: tuple[Any, Any]) -> None:
    """ReMax's baseline responses: `greedy=True` takes the argmax whatever the engine's sampling
    temperature and seed; the engine's own sampling is unchanged."""
    _, tok = tiny_lm
    prompt_ids = _ids(tok, PROMPTS)
    hot = _engine(tiny_lm, temperature=1.0, seed=1)
    greedy_a = hot.generate(prompt_ids, n=1, greedy=True)
    hot.set_seed(2)
    greedy_b = hot.generate(prompt_ids, n=1, greedy=True)
    cold = _engine(tiny_lm, temperature=0.0).generate(prompt_ids, n=1)
    for a, b in ((greedy_a, greedy_b), (greedy_a, cold)):
        assert torch.equal(a.response_ids, b.response_ids)
        assert torch.equal(a.response_mask, b.response_mask)
    hot.set_seed(1)
    sampled = [hot.generate(prompt_ids, n=1).response_ids for _ in range(3)]
    assert any(not torch.equal(s, greedy_a.response_ids) for s in sampled)
