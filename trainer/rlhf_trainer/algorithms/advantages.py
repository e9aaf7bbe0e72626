"""Advantage estimators: rewards (and values) -> per-token advantages and returns.

Every estimator returns ``(advantages, returns)``, both `(B, T)` and 0 at masked positions,
and runs without autograd (advantages are constants of the policy loss).

Calling convention (what lets `Algorithm` dispatch to any registered or user estimator without
special cases): *positional* parameters are batch keys (`token_rewards`, `old_values`,
`scores`, `group_index`, `baseline_scores`, `response_mask`) and are filled from the batch by
name; *keyword-only* parameters are hyperparameters, filled from the algorithm's params of the
same name, else left at their defaults.

Where verl (`verl/trainer/ppo/core_algos.py`) and OpenRLHF (`experience_maker.py`) differ,
the choice is a parameter; the defaults follow verl unless noted.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .masking import check_mask, check_per_sequence, check_same_shape, group_ids, masked_whiten
from .registry import ADVANTAGE_ESTIMATORS

__all__ = [
    "gae",
    "grpo",
    "rloo",
    "reinforce_plus_plus",
    "reinforce_plus_plus_baseline",
    "remax",
    "discounted_returns",
    "group_stats",
]

GAE_MASKING = ("carry", "zero")


def _zeros_like(x: Tensor) -> Tensor:
    return torch.zeros((), dtype=x.dtype, device=x.device)


@ADVANTAGE_ESTIMATORS.register("gae")
@torch.no_grad()
def gae(
    token_rewards: Tensor,
    old_values: Tensor,
    response_mask: Tensor,
    *,
    gamma: float = 1.0,
    lam: float = 1.0,
    gae_masking: str = "carry",
    whiten_advantages: bool = True,
    whiten_unbiased: bool = True,
) -> tuple[Tensor, Tensor]:
    """Generalized Advantage Estimation (Schulman et al. 2016, arXiv:1506.02438).

    token_rewards, old_values (critic values at rollout time), response_mask: (B, T).
    delta_t = r_t + gamma * V_{t+1} - V_t;  A_t = delta_t + gamma * lam * A_{t+1};
    returns = A + V (before whitening), the critic's regression target.

    `gae_masking` decides what a masked position means:

    * ``"carry"`` (verl): a masked position is skipped — the next value and the running
      advantage carry over it unchanged, so a hole in the response (e.g. tool output between
      turns) is transparent and the last valid token bootstraps from 0.
    * ``"zero"`` (OpenRLHF): rewards and values are zeroed at masked positions and the
      recursion runs over them, so a hole bootstraps from V = 0 and discounts through it.

    Both agree when the padding is only on the left or the right. `whiten_advantages`
    normalises advantages over all valid tokens of the batch (`whiten_unbiased`: n - 1, verl;
    else n, OpenRLHF).
    """
    if gae_masking not in GAE_MASKING:
        raise ValueError(f"gae_masking must be one of {GAE_MASKING}, got {gae_masking!r}")
    response_mask = check_mask(response_mask)
    check_same_shape(token_rewards=token_rewards, old_values=old_values, response_mask=response_mask)
    valid = response_mask.bool()
    zero = _zeros_like(old_values)
    _, length = response_mask.shape
    advantages = torch.zeros_like(old_values)
    if gae_masking == "carry":
        next_value = torch.zeros_like(old_values[:, 0])  # (B,)
        running = torch.zeros_like(old_values[:, 0])  # (B,)
        for t in reversed(range(length)):
            delta = token_rewards[:, t] + gamma * next_value - old_values[:, t]
            candidate = delta + gamma * lam * running
            next_value = torch.where(valid[:, t], old_values[:, t], next_value)
            running = torch.where(valid[:, t], candidate, running)
            advantages[:, t] = running
        values = old_values
    else:
        values = torch.where(valid, old_values, zero)  # (B, T)
        rewards = torch.where(valid, token_rewards, zero)  # (B, T)
        running = torch.zeros_like(values[:, 0])
        for t in reversed(range(length)):
            next_value = values[:, t + 1] if t + 1 < length else torch.zeros_like(running)
            running = rewards[:, t] + gamma * next_value - values[:, t] + gamma * lam * running
            advantages[:, t] = running
    returns = torch.where(valid, advantages + values, zero)
    if whiten_advantages:
        advantages = masked_whiten(advantages, response_mask, unbiased=whiten_unbiased)
    else:
        advantages = torch.where(valid, advantages, zero)
    return advantages, returns


def group_stats(scores: Tensor, group_index: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Per-sample statistics of its group: (count, mean, unbiased std), each (B,).

    scores: (B,) float; group_index: (B,) integer labels (any values; equal label = same prompt).
    The std of a group of one is 0.
    """
    ids, num_groups = group_ids(group_index)  # (B,), G
    ones = torch.ones_like(scores)
    count = torch.zeros(num_groups, dtype=scores.dtype, device=scores.device).index_add(0, ids, ones)  # (G,)
    total = torch.zeros_like(count).index_add(0, ids, scores)  # (G,)
    mean = total / count  # (G,)
    sq_dev = torch.zeros_like(count).index_add(0, ids, (scores - mean[ids]) ** 2)  # (G,)
    std = torch.sqrt(sq_dev / (count - 1).clamp(min=1))  # (G,)
    return count[ids], mean[ids], std[ids]


