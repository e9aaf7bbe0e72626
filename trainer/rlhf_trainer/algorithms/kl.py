"""KL divergence to the reference policy: per-token estimators and coefficient controllers.

Estimators (Schulman, "Approximating KL Divergence", 2020, http://joschu.net/blog/kl-approx.html)
estimate KL(pi || pi_ref) from the log-probs of the sampled tokens; with x = log_probs - ref_log_probs:

| name | value | note |
|---|---|---|
| `k1` | x | unbiased, high variance, can be negative |
| `k2`, `mse` | x^2 / 2 | biased, low variance; its gradient is the true KL gradient |
| `k3`, `low_var_kl` | exp(-x) - 1 + x | unbiased, non-negative, low variance |
| `abs` | abs(x) | |

Signature: ``est(log_probs, ref_log_probs, *, kl_clamp=..., log_ratio_clamp=...) -> (B, T)``.
`kl_clamp` bounds the estimate to [-kl_clamp, kl_clamp] (None: no bound). The defaults follow
verl: only `k3` is clamped (to +-10, after clamping x to +-20 before exp); OpenRLHF clamps every
estimator to +-10. `Algorithm`'s `kl_clamp` param overrides the bound for whichever estimator
is chosen (default None: keep the estimator's own).

Two ways to use an estimate (`Algorithm` param `kl_in_reward`):

* as a reward penalty (`apply_kl_penalty`): r_t <- r_t - beta * KL_t with the *rollout*
  log-probs, before advantages are computed (InstructGPT-style PPO, Ouyang et al. 2022);
* as a loss term (`kl_loss`): + beta * agg(KL_t) with the *current* log-probs, differentiated
  (GRPO, Shao et al. 2024).

Controllers (`KL_CONTROLLERS`) own beta: `fixed`, and `adaptive` (Ziegler et al. 2019,
arXiv:1909.08593): e = clip(KL / target - 1, -0.2, 0.2); beta <- beta * (1 + e * n_steps / horizon).
A controller is constructed with keyword arguments named after algorithm params (`kl_coef`,
`target_kl`, `horizon`), exposes the current beta as `value`, is told `update(current_kl,
n_steps)` once per optimizer step, says with `needs_measurement` whether `update` needs a
measured KL, and has `state_dict` / `load_state_dict` so beta survives a checkpoint.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import Tensor

from .aggregation import aggregate
from .masking import check_mask, check_same_shape, masked_mean
from .registry import KL_CONTROLLERS, KL_ESTIMATORS

__all__ = [
    "k1",
    "k2",
    "k3",
    "abs_kl",
    "kl_estimate",
    "apply_kl_penalty",
    "kl_loss",
    "FixedKLController",
    "AdaptiveKLController",
]


def _bound(kl: Tensor, kl_clamp: float | None) -> Tensor:
    return kl if kl_clamp is None else kl.clamp(-kl_clamp, kl_clamp)


@KL_ESTIMATORS.register("k1")
def k1(log_probs: Tensor, ref_log_probs: Tensor, *, kl_clamp: float | None = None) -> Tensor:
    """log pi - log pi_ref, (B, T)."""
    return _bound(log_probs - ref_log_probs, kl_clamp)


@KL_ESTIMATORS.register("k2")
def k2(log_probs: Tensor, ref_log_probs: Tensor, *, kl_clamp: float | None = None) -> Tensor:
    """(log pi - log pi_ref)^2 / 2, (B, T)."""
    return _bound(0.5 * (log_probs - ref_log_probs) ** 2, kl_clamp)


@KL_ESTIMATORS.register("k3")
def k3(
    log_probs: Tensor,
    ref_log_probs: Tensor,
    *,
    kl_clamp: float | None = 10.0,
    log_ratio_clamp: float = 20.0,
) -> Tensor:
    """exp(y) - y - 1 with y = clamp(log pi_ref - log pi, +-log_ratio_clamp), (B, T)."""
    y = (ref_log_probs - log_probs).clamp(-log_ratio_clamp, log_ratio_clamp)
    return _bound(torch.exp(y) - y - 1.0, kl_clamp)


@KL_ESTIMATORS.register("abs")
def abs_kl(log_probs: Tensor, ref_log_probs: Tensor, *, kl_clamp: float | None = None) -> Tensor:
    """abs(log pi - log pi_ref), (B, T)."""
    return _bound((log_probs - ref_log_probs).abs(), kl_clamp)


KL_ESTIMATORS.add("mse", k2)
KL_ESTIMATORS.add("low_var_kl", k3)


def kl_estimate(
    log_probs: Tensor,
    ref_log_probs: Tensor,
    response_mask: Tensor,
    kl_estimator: str = "k1",
    *,
    kl_clamp: float | None = None,
) -> Tensor:
    """Per-token KL estimate (B, T) with the named estimator; 0 at masked positions.

    `kl_clamp` None keeps the estimator's own default bound.
    """
    response_mask = check_mask(response_mask)
    check_same_shape(log_probs=log_probs, ref_log_probs=ref_log_probs, response_mask=response_mask)
    estimator = KL_ESTIMATORS.get(kl_estimator)
    kl = (
        estimator(log_probs, ref_log_probs)
        if kl_clamp is None
        else estimator(log_probs, ref_log_probs, kl_clamp=kl_clamp)
    )
    return torch.where(response_mask.bool(), kl, torch.zeros((), dtype=kl.dtype, device=kl.device))


def apply_kl_penalty(
    token_rewards: Tensor,
    old_log_probs: Tensor,
    ref_log_probs: Tensor,
    response_mask: Tensor,
    *,
    kl_coef: float,
    kl_estimator: str = "k1",
    kl_clamp: float | None = None,
) -> tuple[Tensor, Tensor]:
    """r_t - kl_coef * KL_t at valid tokens; returns (penalised rewards, per-token KL), both (B, T).

    Uses the rollout-time log-probs; nothing here is differentiated.
    """
    check_same_shape(token_rewards=token_rewards, old_log_probs=old_log_probs)
    with torch.no_grad():
        kl = kl_estimate(old_log_probs, ref_log_probs, response_mask, kl_estimator, kl_clamp=kl_clamp)
        return token_rewards - kl_coef * kl, kl


def kl_loss(
    log_probs: Tensor,
    ref_log_probs: Tensor,
    response_mask: Tensor,
    *,
    kl_estimator: str = "k3",
    kl_clamp: float | None = None,
    loss_agg_mode: str = "token-mean",
    global_tokens: float | Tensor | None = None,
    global_seqs: float | Tensor | None = None,
    norm_length: float | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """agg(KL_t) over the current log-probs (with grad); the caller multiplies by its coefficient.

    Metrics, over this call's tokens alone: `actor/kl_loss` (aggregated with local normalizers)
    and `actor/kl` (token mean, what the KL controllers are fed).
    """
    kl = kl_estimate(log_probs, ref_log_probs, response_mask, kl_estimator, kl_clamp=kl_clamp)
    loss = aggregate(
        kl,
        response_mask,
        loss_agg_mode,
        global_tokens=global_tokens,
        global_seqs=global_seqs,
        norm_length=norm_length,
    )
    mask = check_mask(response_mask)
    local = aggregate(kl.detach(), mask, loss_agg_mode, norm_length=norm_length)  # this call alone
    mean = masked_mean(kl.detach(), mask)
    return loss, {"actor/kl_loss": float(local.item()), "actor/kl": float(mean.item())}


@KL_CONTROLLERS.register("fixed")
class FixedKLController:
    """A constant coefficient `kl_coef`."""

    #: Whether `update` needs a measured KL (an algorithm may then skip measuring it).
    needs_measurement: ClassVar[bool] = False

    def __init__(self, *, kl_coef: float) -> None:
        if kl_coef < 0:
            raise ValueError(f"kl_coef must be >= 0, got {kl_coef}")
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """No-op: the coefficient is fixed."""

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = float(state["value"])


@KL_CONTROLLERS.register("adaptive")
class AdaptiveKLController:
    """Proportional controller towards a target KL (Ziegler et al. 2019, arXiv:1909.08593, sec. 2.2).

    beta <- beta * (1 + clip(KL / target_kl - 1, -0.2, 0.2) * n_steps / horizon). `n_steps` is
    the number of samples the KL was measured on, so `horizon` is counted in samples (the
    paper and verl use 10000).
    """

    needs_measurement: ClassVar[bool] = True

    def __init__(self, *, kl_coef: float, target_kl: float, horizon: float) -> None:
        if kl_coef < 0:
            raise ValueError(f"kl_coef must be >= 0, got {kl_coef}")
        if target_kl <= 0:
            raise ValueError(f"target_kl must be > 0, got {target_kl}")
        if horizon <= 0:
            raise ValueError(f"horizon must be > 0, got {horizon}")
        self.value = float(kl_coef)
        self.target_kl = float(target_kl)
        self.horizon = float(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        error = min(max(current_kl / self.target_kl - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = float(state["value"])
