"""Token-budget micro-batching with padding removed (`spec.training.maxTokensPerMicroBatch`): the
packed step's loss and gradients are the padded step's, for every loss aggregation, actor and
critic, on one rank and across 2 gloo ranks (FSDP2)."""

from __future__ import annotations

import pytest
import torch

from rlhf_trainer.workers import modeling

from .packing_ranks import (
    ACTOR_MODES,
    actor_step,
    build,
    critic_step,
    make_model,
    run_ranks,
    score,
    spec_for,
    uneven_batch,
)

VOCAB = 40
# Very uneven: prompts of 1..7 tokens, responses of 0..9 (a row with no response token included).
PROMPT_LENS = [7, 1, 3, 6, 2, 5, 4, 1, 7, 2]
RESPONSE_LENS = [9, 1, 0, 2, 9, 3, 1, 8, 5, 2]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("packing") / "tiny-llama", vocab=VOCAB)


def _double(worker):
    worker.model.double()  # in place: the optimizer keeps the same parameters
    return worker


def _assert_same_step(got, want, atol):
    (loss, grads), (ref_loss, ref_grads) = got, want
    assert abs(loss - ref_loss) <= atol, (loss, ref_loss)
    assert grads.keys() == ref_grads.keys()
    worst = max(float((grads[k] - ref_grads[k]).abs().max()) for k in grads)
    assert worst <= atol, f"largest gradient difference {worst:.3g} > {atol}"
    assert max(float(g.abs().max()) for g in grads.values()) > 1e3 * atol  # the gradient is not ~0


def test_a_llama_masks_packed_sequences_from_position_ids(model_dir):
    """The probe finds block-diagonal attention (sdpa, CPU); packed and trimmed log-probs are the
    padded ones at every valid position (packed: 0 past them)."""
    worker = build("actor", spec_for(model_dir, budget=16))
    worker.setup()
    assert worker.layout == "packed"
    model = worker.model.double()
    batch = uneven_batch(VOCAB, PROMPT_LENS, RESPONSE_LENS, dtype=torch.float64)
    valid = batch["response_mask"] > 0
    padded, padded_entropy = modeling.token_log_probs(model, batch, 0.7, with_entropy=True)
    for layout in ("packed", "trimmed"):
        logp, entropy = modeling.token_log_probs(model, batch, 0.7, with_entropy=True, layout=layout)
        torch.testing.assert_close(logp[valid], padded[valid], atol=1e-12, rtol=0)
        torch.testing.assert_close(entropy[valid], padded_entropy[valid], atol=1e-12, rtol=0)
        if layout == "packed":
            assert (logp[~valid] == 0).all()
    values = build("critic", spec_for(model_dir, budget=16))
    values.setup()
    assert values.layout == "packed"
    torch.nn.init.normal_(
        values.model.value_head.weight
    )  # the head starts at 0: make values depend on tokens
    vm = values.model.double()
    torch.testing.assert_close(
        modeling.token_values(vm, batch, layout="packed")[valid], modeling.token_values(vm, batch)[valid]
    )


def test_a_model_without_packed_masking_runs_trimmed(model_dir, monkeypatch):
    """A model that would let packed sequences attend to each other (here: a Llama forced to plain
    causal attention over the packed row) is detected and trained trimmed instead."""
    from transformers import masking_utils

    monkeypatch.setattr(masking_utils, "find_packed_sequence_indices", lambda position_ids: None)
    worker = build("actor", spec_for(model_dir, budget=16))
    worker.setup()
    assert worker.layout == "trimmed"