def _outcome_inputs(scores: Tensor, group_index: Tensor | None, response_mask: Tensor) -> Tensor:
    response_mask = check_mask(response_mask)
    check_per_sequence(response_mask, scores=scores, group_index=group_index)
    if not scores.is_floating_point():
        raise ValueError(f"scores must be floating point, got dtype {scores.dtype}")
    return response_mask


def _broadcast(per_sequence: Tensor, response_mask: Tensor) -> Tensor:
    """(B,) -> (B, T), 0 at masked positions."""
    return torch.where(
        response_mask.bool(), per_sequence.unsqueeze(1).to(response_mask.dtype), _zeros_like(response_mask)
    )


@ADVANTAGE_ESTIMATORS.register("grpo")
@torch.no_grad()
def grpo(
    scores: Tensor,
    group_index: Tensor,
    response_mask: Tensor,
    *,
    epsilon: float = 1e-6,
    norm_by_std: bool = True,
) -> tuple[Tensor, Tensor]:
    """Group-relative outcome advantage (GRPO, Shao et al. 2024, arXiv:2402.03300).

    scores: (B,) sequence rewards; group_index: (B,) prompt of each sample; response_mask (B, T).
    A_i = (r_i - mean_g) / (std_g + epsilon), broadcast over the sample's valid tokens, with
    the unbiased group std. `norm_by_std=False` gives Dr.GRPO (Liu et al. 2025,
    arXiv:2503.20783): A_i = r_i - mean_g. `epsilon`: verl 1e-6 (default), OpenRLHF 1e-9.
    A group of one has no baseline and gets advantage 0 (verl would give r_i / (1 + epsilon)).
    returns = advantages.
    """
    response_mask = _outcome_inputs(scores, group_index, response_mask)
    count, mean, std = group_stats(scores, group_index)  # (B,) each
    centered = scores - mean
    advantage = centered / (std + epsilon) if norm_by_std else centered  # (B,)
    advantage = torch.where(count > 1, advantage, torch.zeros_like(advantage))
    advantages = _broadcast(advantage, response_mask)
    return advantages, advantages.clone()


@ADVANTAGE_ESTIMATORS.register("rloo")
@torch.no_grad()
def rloo(scores: Tensor, group_index: Tensor, response_mask: Tensor) -> tuple[Tensor, Tensor]:
    """REINFORCE leave-one-out (Ahmadian et al. 2024, arXiv:2402.14740).

    A_i = r_i - mean_{j != i in group} r_j = n/(n-1) (r_i - mean_g), broadcast over valid
    tokens. A group of one keeps its raw score (no baseline), as in verl. returns = advantages.
    """
    response_mask = _outcome_inputs(scores, group_index, response_mask)
    count, mean, _ = group_stats(scores, group_index)
    loo = count / (count - 1).clamp(min=1) * (scores - mean)
    advantage = torch.where(count > 1, loo, scores)
    advantages = _broadcast(advantage, response_mask)
    return advantages, advantages.clone()


