"""Advantage estimators against plain-Python reference loops."""

from __future__ import annotations

import algo_reference as ref
import pytest
import torch
from algo_reference import LAYOUTS, SEEDS, SHAPES, case, close, randn, to_lists

from rlhf_trainer.algorithms import advantages as adv

grid = pytest.mark.parametrize(
    ("shape", "layout", "seed"), [(s, lay, sd) for s in SHAPES for lay in LAYOUTS for sd in SEEDS]
)


def _groups(batch: int, gen: torch.Generator) -> torch.Tensor:
    """Random group labels (non-contiguous values, groups of 1..batch, shuffled order)."""
    return torch.randint(0, max(batch // 2, 1), (batch,), generator=gen) * 7 + 3


@grid
def test_gae(shape, layout, seed):
    gen, mask = case(shape, layout, seed)
    rewards, values = randn(shape, gen), randn(shape, gen)
    gamma, lam = 0.9, 0.8
    m = to_lists(mask)
    for masking, reference in (("carry", ref.gae_carry), ("zero", ref.gae_zero)):
        expected_adv, expected_ret = reference(to_lists(rewards), to_lists(values), m, gamma, lam)
        for whiten in (True, False):
            advantages, returns = adv.gae(
                rewards, values, mask, gamma=gamma, lam=lam, gae_masking=masking, whiten_advantages=whiten
            )
            masked = [[a * k for a, k in zip(r, mr)] for r, mr in zip(expected_adv, m)]
            close(advantages, ref.whiten(expected_adv, m) if whiten else masked)
            close(returns, expected_ret)


@pytest.mark.parametrize("layout", ["right", "left"])
@pytest.mark.parametrize("seed", SEEDS)
def test_gae_masking_modes_agree_without_holes(layout, seed):
    gen, mask = case((4, 6), layout, seed)
    rewards, values = randn((4, 6), gen), randn((4, 6), gen)
    a1, r1 = adv.gae(rewards, values, mask, gamma=0.95, lam=0.9, gae_masking="carry")
    a2, r2 = adv.gae(rewards, values, mask, gamma=0.95, lam=0.9, gae_masking="zero")
    close(a1, to_lists(a2))
    close(r1, to_lists(r2))


def test_gae_masking_modes_differ_on_holes():
    mask = torch.tensor([[1.0, 0.0, 1.0]], dtype=torch.float64)
    rewards = torch.tensor([[0.0, 0.0, 1.0]], dtype=torch.float64)
    values = torch.tensor([[0.5, 0.3, 0.2]], dtype=torch.float64)
    carry, _ = adv.gae(rewards, values, mask, gae_masking="carry", whiten_advantages=False)
    zero, _ = adv.gae(rewards, values, mask, gae_masking="zero", whiten_advantages=False)
    # carry: the hole is transparent, token 0 bootstraps from V_2 = 0.2
    assert carry[0, 0].item() == pytest.approx(0.0 + 0.2 - 0.5 + (1.0 - 0.2))
    # zero: token 0 bootstraps from the hole's V = 0 and the hole's delta 0 passes the tail through
    assert zero[0, 0].item() == pytest.approx(0.0 + 0.0 - 0.5 + (0.0 + 0.2 - 0.0) + (1.0 - 0.2))


@grid
def test_grpo(shape, layout, seed):
    gen, mask = case(shape, layout, seed)
    scores, index = randn((shape[0],), gen), _groups(shape[0], gen)
    for norm_by_std in (True, False):
        for epsilon in (1e-6, 1e-9):
            advantages, returns = adv.grpo(scores, index, mask, epsilon=epsilon, norm_by_std=norm_by_std)
            expected = ref.grpo(to_lists(scores), index.tolist(), to_lists(mask), epsilon, norm_by_std)
            close(advantages, expected)
            close(returns, expected)


def test_grpo_group_of_one_is_zero_and_dr_grpo_keeps_scale():
    mask = torch.ones(3, 2, dtype=torch.float64)
    scores = torch.tensor([5.0, 1.0, 3.0], dtype=torch.float64)
    index = torch.tensor([0, 1, 1])
    a, _ = adv.grpo(scores, index, mask)
    assert a[0].tolist() == [0.0, 0.0]
    a, _ = adv.grpo(scores, index, mask, norm_by_std=False)
    assert a[1].tolist() == [-1.0, -1.0] and a[2].tolist() == [1.0, 1.0]


@grid
def test_rloo(shape, layout, seed):
    gen, mask = case(shape, layout, seed)
    scores, index = randn((shape[0],), gen), _groups(shape[0], gen)
    advantages, returns = adv.rloo(scores, index, mask)
    expected = ref.rloo(to_lists(scores), index.tolist(), to_lists(mask))
    close(advantages, expected)
    close(returns, expected)


@grid
def test_reinforce_plus_plus(shape, layout, seed):
    gen, mask = case(shape, layout, seed)
    rewards = randn(shape, gen)
    for gamma in (1.0, 0.9):
        for unbiased in (True, False):
            advantages, returns = adv.reinforce_plus_plus(
                rewards, mask, gamma=gamma, whiten_unbiased=unbiased
            )
            expected_ret = ref.discounted_returns(to_lists(rewards), to_lists(mask), gamma)
            close(returns, expected_ret)
            close(advantages, ref.whiten(expected_ret, to_lists(mask), unbiased=unbiased))


@grid
def test_reinforce_plus_plus_baseline(shape, layout, seed):
    gen, mask = case(shape, layout, seed)
    scores, index = randn((shape[0],), gen), _groups(shape[0], gen)
    for unbiased in (True, False):
        advantages, returns = adv.reinforce_plus_plus_baseline(scores, index, mask, whiten_unbiased=unbiased)
        expected = ref.reinforce_pp_baseline(to_lists(scores), index.tolist(), to_lists(mask), unbiased)
        close(advantages, expected)
        close(returns, expected)


@grid
def test_remax(shape, layout, seed):
    gen, mask = case(shape, layout, seed)
    rewards, baselines = randn(shape, gen), randn((shape[0],), gen)
    advantages, returns = adv.remax(rewards, baselines, mask)
    expected_adv, expected_ret = ref.remax(to_lists(rewards), to_lists(baselines), to_lists(mask))
    close(advantages, expected_adv)
    close(returns, expected_ret)


def test_masked_positions_are_ignored_even_if_nan():
    mask = torch.tensor([[1.0, 1.0, 0.0]], dtype=torch.float64)
    rewards = torch.tensor([[0.1, 1.0, float("nan")]], dtype=torch.float64)
    values = torch.tensor([[0.2, 0.3, float("inf")]], dtype=torch.float64)
    for masking in ("carry", "zero"):
        a, r = adv.gae(rewards, values, mask, gae_masking=masking)
        assert torch.isfinite(a).all() and torch.isfinite(r).all()
    a, r = adv.reinforce_plus_plus(rewards, mask)
    assert torch.isfinite(a).all() and torch.isfinite(r).all()


def test_estimators_do_not_track_gradients():
    mask = torch.ones(2, 3, dtype=torch.float64)
    values = torch.randn(2, 3, dtype=torch.float64, requires_grad=True)
    a, r = adv.gae(torch.zeros(2, 3, dtype=torch.float64), values, mask)
    assert not a.requires_grad and not r.requires_grad


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (
            lambda: adv.gae(torch.zeros(2, 3), torch.zeros(2, 4), torch.ones(2, 3)),
            r"token_rewards \(2, 3\), old_values \(2, 4\)",
        ),
        (
            lambda: adv.grpo(torch.zeros(3), torch.zeros(2, dtype=torch.long), torch.ones(3, 4)),
            r"group_index \(2,\) must be \(B,\) = \(3,\)",
        ),
        (
            lambda: adv.grpo(torch.zeros(2), torch.zeros(2), torch.ones(2, 4)),
            "group_index must be an integer tensor",
        ),
        (
            lambda: adv.rloo(torch.zeros(2), torch.zeros(2, dtype=torch.long), torch.full((2, 3), 0.5)),
            "must hold only 0 and 1",
        ),
        (lambda: adv.remax(torch.zeros(2, 3), torch.zeros(3), torch.ones(2, 3)), r"baseline_scores \(3,\)"),
        (
            lambda: adv.reinforce_plus_plus(torch.zeros(2, 3), torch.ones(3)),
            r"2-D \(B, T\), got shape \(3,\)",
        ),
        (
            lambda: adv.gae(torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2), gae_masking="skip"),
            "gae_masking must be one of",
        ),
    ],
)
def test_errors_name_the_shapes(call, message):
    with pytest.raises(ValueError, match=message):
        call()
