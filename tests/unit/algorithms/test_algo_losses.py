"""Losses (policy, value, KL, entropy, preference) and aggregation against plain-Python references,
plus `torch.autograd.gradcheck` on each."""

from __future__ import annotations

import algo_reference as ref
import pytest
import torch
from algo_reference import LAYOUTS, SEEDS, SHAPES, case, close, randn, to_lists
from torch.autograd import gradcheck

from rlhf_trainer.algorithms import (
    KL_ESTIMATORS,
    LOSS_AGGREGATIONS,
    aggregate,
    count_normalizers,
    entropy_from_logits,
)
from rlhf_trainer.algorithms.kl import apply_kl_penalty, kl_estimate, kl_loss
from rlhf_trainer.algorithms.policy_loss import gspo_loss, ppo_clip_loss
from rlhf_trainer.algorithms.preference import dpo_loss, ipo_loss, pair_up
from rlhf_trainer.algorithms.value_loss import clipped_value_loss

grid = pytest.mark.parametrize(
    ("shape", "layout", "seed"), [(s, lay, sd) for s in SHAPES for lay in LAYOUTS for sd in SEEDS]
)
MODES = ["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]


def _policy_inputs(shape, gen):
    old = randn(shape, gen) - 1.0
    log_probs = (old + randn(shape, gen, 0.4)).requires_grad_(True)
    advantages = randn(shape, gen)
    return log_probs, old, advantages


# ----------------------------------------------------------------------------- aggregation


def test_every_mode_is_registered():
    assert LOSS_AGGREGATIONS.names() == sorted(MODES)


@grid
@pytest.mark.parametrize("mode", MODES)
def test_aggregation(shape, layout, seed, mode):
    gen, mask = case(shape, layout, seed)
    loss = randn(shape, gen)
    close(aggregate(loss, mask, mode), ref.aggregate(to_lists(loss), to_lists(mask), mode))
    close(
        aggregate(loss, mask, mode, global_tokens=13.0, global_seqs=4.0, norm_length=9.0),
        ref.aggregate(to_lists(loss), to_lists(mask), mode, 13.0, 4.0, 9.0),
    )


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("seed", SEEDS)
def test_aggregation_over_ranks_and_micro_batches_equals_full_batch(mode, seed):
    """2 data-parallel ranks x 2 micro-batches of uneven sizes and lengths, with global normalizers."""
    gen = torch.Generator().manual_seed(seed)
    mask = ref.make_mask(10, 8, "holes", gen)
    mask[3] = 0  # an empty row
    loss = randn((10, 8), gen).requires_grad_(True)
    full = aggregate(loss, mask, mode, norm_length=8)
    pieces = [(0, 2), (2, 5), (5, 6), (6, 10)]  # rank 0: mb0, mb1; rank 1: mb0, mb1
    counts = [count_normalizers(mask[a:b]) for a, b in pieces]  # all-reduced in a real run
    global_tokens = sum(c[0] for c in counts)
    global_seqs = sum(c[1] for c in counts)
    total = torch.zeros((), dtype=torch.float64)
    for a, b in pieces:
        width = int(mask[a:b].nonzero()[:, 1].max()) + 1 if mask[a:b].any() else 1  # micro-batch padding
        total = total + aggregate(
            loss[a:b, :width],
            mask[a:b, :width],
            mode,
            global_tokens=global_tokens,
            global_seqs=global_seqs,
            norm_length=8,
        )
    close(total, full.item())
    (grad_full,) = torch.autograd.grad(full, loss)
    (grad_pieces,) = torch.autograd.grad(total, loss)
    close(grad_pieces, to_lists(grad_full))


@pytest.mark.parametrize("mode", MODES)
def test_aggregation_gradcheck(mode):
    gen, mask = case((3, 4), "holes", 0)
    loss = randn((3, 4), gen).requires_grad_(True)
    assert gradcheck(lambda x: aggregate(x, mask, mode), (loss,))


def test_fully_masked_batch_gives_zero_not_nan():
    mask = torch.zeros(2, 3, dtype=torch.float64)
    for mode in MODES:
        assert aggregate(torch.randn(2, 3, dtype=torch.float64), mask, mode).item() == 0.0


def test_aggregation_errors():
    with pytest.raises(ValueError, match=r"loss_mat \(2, 3\), response_mask \(2, 4\)"):
        aggregate(torch.zeros(2, 3), torch.ones(2, 4), "token-mean")
    with pytest.raises(ValueError, match="unknown loss aggregation mode 'token_mean'.*seq-mean-token-mean"):
        aggregate(torch.zeros(2, 3), torch.ones(2, 3), "token_mean")
    with pytest.raises(ValueError, match="global_tokens must be >= 0"):
        aggregate(torch.zeros(2, 3), torch.ones(2, 3), "token-mean", global_tokens=-1)
    with pytest.raises(ValueError, match="norm_length must be > 0"):
        aggregate(torch.zeros(2, 3), torch.ones(2, 3), "seq-mean-token-sum-norm", norm_length=0)


# ----------------------------------------------------------------------------- policy losses


@grid
def test_ppo_clip_loss(shape, layout, seed):
    gen, mask = case(shape, layout, seed)
    log_probs, old, advantages = _policy_inputs(shape, gen)
    configs = [
        (0.2, 0.2, 3.0, "token-mean"),
        (0.1, 0.28, None, "seq-mean-token-mean"),
        (0.2, 0.3, 1.5, "token-sum"),
    ]
    for low, high, c, mode in configs:
        loss, metrics = ppo_clip_loss(
            log_probs,
            old,
            advantages,
            mask,
            clip_ratio_low=low,
            clip_ratio_high=high,
            clip_ratio_c=c,
            loss_agg_mode=mode,
        )
        expected, expected_metrics = ref.ppo(
            to_lists(log_probs), to_lists(old), to_lists(advantages), to_lists(mask), low, high, c, 20.0, mode
        )
        close(loss, expected)
        assert set(metrics) == set(expected_metrics)
        for key, value in expected_metrics.items():
            close(metrics[key], value)


def test_ppo_log_ratio_is_clamped_before_exp():
    mask = torch.ones(1, 2, dtype=torch.float64)
    log_probs = torch.tensor([[500.0, -500.0]], dtype=torch.float64, requires_grad=True)
    loss, _ = ppo_clip_loss(
        log_probs, torch.zeros(1, 2, dtype=torch.float64), torch.ones(1, 2, dtype=torch.float64), mask
    )
    assert torch.isfinite(loss)
    loss.backward()
    assert torch.isfinite(log_probs.grad).all()


def test_dual_clip_caps_negative_advantages():
    mask = torch.ones(1, 1, dtype=torch.float64)
    log_probs = torch.tensor([[2.0]], dtype=torch.float64)  # ratio e^2 ~ 7.4 > c
    advantages = torch.tensor([[-1.0]], dtype=torch.float64)
    old = torch.zeros(1, 1, dtype=torch.float64)
    capped, metrics = ppo_clip_loss(log_probs, old, advantages, mask, clip_ratio_c=3.0)
    uncapped, _ = ppo_clip_loss(log_probs, old, advantages, mask, clip_ratio_c=None)
    assert capped.item() == pytest.approx(3.0)
    assert uncapped.item() == pytest.approx(torch.e**2)
    assert metrics["actor/pg_clipfrac_lower"] == 1.0


@grid
def test_gspo_loss(shape, layout, seed):
    gen, mask = case(shape, layout, seed)
    log_probs, old, advantages = _policy_inputs(shape, gen)
    for mode in ("seq-mean-token-mean", "token-mean"):
        loss, metrics = gspo_loss(
            log_probs, old, advantages, mask, clip_ratio_low=0.05, clip_ratio_high=0.1, loss_agg_mode=mode
        )
        expected, clipfrac = ref.gspo(
            to_lists(log_probs), to_lists(old), to_lists(advantages), to_lists(mask), 0.05, 0.1, 10.0, mode
        )
        close(loss, expected)
        close(metrics["actor/pg_clipfrac"], clipfrac)
        assert metrics["actor/pg_clipfrac_lower"] == 0.0


@pytest.mark.parametrize("layout", LAYOUTS)
def test_policy_loss_gradcheck(layout):
    gen, mask = case((3, 5), layout, 1)
    log_probs, old, advantages = _policy_inputs((3, 5), gen)
    assert gradcheck(
        lambda lp: ppo_clip_loss(lp, old, advantages, mask, clip_ratio_high=0.28)[0], (log_probs,)
    )
    assert gradcheck(
        lambda lp: gspo_loss(lp, old, advantages, mask, clip_ratio_low=0.05, clip_ratio_high=0.05)[0],
        (log_probs,),
    )


def test_policy_loss_errors():
    ok = torch.zeros(2, 3)
    with pytest.raises(ValueError, match=r"log_probs \(2, 3\), old_log_probs \(2, 3\), advantages \(3, 2\)"):
        ppo_clip_loss(ok, ok, torch.zeros(3, 2), torch.ones(2, 3))
    with pytest.raises(ValueError, match="clip_ratio_c .* must be > 1, got 0.5"):
        ppo_clip_loss(ok, ok, ok, torch.ones(2, 3), clip_ratio_c=0.5)
    with pytest.raises(ValueError, match=r"clip_ratio_low must be in \[0, 1\), got 1.5"):
        gspo_loss(ok, ok, ok, torch.ones(2, 3), clip_ratio_low=1.5)


# ----------------------------------------------------------------------------- value loss


@grid
def test_value_loss(shape, layout, seed):
    gen, mask = case(shape, layout, seed)
    old = randn(shape, gen)
    values = (old + randn(shape, gen, 0.3)).requires_grad_(True)
    returns = randn(shape, gen)
    for clip in (0.2, None):
        loss, metrics = clipped_value_loss(values, old, returns, mask, clip_range_value=clip)
        expected, clipfrac = ref.value_loss(
            to_lists(values), to_lists(old), to_lists(returns), to_lists(mask), clip, "token-mean"
        )
        close(loss, expected)
        close(metrics["critic/vf_loss"], expected)
        close(metrics["critic/vf_clipfrac"], clipfrac)
        close(metrics["critic/vpred_mean"], ref.masked_mean(to_lists(values), to_lists(mask)))


def test_value_loss_gradcheck_and_errors():
    gen, mask = case((3, 4), "holes", 2)
    old, returns = randn((3, 4), gen), randn((3, 4), gen)
    values = (old + randn((3, 4), gen, 0.3)).requires_grad_(True)
    assert gradcheck(lambda v: clipped_value_loss(v, old, returns, mask, clip_range_value=0.2)[0], (values,))
    with pytest.raises(ValueError, match=r"values \(3, 4\), old_values \(3, 4\), returns \(4, 3\)"):
        clipped_value_loss(values, old, returns.T, mask)


# ----------------------------------------------------------------------------- KL


@grid
def test_kl_estimators(shape, layout, seed):
    gen, mask = case(shape, layout, seed)
    log_probs, ref_log_probs = randn(shape, gen, 3.0), randn(shape, gen, 3.0)
    for estimator in ("k1", "k2", "k3", "abs"):
        for kl_clamp in (None, 0.5):
            kl = kl_estimate(log_probs, ref_log_probs, mask, estimator, kl_clamp=kl_clamp)
            bound = kl_clamp if kl_clamp is not None else (10.0 if estimator == "k3" else None)
            close(
                kl,
                ref.kl_matrix(to_lists(log_probs), to_lists(ref_log_probs), to_lists(mask), estimator, bound),
            )


def test_kl_aliases_and_k3_clamps():
    assert KL_ESTIMATORS.get("mse") is KL_ESTIMATORS.get("k2")
    assert KL_ESTIMATORS.get("low_var_kl") is KL_ESTIMATORS.get("k3")
    far = KL_ESTIMATORS.get("k3")(torch.tensor([-100.0]), torch.tensor([0.0]))
    assert far.item() == 10.0


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3", "abs"])
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_kl_loss_matches_reference_and_gradcheck(estimator, mode):
    gen, mask = case((3, 5), "holes", 0)
    log_probs = randn((3, 5), gen).requires_grad_(True)
    ref_log_probs = randn((3, 5), gen)
    loss, metrics = kl_loss(log_probs, ref_log_probs, mask, kl_estimator=estimator, loss_agg_mode=mode)
    matrix = ref.kl_matrix(
        to_lists(log_probs),
        to_lists(ref_log_probs),
        to_lists(mask),
        estimator,
        10.0 if estimator == "k3" else None,
    )
    close(loss, ref.aggregate(matrix, to_lists(mask), mode))
    close(metrics["actor/kl"], ref.masked_mean(matrix, to_lists(mask)))
    assert gradcheck(
        lambda lp: kl_loss(lp, ref_log_probs, mask, kl_estimator=estimator, loss_agg_mode=mode)[0],
        (log_probs,),
    )


@grid
def test_kl_penalty_in_reward(shape, layout, seed):
    gen, mask = case(shape, layout, seed)
    rewards, old, ref_lp = randn(shape, gen), randn(shape, gen), randn(shape, gen)
    penalised, kl = apply_kl_penalty(rewards, old, ref_lp, mask, kl_coef=0.3, kl_estimator="k1")
    matrix = ref.kl_matrix(to_lists(old), to_lists(ref_lp), to_lists(mask), "k1", None)
    close(kl, matrix)
    close(penalised, [[r - 0.3 * k for r, k in zip(rr, kk)] for rr, kk in zip(to_lists(rewards), matrix)])


# ----------------------------------------------------------------------------- entropy


@pytest.mark.parametrize(("shape", "vocab"), [((1, 1), 1), ((2, 3), 5), ((3, 4), 11)])
@pytest.mark.parametrize("chunk_size", [1, 2, 1024])
@pytest.mark.parametrize("seed", SEEDS)
def test_entropy_from_logits(shape, vocab, chunk_size, seed):
    gen = torch.Generator().manual_seed(seed)
    logits = randn((*shape, vocab), gen, 3.0)
    entropy = entropy_from_logits(logits, chunk_size=chunk_size)
    expected = [[ref.entropy(logits[b, t].tolist()) for t in range(shape[1])] for b in range(shape[0])]
    close(entropy, expected)


@pytest.mark.parametrize("chunk_size", [2, 1024])
def test_entropy_gradcheck(chunk_size):
    gen = torch.Generator().manual_seed(0)
    logits = randn((2, 2, 3), gen).requires_grad_(True)
    assert gradcheck(lambda z: entropy_from_logits(z, chunk_size=chunk_size), (logits,))


def test_entropy_gradient_matches_naive_autograd():
    gen = torch.Generator().manual_seed(3)
    logits = randn((3, 20, 17), gen, 2.0).requires_grad_(True)
    weights = randn((3, 20), gen)
    (entropy_from_logits(logits, chunk_size=7) * weights).sum().backward()
    chunked = logits.grad.clone()
    logits.grad = None
    naive = -(torch.softmax(logits, -1) * torch.log_softmax(logits, -1)).sum(-1)
    (naive * weights).sum().backward()
    close(chunked, to_lists(logits.grad))


def test_entropy_keeps_no_second_vocab_sized_tensor_for_backward():
    saved: list[int] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t.numel())
        return t

    logits = torch.randn(2, 8, 50, dtype=torch.float64, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        entropy_from_logits(logits, chunk_size=4).sum().backward()
    assert saved == [logits.numel()]  # only the input itself (a view, not a copy)


def test_entropy_errors():
    with pytest.raises(ValueError, match=r"vocabulary dimension .* got shape \(3,\)"):
        entropy_from_logits(torch.zeros(3))
    with pytest.raises(ValueError, match="chunk_size must be >= 1"):
        entropy_from_logits(torch.zeros(1, 2, 3), chunk_size=0)


# ----------------------------------------------------------------------------- preference


@pytest.mark.parametrize("pairs", [1, 3, 6])
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_dpo_and_ipo(pairs, seed, smoothing):
    gen = torch.Generator().manual_seed(seed)
    c, r, rc, rr = (randn((pairs,), gen, 3.0) for _ in range(4))
    beta = 0.2
    loss, metrics = dpo_loss(c, r, rc, rr, beta=beta, label_smoothing=smoothing)
    cl, rl, rcl, rrl = (x.tolist() for x in (c, r, rc, rr))
    close(loss, sum(ref.dpo(*z, beta, smoothing) for z in zip(cl, rl, rcl, rrl)) / pairs)
    acc = sum(beta * (a - ra) > beta * (b - rb) for a, b, ra, rb in zip(cl, rl, rcl, rrl)) / pairs
    close(metrics["actor/dpo_reward_acc"], acc)
    ipo, _ = ipo_loss(c, r, rc, rr, beta=beta, global_pairs=2 * pairs)
    close(ipo, sum(ref.ipo(*z, beta) for z in zip(cl, rl, rcl, rrl)) / (2 * pairs))


def test_preference_gradcheck():
    gen = torch.Generator().manual_seed(0)
    c, r = randn((4,), gen).requires_grad_(True), randn((4,), gen).requires_grad_(True)
    rc, rr = randn((4,), gen), randn((4,), gen)
    assert gradcheck(lambda a, b: dpo_loss(a, b, rc, rr, beta=0.5, label_smoothing=0.1)[0], (c, r))
    assert gradcheck(lambda a, b: ipo_loss(a, b, rc, rr, beta=0.5)[0], (c, r))


def test_pair_up_and_its_errors():
    values = torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.float64, requires_grad=True)
    chosen = torch.tensor([False, True, True, False])
    pair_index = torch.tensor([9, 9, 4, 4])
    c, r = pair_up(values, chosen, pair_index)
    assert c.tolist() == [3.0, 2.0] and r.tolist() == [4.0, 1.0]  # pairs ordered by label: 4, 9
    c.sum().backward()
    assert values.grad.tolist() == [0.0, 1.0, 1.0, 0.0]
    with pytest.raises(ValueError, match="pair 4: 2 members, 2 chosen"):
        pair_up(values, torch.tensor([False, True, True, True]), pair_index)
    with pytest.raises(ValueError, match="pair 5: 1 members"):
        pair_up(values, chosen, torch.tensor([9, 9, 4, 5]))
    with pytest.raises(ValueError, match=r"chosen \(3,\) must be \(B,\) = \(4,\)"):
        pair_up(values, chosen[:3], pair_index)
    with pytest.raises(ValueError, match="beta must be > 0"):
        dpo_loss(values, values, values, values, beta=0.0)
    with pytest.raises(ValueError, match=r"label_smoothing must be in \[0, 0.5\)"):
        dpo_loss(values, values, values, values, label_smoothing=0.5)