def discounted_returns(token_rewards: Tensor, response_mask: Tensor, gamma: float) -> Tensor:
    """G_t = r_t + gamma * G_{t+1} over valid tokens; a masked position resets the sum to 0.

    token_rewards, response_mask: (B, T); returns (B, T), 0 at masked positions. Rewards at
    masked positions are ignored. Resetting at masked positions is verl's REINFORCE++ choice
    ("reset after EOS"); OpenRLHF carries the sum through holes, which only differs when a
    response has padding in its middle.
    """
    valid = response_mask.bool()
    zero = _zeros_like(token_rewards)
    rewards = torch.where(valid, token_rewards, zero)  # (B, T)
    returns = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[:, 0])  # (B,)
    for t in reversed(range(rewards.shape[1])):
        running = torch.where(valid[:, t], rewards[:, t] + gamma * running, torch.zeros_like(running))
        returns[:, t] = running
    return returns


@ADVANTAGE_ESTIMATORS.register("reinforce_plus_plus")
@torch.no_grad()
def reinforce_plus_plus(
    token_rewards: Tensor,
    response_mask: Tensor,
    *,
    gamma: float = 1.0,
    whiten_unbiased: bool = True,
) -> tuple[Tensor, Tensor]:
    """REINFORCE++ (Hu 2025, arXiv:2501.03262): discounted returns whitened over the batch.

    token_rewards, response_mask: (B, T). returns = `discounted_returns`; advantages = returns
    normalised over all valid tokens of the batch (global, not per prompt).
    """
    response_mask = check_mask(response_mask)
    check_same_shape(token_rewards=token_rewards, response_mask=response_mask)
    returns = discounted_returns(token_rewards, response_mask, gamma)
    advantages = masked_whiten(returns, response_mask, unbiased=whiten_unbiased)
    return advantages, returns


@ADVANTAGE_ESTIMATORS.register("reinforce_plus_plus_baseline")
@torch.no_grad()
def reinforce_plus_plus_baseline(
    scores: Tensor,
    group_index: Tensor,
    response_mask: Tensor,
    *,
    whiten_unbiased: bool = True,
) -> tuple[Tensor, Tensor]:
    """REINFORCE++ with a group-mean baseline (arXiv:2501.03262, "REINFORCE++-baseline").

    A_i = r_i - mean_g, broadcast over valid tokens, then whitened over all valid tokens of the
    batch. A group of one keeps its raw score before whitening (verl). returns = advantages.
    """
    response_mask = _outcome_inputs(scores, group_index, response_mask)
    count, mean, _ = group_stats(scores, group_index)
    centered = torch.where(count > 1, scores - mean, scores)
    advantages = masked_whiten(_broadcast(centered, response_mask), response_mask, unbiased=whiten_unbiased)
    return advantages, advantages.clone()


@ADVANTAGE_ESTIMATORS.register("remax")
@torch.no_grad()
def remax(token_rewards: Tensor, baseline_scores: Tensor, response_mask: Tensor) -> tuple[Tensor, Tensor]:
    """ReMax (Li et al. 2023, arXiv:2310.10505): the greedy response's score as the baseline.

    token_rewards, response_mask: (B, T); baseline_scores: (B,) reward of the greedy decode of
    the same prompt. returns_t = sum_{s >= t} r_s over valid tokens (undiscounted);
    A_t = returns_t - baseline. No whitening.
    """
    response_mask = check_mask(response_mask)
    check_same_shape(token_rewards=token_rewards, response_mask=response_mask)
    check_per_sequence(response_mask, baseline_scores=baseline_scores)
    valid = response_mask.bool()
    zero = _zeros_like(token_rewards)
    rewards = torch.where(valid, token_rewards, zero)  # (B, T)
    returns = rewards.flip(dims=[1]).cumsum(dim=1).flip(dims=[1])  # suffix sums, (B, T)
    returns = torch.where(valid, returns, zero)
    advantages = torch.where(valid, returns - baseline_scores.unsqueeze(1), zero)
    return advantages, returns