@pytest.mark.parametrize("mode", ACTOR_MODES)
@pytest.mark.parametrize("budget", [12, 30])
def test_actor_step_by_token_budget_equals_the_padded_step_float64(model_dir, mode, budget):
    batch = uneven_batch(VOCAB, PROMPT_LENS, RESPONSE_LENS, dtype=torch.float64)
    padded = build("actor", spec_for(model_dir, budget=None, micro=3))
    packed = build("actor", spec_for(model_dir, budget=budget))
    padded.setup(), packed.setup()
    _double(padded), _double(packed)
    assert packed.layout == "packed"
    _assert_same_step(actor_step(packed, batch, mode), actor_step(padded, batch, mode), atol=1e-10)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_actor_step_by_token_budget_equals_the_padded_step_float32(model_dir, mode):
    batch = uneven_batch(VOCAB, PROMPT_LENS, RESPONSE_LENS)
    padded = build("actor", spec_for(model_dir, budget=None, micro=10))
    packed = build("actor", spec_for(model_dir, budget=12))
    padded.setup(), packed.setup()
    _assert_same_step(actor_step(packed, batch, mode), actor_step(padded, batch, mode), atol=1e-6)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
@pytest.mark.parametrize("layout", ["packed", "trimmed"])
def test_critic_step_by_token_budget_equals_the_padded_step_float64(model_dir, mode, layout):
    batch = uneven_batch(VOCAB, PROMPT_LENS, RESPONSE_LENS, dtype=torch.float64)
    padded = build("critic", spec_for(model_dir, budget=None, micro=3))
    packed = build("critic", spec_for(model_dir, budget=12))
    padded.setup(), packed.setup()
    packed.layout = layout  # both removal strategies
    for w in (padded, packed):
        torch.manual_seed(1)
        torch.nn.init.normal_(w.model.value_head.weight)
        _double(w)
    _assert_same_step(critic_step(packed, batch, mode), critic_step(padded, batch, mode), atol=1e-10)


def test_lora_actor_step_by_token_budget_equals_the_padded_step(model_dir):
    """The peft-wrapped policy (no `logits_to_keep` in its signature: full logits, then indexed)."""
    batch = uneven_batch(VOCAB, PROMPT_LENS, RESPONSE_LENS, dtype=torch.float64)
    padded = build("actor", spec_for(model_dir, budget=None, micro=3, lora=True))
    packed = build("actor", spec_for(model_dir, budget=12, lora=True))
    padded.setup(), packed.setup()
    assert packed.layout == "packed"
    for w in (padded, packed):
        for name, p in w.model.named_parameters():
            if "lora_B" in name:  # B starts at 0: give the adapter a gradient through A as well
                torch.nn.init.normal_(p, generator=torch.Generator().manual_seed(0))
        _double(w)
    mode = "seq-mean-token-mean"
    _assert_same_step(actor_step(packed, batch, mode), actor_step(padded, batch, mode), atol=1e-10)


def test_actor_trimmed_layout_equals_the_padded_step(model_dir):
    batch = uneven_batch(VOCAB, PROMPT_LENS, RESPONSE_LENS, dtype=torch.float64)
    padded = build("actor", spec_for(model_dir, budget=None, micro=3))
    trimmed = build("actor", spec_for(model_dir, budget=12))
    padded.setup(), trimmed.setup()
    trimmed.layout = "trimmed"
    _double(padded), _double(trimmed)
    mode = "seq-mean-token-sum-norm"
    _assert_same_step(actor_step(trimmed, batch, mode), actor_step(padded, batch, mode), atol=1e-10)


