"""Built-in algorithms: PPO, GRPO, RLOO, REINFORCE++, online DPO, and DynamicKLPPO.

The four policy-gradient algorithms share one implementation (`PolicyGradientAlgorithm`) and
differ in their params: which advantage estimator they default to, whether the KL to the
reference is a reward penalty or a loss term, and the estimator's own hyperparameters. Every
component is looked up by name in its registry and called through `bind_call`, so any
registered or import-path estimator, policy loss, KL estimator, controller or aggregation mode
can be swapped in through params alone.

`DynamicKLPPO` is the worked example of a custom algorithm: a few lines on top of `PPO`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar

import torch
from torch import Tensor

from .aggregation import aggregate
from .base import Algorithm, AlgorithmParams, Batch, bind_call, param, require
from .kl import apply_kl_penalty, kl_estimate, kl_loss
from .masking import (
    check_mask,
    check_per_sequence,
    group_ids,
    masked_mean,
    masked_sum,
    scores_to_token_rewards,
)
from .preference import pair_up
from .registry import (
    ADVANTAGE_ESTIMATORS,
    ALGORITHMS,
    KL_CONTROLLERS,
    KL_ESTIMATORS,
    LOSS_AGGREGATIONS,
    POLICY_LOSSES,
    PREFERENCE_LOSSES,
)
from .value_loss import clipped_value_loss

__all__ = [
    "PolicyGradientParams",
    "PolicyGradientAlgorithm",
    "PPOParams",
    "PPO",
    "GRPOParams",
    "GRPO",
    "RLOOParams",
    "RLOO",
    "ReinforcePlusPlusParams",
    "ReinforcePlusPlus",
    "OnlineDPOParams",
    "OnlineDPO",
    "DynamicKLPPOParams",
    "DynamicKLPPO",
]


# ---------------------------------------------------------------------------------------------
# Policy-gradient family
# ---------------------------------------------------------------------------------------------


def _like(base: type[AlgorithmParams], name: str, default: Any) -> Any:
    """Re-declare `base`'s field `name` with a new default, keeping its documentation."""
    inherited = base.__dataclass_fields__[name]  # type: ignore[attr-defined]
    return dataclasses.field(default=default, metadata=inherited.metadata)