@pytest.mark.parametrize("role", ["actor", "critic", "reference"])
def test_scoring_by_token_budget_equals_the_padded_scores(model_dir, role):
    """old_log_probs, old_values and ref_log_probs: the same, micro-batched by tokens and packed."""
    batch = uneven_batch(VOCAB, PROMPT_LENS, RESPONSE_LENS, dtype=torch.float64)
    valid = batch["response_mask"] > 0
    outs = []
    for budget in (None, 12):
        worker = build(role, spec_for(model_dir, budget=budget, micro=3))
        worker.setup()
        if role == "critic":
            torch.manual_seed(1)
            torch.nn.init.normal_(worker.model.value_head.weight)
        worker.model.double()
        rows, values = score(worker, batch)
        outs.append(torch.zeros_like(values).index_copy_(0, rows, values))
    assert worker.layout == "packed"
    torch.testing.assert_close(outs[1][valid], outs[0][valid], atol=1e-6, rtol=0)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_two_gloo_ranks_by_token_budget_equal_one_padded_rank(model_dir, tmp_path):
    """FSDP2 over 2 gloo ranks with a token budget whose packing gives the ranks different micro-batch
    counts (rank 0: three long sequences over the budget; rank 1: two short ones and an empty,
    zero-weight micro-batch): the same loss and gradients as one padded rank, float32."""
    prompts, responses = [7, 6, 7, 1, 2], [9, 8, 9, 1, 2]  # rank 0: rows 0-2, rank 1: rows 3-4
    batch = uneven_batch(VOCAB, prompts, responses, seed=3)
    modes = ["token-mean", "seq-mean-token-mean"]
    record = run_ranks(model_dir, 10, batch, modes, tmp_path)
    assert record["actor/layout"] == record["critic/layout"] == "packed"
    one = build("actor", spec_for(model_dir, budget=None, micro=8))
    one.setup()
    rows, scores = record["actor/scores"]  # rank 0's rows
    valid = batch["response_mask"][rows] > 0
    torch.testing.assert_close(scores[valid], score(one, batch)[1][rows][valid], atol=1e-6, rtol=0)
    rank0, rank1 = record["micro_batches"]
    assert [len(m) for m in rank0] == [1, 1, 1] and sorted(len(m) for m in rank1) == [0, 1, 1]
    for role, step in (("actor", actor_step), ("critic", critic_step)):
        for mode in modes:
            one = build(role, spec_for(model_dir, budget=None, micro=8))
            one.setup()
            _assert_same_step(record[(role, mode)], step(one, batch, mode), atol=1e-6)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_ppo_job_with_a_token_budget_trains_as_the_padded_job(tiny_model, ray_session, tmp_path):
    """End to end (Ray; actor, critic and reference): the first step of a PPO job with
    `maxTokensPerMicroBatch` reports the losses of the same job without it (same rollouts)."""
    from rlhf_trainer.controller import run

    from .conftest import make_job, read_metrics

    firsts = []
    for name, training in (
        ("padded", {"steps": 1, "microBatchSize": 3}),
        ("packed", {"steps": 1, "maxTokensPerMicroBatch": 24}),
    ):
        job = make_job(
            f"pack-{name}", algorithm={"name": "ppo", "params": {"klCoef": 0.05}}, training=training
        )
        run(job, run_dir=tmp_path / name, resume=False)
        firsts.append(read_metrics(tmp_path / name)[0])
    padded, packed = firsts
    for key in ("actor/loss", "critic/loss", "actor/pg_loss", "critic/vf_loss"):
        assert key in packed and packed[key] == pytest.approx(padded[key], rel=1e-4, abs=1e-6), key


def test_packed_logits_pass_indices_only_to_logits_to_keep():
    """transformers before `logits_to_keep` had `num_logits_to_keep: int` (the last N positions):
    the packed forward must not hand it a tensor of indices (it computes every position instead)."""
    from types import SimpleNamespace

    seen: dict[str, object] = {}

    class OldForward(torch.nn.Module):
        def forward(
            self, input_ids, attention_mask=None, position_ids=None, use_cache=None, num_logits_to_keep=0
        ):
            seen["keep"] = num_logits_to_keep
            n = input_ids.shape[1]
            return SimpleNamespace(logits=torch.arange(n * 3, dtype=torch.float32).view(1, n, 3))

    packed = modeling.PackedRows(
        input_ids=torch.tensor([[5, 6, 7, 8]]),
        position_ids=torch.tensor([[0, 1, 0, 1]]),
        source=torch.tensor([0, 2]),
        rows=torch.tensor([0, 1]),
        cols=torch.tensor([0, 0]),
    )
    logits = modeling.packed_response_logits(OldForward(), packed)
    assert seen["keep"] == 0  # not given: the default, every position
    assert torch.equal(logits, torch.tensor([[0.0, 1.0, 2.0], [6.0, 7.0, 8.0]]))