@dataclasses.dataclass(frozen=True)
class PolicyGradientParams(AlgorithmParams):
    """Hyperparameters shared by PPO, GRPO, RLOO and REINFORCE++."""

    advantage_estimator: str = param(
        "gae", "Advantage estimator (ADVANTAGE_ESTIMATORS).", choices=ADVANTAGE_ESTIMATORS
    )
    policy_loss: str = param(
        "ppo",
        "Policy surrogate loss (POLICY_LOSSES): 'ppo' clipped or 'gspo' sequence-level.",
        choices=POLICY_LOSSES,
    )
    clip_ratio_low: float = param(
        0.2,
        "Lower clip epsilon: the ratio is clipped at 1 - clip_ratio_low (the GSPO paper uses 3e-4 for gspo).",
    )
    clip_ratio_high: float = param(
        0.2,
        "Upper clip epsilon: the ratio is clipped at 1 + clip_ratio_high (DAPO's clip-higher uses 0.28; "
        "GSPO 4e-4).",
    )
    clip_ratio_c: float | None = param(
        3.0,
        "Dual-clip constant c > 1 capping the loss at -c*A for negative advantages (ppo loss); null disables.",
    )
    log_ratio_clamp: float = param(20.0, "The log importance ratio is clamped to +-this before exp().")
    loss_agg_mode: str = param(
        "token-mean", "How token losses become one scalar (LOSS_AGGREGATIONS).", choices=LOSS_AGGREGATIONS
    )
    norm_length: float | None = param(
        None, "Constant length divisor of seq-mean-token-sum-norm (set it to the generation budget); null: T."
    )
    entropy_coef: float = param(0.0, "Weight of the entropy bonus (needs batch key 'entropy'); 0 disables.")
    kl_coef: float = param(0.001, "Initial coefficient beta of the KL to the reference policy; 0 disables.")
    kl_estimator: str = param("k1", "Per-token KL estimator (KL_ESTIMATORS).", choices=KL_ESTIMATORS)
    kl_in_reward: bool = param(
        True, "true: subtract beta*KL from the rewards before advantages; false: add beta*KL to the loss."
    )
    kl_clamp: float | None = param(
        None, "Bound on each per-token KL estimate; null keeps the estimator's own (verl: only k3, at 10)."
    )
    kl_controller: str = param(
        "fixed",
        "How beta evolves (KL_CONTROLLERS): 'fixed' or 'adaptive' (Ziegler et al. 2019).",
        choices=KL_CONTROLLERS,
    )
    target_kl: float = param(0.1, "Target KL of the adaptive controller (and of dynamic_kl_ppo).")
    horizon: float = param(10000.0, "Adaptive controller horizon, in samples.")
    whiten_unbiased: bool = param(
        True, "Whitening uses the unbiased variance (n - 1, verl) instead of the biased one (n, OpenRLHF)."
    )

    def validate(self) -> None:
        if not 0.0 <= self.clip_ratio_low < 1.0:
            raise ValueError(f"clip_ratio_low must be in [0, 1), got {self.clip_ratio_low}")
        if self.clip_ratio_high < 0:
            raise ValueError(f"clip_ratio_high must be >= 0, got {self.clip_ratio_high}")
        if self.clip_ratio_c is not None and self.clip_ratio_c <= 1.0:
            raise ValueError(f"clip_ratio_c must be > 1 (or null), got {self.clip_ratio_c}")
        for name in ("log_ratio_clamp", "target_kl", "horizon"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.kl_coef < 0:
            raise ValueError(f"kl_coef must be >= 0, got {self.kl_coef}")
        for name in ("norm_length", "kl_clamp"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be > 0 or null, got {value}")


class PolicyGradientAlgorithm(Algorithm):
    """Advantage estimator + policy loss + optional KL and entropy terms, all chosen by params."""

    Params: ClassVar[type[AlgorithmParams]] = PolicyGradientParams
    params: PolicyGradientParams

    def __init__(self, **params: Any) -> None:
        super().__init__(**params)
        p = self.params
        self._estimator = ADVANTAGE_ESTIMATORS.get(p.advantage_estimator)
        self._policy_loss = POLICY_LOSSES.get(p.policy_loss)
        self.kl_controller: Any = bind_call(
            KL_CONTROLLERS.get(p.kl_controller), {}, p.as_dict(), "KL controller"
        )
        self.num_updates = 0
        # Every KL controller scales the coefficient multiplicatively, so 0 stays 0: no KL term,
        # and no reference policy to run.
        if self.kl_coef == 0:
            self.needs_reference = False

    @property
    def kl_coef(self) -> float:
        """The current KL coefficient beta (owned by the KL controller)."""
        return float(self.kl_controller.value)

    @kl_coef.setter
    def kl_coef(self, value: float) -> None:
        self.kl_controller.value = float(value)

    def _hyper(self, batch: Mapping[str, Any]) -> dict[str, Any]:
        """Params plus the batch's global normalizers: the keyword arguments of every component."""
        return {
            **self.params.as_dict(),
            "global_tokens": batch.get("global_tokens"),
            "global_seqs": batch.get("global_seqs"),
        }

    def _rewards(self, batch: Batch, mask: Tensor) -> tuple[Tensor, Tensor]:
        """(token_rewards (B, T), scores (B,)), with the KL penalty applied when it goes in the reward."""
        token_rewards = batch.get("token_rewards")
        scores = batch.get("scores")
        if token_rewards is not None:
            if tuple(token_rewards.shape) != tuple(mask.shape):
                raise ValueError(
                    f"shape mismatch: token_rewards {tuple(token_rewards.shape)}, response_mask {tuple(mask.shape)}"
                )
            token_rewards = torch.where(mask.bool(), token_rewards, torch.zeros_like(token_rewards))
            scores = token_rewards.sum(dim=1)
        elif scores is not None:
            token_rewards = scores_to_token_rewards(scores, mask)
        else:
            raise ValueError(
                f"{self.name} compute_advantages needs batch key 'scores' (B,) or 'token_rewards' (B, T); "
                f"the batch has {', '.join(sorted(batch))}"
            )
        if self.params.kl_in_reward and self.kl_coef != 0:
            who = f"{self.name} compute_advantages (kl_in_reward)"
            token_rewards, kl = apply_kl_penalty(
                token_rewards,
                require(batch, "old_log_probs", who),
                require(batch, "ref_log_probs", who),
                mask,
                kl_coef=self.kl_coef,
                kl_estimator=self.params.kl_estimator,
                kl_clamp=self.params.kl_clamp,
            )
            scores = scores - self.kl_coef * kl.sum(dim=1)
        return token_rewards, scores

    def compute_advantages(self, batch: Batch) -> Batch:
        mask = check_mask(require(batch, "response_mask", f"{self.name} compute_advantages"))
        token_rewards, scores = self._rewards(batch, mask)
        inputs = {**batch, "response_mask": mask, "token_rewards": token_rewards, "scores": scores}
        advantages, returns = bind_call(
            self._estimator,
            inputs,
            self.params.as_dict(),
            f"advantage estimator {self.params.advantage_estimator!r}",
        )
        return {**batch, "advantages": advantages, "returns": returns}

    def compute_loss(self, batch: Batch) -> dict[str, Any]:
        p = self.params
        who = f"{self.name} compute_loss"
        mask = check_mask(require(batch, "response_mask", who))
        log_probs = require(batch, "log_probs", who)
        hyper = self._hyper(batch)
        loss, metrics = bind_call(
            self._policy_loss, {**batch, "response_mask": mask}, hyper, f"policy loss {p.policy_loss!r}"
        )
        metrics = dict(metrics)

        entropy = (
            require(batch, "entropy", f"{who} (entropy_coef != 0)")
            if p.entropy_coef
            else batch.get("entropy")
        )
        if entropy is not None:
            metrics["actor/entropy"] = float(masked_mean(entropy.detach(), mask).item())
            if p.entropy_coef:
                bonus = aggregate(
                    entropy,
                    mask,
                    p.loss_agg_mode,
                    global_tokens=hyper["global_tokens"],
                    global_seqs=hyper["global_seqs"],
                    norm_length=p.norm_length,
                )
                loss = loss - p.entropy_coef * bonus

        kl_as_loss = not p.kl_in_reward and self.kl_coef != 0
        ref: Tensor | None = (
            require(batch, "ref_log_probs", f"{who} (KL loss)") if kl_as_loss else batch.get("ref_log_probs")
        )
        if kl_as_loss and ref is not None:
            kl_value, kl_metrics = kl_loss(
                log_probs,
                ref,
                mask,
                kl_estimator=p.kl_estimator,
                kl_clamp=p.kl_clamp,
                loss_agg_mode=p.loss_agg_mode,
                global_tokens=hyper["global_tokens"],
                global_seqs=hyper["global_seqs"],
                norm_length=p.norm_length,
            )
            loss = loss + self.kl_coef * kl_value
            metrics.update(kl_metrics)
        elif ref is not None:
            kl = kl_estimate(log_probs.detach(), ref, mask, p.kl_estimator, kl_clamp=p.kl_clamp)
            metrics["actor/kl"] = float(masked_mean(kl, mask).item())
        metrics["actor/kl_coef"] = self.kl_coef
        return {"loss": loss, **metrics}

    def update_step(self, loss_dict: Mapping[str, Any]) -> None:
        """Feed the measured KL (`actor/kl`) to the KL controller."""
        self.num_updates += 1
        measured = loss_dict.get("actor/kl")
        if measured is None:
            if getattr(self.kl_controller, "needs_measurement", True):
                raise ValueError(
                    f"{self.name} update_step: KL controller {self.params.kl_controller!r} needs 'actor/kl' "
                    f"in loss_dict (reported by compute_loss when 'ref_log_probs' is in the batch); "
                    f"got keys {', '.join(sorted(loss_dict)) or '(none)'}"
                )
            return
        self.kl_controller.update(float(measured), int(loss_dict.get("batch/num_samples", 1)))

    def state_dict(self) -> dict[str, Any]:
        return {
            **super().state_dict(),
            "kl_controller": self.kl_controller.state_dict(),
            "num_updates": self.num_updates,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        super().load_state_dict(state)
        self.kl_controller.load_state_dict(state["kl_controller"])
        self.num_updates = int(state["num_updates"])


# ---------------------------------------------------------------------------------------------
# PPO
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class PPOParams(PolicyGradientParams):
    """PPO with a critic and GAE (Ouyang et al. 2022 setup: KL penalty in the reward)."""

    gamma: float = param(1.0, "Discount factor.")
    lam: float = param(1.0, "GAE lambda (bias/variance trade-off; 1 = Monte Carlo returns minus values).")
    gae_masking: str = param(
        "carry",
        "Masked positions in GAE: 'carry' skips them (verl), 'zero' zeroes rewards and values there (OpenRLHF).",
        choices=("carry", "zero"),
    )
    whiten_advantages: bool = param(True, "Normalise GAE advantages over the batch's valid tokens.")
    clip_range_value: float | None = param(
        0.5, "Value clipping: the new value may move at most this far from the old one; null disables."
    )

    def validate(self) -> None:
        super().validate()
        for name in ("gamma", "lam"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)}")
        if self.clip_range_value is not None and self.clip_range_value < 0:
            raise ValueError(f"clip_range_value must be >= 0 or null, got {self.clip_range_value}")


@ALGORITHMS.register("ppo")
class PPO(PolicyGradientAlgorithm):
    """Proximal Policy Optimization (Schulman et al. 2017, arXiv:1707.06347) with a learned critic."""

    name: ClassVar[str] = "ppo"
    needs_critic: ClassVar[bool] = True
    needs_reference = True
    Params: ClassVar[type[AlgorithmParams]] = PPOParams
    params: PPOParams

    def compute_value_loss(self, batch: Batch) -> dict[str, Any]:
        """Clipped value loss on `values`, `old_values`, `returns`, `response_mask`."""
        mask = check_mask(require(batch, "response_mask", f"{self.name} compute_value_loss"))
        loss, metrics = bind_call(
            clipped_value_loss, {**batch, "response_mask": mask}, self._hyper(batch), "value loss"
        )
        return {"loss": loss, **metrics}


# ---------------------------------------------------------------------------------------------
# Critic-free policy-gradient algorithms
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class GRPOParams(PolicyGradientParams):
    """GRPO: group-normalised outcome advantages, KL as a loss term (k3) rather than in the reward."""

    advantage_estimator: str = _like(PolicyGradientParams, "advantage_estimator", "grpo")
    kl_estimator: str = _like(PolicyGradientParams, "kl_estimator", "k3")
    kl_in_reward: bool = _like(PolicyGradientParams, "kl_in_reward", False)
    epsilon: float = param(1e-6, "Added to the group std before dividing (verl 1e-6, OpenRLHF 1e-9).")
    norm_by_std: bool = param(True, "Divide by the group std; false gives Dr.GRPO (arXiv:2503.20783).")

    def validate(self) -> None:
        super().validate()
        if self.epsilon < 0:
            raise ValueError(f"epsilon must be >= 0, got {self.epsilon}")


@ALGORITHMS.register("grpo")
class GRPO(PolicyGradientAlgorithm):
    """Group Relative Policy Optimization (Shao et al. 2024, arXiv:2402.03300); needs `group_index`."""

    name: ClassVar[str] = "grpo"
    needs_reference = True
    Params: ClassVar[type[AlgorithmParams]] = GRPOParams
    params: GRPOParams


@dataclasses.dataclass(frozen=True)
class RLOOParams(PolicyGradientParams):
    """RLOO: leave-one-out baseline within each prompt's group, KL penalty in the reward."""

    advantage_estimator: str = _like(PolicyGradientParams, "advantage_estimator", "rloo")


@ALGORITHMS.register("rloo")
class RLOO(PolicyGradientAlgorithm):
    """REINFORCE Leave-One-Out (Ahmadian et al. 2024, arXiv:2402.14740); needs `group_index`."""

    name: ClassVar[str] = "rloo"
    needs_reference = True
    Params: ClassVar[type[AlgorithmParams]] = RLOOParams
    params: RLOOParams


@dataclasses.dataclass(frozen=True)
class ReinforcePlusPlusParams(PolicyGradientParams):
    """REINFORCE++: discounted returns with the KL penalty in the reward, whitened over the batch."""

    advantage_estimator: str = _like(PolicyGradientParams, "advantage_estimator", "reinforce_plus_plus")
    gamma: float = param(1.0, "Discount factor of the returns.")

    def validate(self) -> None:
        super().validate()
        if not 0.0 <= self.gamma <= 1.0:
            raise ValueError(f"gamma must be in [0, 1], got {self.gamma}")


@ALGORITHMS.register("reinforce_plus_plus")
class ReinforcePlusPlus(PolicyGradientAlgorithm):
    """REINFORCE++ (Hu 2025, arXiv:2501.03262); advantage_estimator 'reinforce_plus_plus_baseline'
    gives the group-baseline variant."""

    name: ClassVar[str] = "reinforce_plus_plus"
    needs_reference = True
    Params: ClassVar[type[AlgorithmParams]] = ReinforcePlusPlusParams
    params: ReinforcePlusPlusParams


# ---------------------------------------------------------------------------------------------
# DynamicKLPPO: the worked example of a custom algorithm
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class DynamicKLPPOParams(PPOParams):
    """PPO params plus the bounds of the KL coefficient schedule."""

    kl_coef: float = _like(PPOParams, "kl_coef", 0.05)
    beta_min: float = param(0.001, "Lower bound of the KL coefficient.")
    beta_max: float = param(1.0, "Upper bound of the KL coefficient.")

    def validate(self) -> None:
        super().validate()
        if not 0 < self.beta_min <= self.beta_max:
            raise ValueError(
                f"need 0 < beta_min <= beta_max, got beta_min={self.beta_min}, beta_max={self.beta_max}"
            )
        if not self.beta_min <= self.kl_coef <= self.beta_max:
            raise ValueError(
                f"kl_coef {self.kl_coef} must lie in [beta_min, beta_max] = [{self.beta_min}, {self.beta_max}]"
            )
        if self.kl_controller != "fixed":
            raise ValueError(
                f"dynamic_kl_ppo schedules the KL coefficient itself; kl_controller must be 'fixed', got {self.kl_controller!r}"
            )


@ALGORITHMS.register("dynamic_kl_ppo")
class DynamicKLPPO(PPO):
    """PPO whose KL coefficient follows a step schedule towards `target_kl`.

    After each optimizer step: beta x 1.5 when the measured KL exceeds 1.5 x target_kl,
    beta x 0.5 when it is below 0.5 x target_kl, then beta is kept within [beta_min, beta_max].
    Everything else is PPO; beta is checkpointed through the KL controller's state.
    """

    name: ClassVar[str] = "dynamic_kl_ppo"
    Params: ClassVar[type[AlgorithmParams]] = DynamicKLPPOParams
    params: DynamicKLPPOParams

    def update_step(self, loss_dict: Mapping[str, Any]) -> None:
        super().update_step(loss_dict)  # counts the step; the 'fixed' controller does nothing
        measured = float(require(loss_dict, "actor/kl", f"{self.name} update_step"))
        target = self.params.target_kl
        beta = self.kl_coef
        if measured > 1.5 * target:
            beta *= 1.5
        elif measured < 0.5 * target:
            beta *= 0.5
        self.kl_coef = min(max(beta, self.params.beta_min), self.params.beta_max)


# ---------------------------------------------------------------------------------------------
# Online DPO
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class OnlineDPOParams(AlgorithmParams):
    """Online DPO: two samples per prompt, the better-scored one is chosen, a preference loss on the pair."""

    preference_loss: str = param(
        "dpo", "Pairwise loss (PREFERENCE_LOSSES): 'dpo' or 'ipo'.", choices=PREFERENCE_LOSSES
    )
    beta: float = param(0.1, "Strength of the implicit KL regularisation to the reference.")
    label_smoothing: float = param(0.0, "DPO only: assumed share of flipped preference labels, in [0, 0.5).")
    length_normalize: bool = param(
        False, "Use the mean instead of the sum of token log-probs per sequence (as TRL's IPO does)."
    )

    def validate(self) -> None:
        if self.beta <= 0:
            raise ValueError(f"beta must be > 0, got {self.beta}")
        if not 0.0 <= self.label_smoothing < 0.5:
            raise ValueError(f"label_smoothing must be in [0, 0.5), got {self.label_smoothing}")


@ALGORITHMS.register("online_dpo")
class OnlineDPO(Algorithm):
    """Online DPO (Guo et al. 2024, arXiv:2402.04792): DPO/IPO on pairs sampled from the current policy.

    `compute_advantages` does not produce advantages: it makes the pairs. When the batch has no
    `chosen` / `pair_index`, each `group_index` group must hold exactly 2 samples and the one
    with the higher `scores` is chosen (a tie goes to the earlier sample in the batch).
    `compute_loss` needs `log_probs`, `ref_log_probs`, `response_mask`, `chosen`, `pair_index`;
    `global_seqs`, if given, counts sequences (2 per pair).
    """

    name: ClassVar[str] = "online_dpo"
    needs_reference = True
    Params: ClassVar[type[AlgorithmParams]] = OnlineDPOParams
    params: OnlineDPOParams

    def __init__(self, **params: Any) -> None:
        super().__init__(**params)
        self._loss = PREFERENCE_LOSSES.get(self.params.preference_loss)

    def compute_advantages(self, batch: Batch) -> Batch:
        if batch.get("chosen") is not None and batch.get("pair_index") is not None:
            return dict(batch)
        who = f"{self.name} compute_advantages"
        mask = check_mask(require(batch, "response_mask", who))
        scores = require(batch, "scores", who)
        group_index = require(batch, "group_index", who)
        check_per_sequence(mask, scores=scores, group_index=group_index)
        ids, num_groups = group_ids(group_index)  # (B,), G
        sizes = torch.zeros(num_groups, dtype=torch.long, device=ids.device).index_add(
            0, ids, torch.ones_like(ids)
        )
        if bool((sizes != 2).any()):
            raise ValueError(
                f"{self.name} needs exactly 2 samples per group_index group, got group sizes {sizes.tolist()}"
            )
        best = torch.full((num_groups,), float("-inf"), dtype=scores.dtype, device=scores.device)
        best = best.scatter_reduce(0, ids, scores, reduce="amax")  # (G,)
        position = torch.arange(scores.shape[0], device=ids.device)  # (B,)
        candidate = torch.where(scores == best[ids], position, torch.full_like(position, scores.shape[0]))
        first_best = torch.full((num_groups,), scores.shape[0], device=ids.device).scatter_reduce(
            0, ids, candidate, reduce="amin"
        )  # (G,)
        return {**batch, "chosen": position == first_best[ids], "pair_index": group_index}

    def compute_loss(self, batch: Batch) -> dict[str, Any]:
        p = self.params
        who = f"{self.name} compute_loss"
        mask = check_mask(require(batch, "response_mask", who))
        log_probs = require(batch, "log_probs", who)
        ref_log_probs = require(batch, "ref_log_probs", who)
        chosen = require(batch, "chosen", who)
        pair_index = require(batch, "pair_index", who)
        if log_probs.shape != mask.shape or ref_log_probs.shape != mask.shape:
            raise ValueError(
                f"shape mismatch: log_probs {tuple(log_probs.shape)}, ref_log_probs {tuple(ref_log_probs.shape)}, "
                f"response_mask {tuple(mask.shape)}"
            )
        seq_logps = masked_sum(log_probs, mask, dim=1)  # (B,)
        ref_seq_logps = masked_sum(ref_log_probs.detach(), mask, dim=1)  # (B,)
        if p.length_normalize:
            lengths = mask.sum(dim=1).clamp(min=1)
            seq_logps, ref_seq_logps = seq_logps / lengths, ref_seq_logps / lengths
        chosen_logps, rejected_logps = pair_up(seq_logps, chosen, pair_index)  # (P,) each
        ref_chosen, ref_rejected = pair_up(ref_seq_logps, chosen, pair_index)
        global_seqs = batch.get("global_seqs")
        inputs = {
            "chosen_logps": chosen_logps,
            "rejected_logps": rejected_logps,
            "ref_chosen_logps": ref_chosen,
            "ref_rejected_logps": ref_rejected,
        }
        hyper = {**p.as_dict(), "global_pairs": None if global_seqs is None else float(global_seqs) / 2.0}
        loss, metrics = bind_call(self._loss, inputs, hyper, f"preference loss {p.preference_loss!r}")
        return {"loss": loss, **metrics}
