"""Built-in algorithms: PPO, GRPO (and its presets GSPO and Dr.GRPO), RLOO, REINFORCE++, ReMax,
online DPO, and DynamicKLPPO.

The four policy-gradient algorithms share one implementation (`PolicyGradientAlgorithm`) and
differ in their params: which advantage estimator they default to, whether the KL to the
reference is a reward penalty or a loss term, and the estimator's own hyperparameters. Every
component is looked up by name in its registry and called through `bind_call`, so any
registered or import-path estimator, policy loss, KL estimator, controller or aggregation mode
can be swapped in through params alone.

`DynamicKLPPO` is the worked example of a custom algorithm: a few lines on top of `PPO`.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Mapping
from typing import Any, ClassVar

import torch
from torch import Tensor

from rlhf_api import algorithm_params
from rlhf_api.algorithm_params import (
    DrGRPOParams,
    DynamicKLPPOParams,
    GRPOParams,
    GSPOParams,
    OnlineDPOParams,
    PolicyGradientParams,
    PPOParams,
    ReinforcePlusPlusParams,
    ReMaxParams,
    RLOOParams,
)

from . import dapo
from .aggregation import aggregate
from .base import Algorithm, AlgorithmParams, Batch, bind_call, require
from .kl import apply_kl_penalty, kl_estimate, kl_loss
from .masking import (
    check_mask,
    check_per_sequence,
    group_ids,
    masked_mean,
    masked_sum,
    scores_to_token_rewards,
)
from .off_policy import weighted_advantages
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

for _registry_name, _registry in {
    "ADVANTAGE_ESTIMATORS": ADVANTAGE_ESTIMATORS,
    "POLICY_LOSSES": POLICY_LOSSES,
    "LOSS_AGGREGATIONS": LOSS_AGGREGATIONS,
    "KL_ESTIMATORS": KL_ESTIMATORS,
    "KL_CONTROLLERS": KL_CONTROLLERS,
    "PREFERENCE_LOSSES": PREFERENCE_LOSSES,
}.items():
    algorithm_params.bind_registry(_registry_name, _registry)

__all__ = [
    "PolicyGradientParams",
    "PolicyGradientAlgorithm",
    "PPOParams",
    "PPO",
    "GRPOParams",
    "GRPO",
    "GSPOParams",
    "GSPO",
    "DrGRPOParams",
    "DrGRPO",
    "ReMaxParams",
    "ReMax",
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

#: A gspo clip range at least this wide is a token-level (PPO) range: warn (see `PolicyGradientAlgorithm`).
GSPO_WIDE_CLIP = 0.01


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
        # klCoef 0: no KL term, and no reference policy to run (`PolicyGradientParams.uses_reference`,
        # which decides the job's roles too: `rlhf_api.job.unused_roles`).
        if not p.uses_reference():
            self.needs_reference = False
        # With entropyCoef 0 the entropy is neither in the loss nor worth a full-vocabulary pass.
        self.needs_entropy = p.entropy_coef != 0
        self.needs_baseline = "baseline_scores" in inspect.signature(self._estimator).parameters
        if p.policy_loss == "gspo" and min(p.clip_ratio_low, p.clip_ratio_high) >= GSPO_WIDE_CLIP:
            warnings.warn(
                f"{self.name or type(self).__name__}: policyLoss gspo with clipRatioLow {p.clip_ratio_low} / "
                f"clipRatioHigh {p.clip_ratio_high}, a token-level PPO range: GSPO's sequence-level ratio is "
                "a geometric mean and its paper clips it at 3e-4 / 4e-4 with lossAggMode seq-mean-token-mean. "
                "Use algorithm `gspo` for those defaults, or set the clip range explicitly.",
                UserWarning,
                stacklevel=2,
            )

    @property
    def advantages_read_old_log_probs(self) -> bool:
        """Only the KL penalty in the reward (`klInReward` with a nonzero coefficient) reads them."""
        return bool(self.params.kl_in_reward and self.kl_coef != 0)

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
        shaped, dapo_out = self._dapo_shaping(batch, mask)
        token_rewards, scores = self._rewards(shaped, mask)
        inputs = {**shaped, "response_mask": mask, "token_rewards": token_rewards, "scores": scores}
        advantages, returns = bind_call(
            self._estimator,
            inputs,
            self.params.as_dict(),
            f"advantage estimator {self.params.advantage_estimator!r}",
        )
        return {**batch, "advantages": advantages, "returns": returns, **dapo_out}

    def _dapo_shaping(self, batch: Batch, mask: Tensor) -> tuple[Batch, dict[str, Any]]:
        """DAPO's overlong soft penalty added to the rewards (`scores`, or the last valid token of
        `token_rewards`), and with `mask_truncated` the `train_rows` that leave truncated responses
        out of the update; the batch unchanged and nothing else when both are off."""
        p, out = self.params, {}
        if p.overlong_buffer_length > 0:
            if p.overlong_max_length is None:
                raise ValueError(
                    f"{self.name}: overlong_buffer_length {p.overlong_buffer_length} needs overlong_max_length "
                    "(the job gives rollout.maxNewTokens)"
                )
            lengths = mask.sum(-1)  # (B,)
            penalty = dapo.overlong_penalty(
                lengths, p.overlong_max_length, p.overlong_buffer_length, p.overlong_penalty_factor
            ).to(mask.dtype)  # (B,)
            batch = dict(batch)
            if batch.get("token_rewards") is not None:
                batch["token_rewards"] = batch["token_rewards"] + scores_to_token_rewards(penalty, mask)
            else:
                batch["scores"] = require(batch, "scores", f"{self.name} compute_advantages") + penalty
            out["dapo/overlong_penalty_mean"] = float(penalty.mean()) if len(penalty) else 0.0
            out["dapo/overlong_penalized"] = float((penalty < 0).sum())
        if p.mask_truncated:
            truncated = require(batch, "truncated", f"{self.name} compute_advantages (mask_truncated)").bool()
            out["train_rows"] = ~truncated  # (B,)
            out["dapo/truncated_masked"] = float(truncated.sum())
        return batch, out

    def compute_loss(self, batch: Batch) -> dict[str, Any]:
        p = self.params
        who = f"{self.name} compute_loss"
        mask = check_mask(require(batch, "response_mask", who))
        log_probs = require(batch, "log_probs", who)
        hyper = self._hyper(batch)
        inputs = {**batch, "response_mask": mask}
        if batch.get("is_weights") is not None:  # rollout correction (`phases.rollout_correction`)
            inputs["advantages"] = weighted_advantages(require(batch, "advantages", who), batch["is_weights"])
        loss, metrics = bind_call(self._policy_loss, inputs, hyper, f"policy loss {p.policy_loss!r}")
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


@ALGORITHMS.register("ppo")
class PPO(PolicyGradientAlgorithm):
    """Proximal Policy Optimization (Schulman et al. 2017, arXiv:1707.06347) with a learned critic."""

    name: ClassVar[str] = "ppo"
    needs_critic: ClassVar[bool] = PPOParams.USES_CRITIC
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


@ALGORITHMS.register("grpo")
class GRPO(PolicyGradientAlgorithm):
    """Group Relative Policy Optimization (Shao et al. 2024, arXiv:2402.03300); needs `group_index`."""

    name: ClassVar[str] = "grpo"
    needs_reference = True
    Params: ClassVar[type[AlgorithmParams]] = GRPOParams
    params: GRPOParams


@ALGORITHMS.register("gspo")
class GSPO(GRPO):
    """Group Sequence Policy Optimization (Zheng et al. 2025, arXiv:2507.18071), the paper's defaults.

    GRPO's group-normalised advantages; the importance ratio per sequence, s_i = the geometric
    mean of its token ratios (`policy_loss.gspo_loss`), clipped to [1 - 3e-4, 1 + 4e-4] (the
    paper's ranges: s_i is length-normalised, so its range is tiny); the loss is the mean over
    sequences of each sequence's token mean (`seq-mean-token-mean`); no KL term (klCoef 0, the
    paper's objective has none; set klCoef to add GRPO's k3 KL loss).
    """

    name: ClassVar[str] = "gspo"
    Params: ClassVar[type[AlgorithmParams]] = GSPOParams
    params: GSPOParams


@ALGORITHMS.register("dr_grpo")
class DrGRPO(GRPO):
    """Dr.GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training", arXiv:2503.20783).

    GRPO's two biases removed: advantages are r_i - mean of the group (no division by the
    group std), and each sequence's token losses are summed and divided by a constant,
    `normLength` (default in a job: the generation budget `rollout.maxNewTokens`), not by its
    own length; the loss is the mean of those over sequences (`seq-mean-token-sum-norm`). A long
    wrong answer is then penalised as much per token as a short one. KL as in GRPO.
    """

    name: ClassVar[str] = "dr_grpo"
    Params: ClassVar[type[AlgorithmParams]] = DrGRPOParams
    params: DrGRPOParams


@ALGORITHMS.register("remax")
class ReMax(PolicyGradientAlgorithm):
    """ReMax (Li et al. 2023, arXiv:2310.10505): A = return - reward of the greedy response.

    The trainer generates one greedy (temperature 0) response per prompt with the policy that
    sampled the step, scores it with the job's rewards and passes it as `baseline_scores`
    (`needs_baseline`); samplesPerPrompt can be 1.
    """

    name: ClassVar[str] = "remax"
    needs_reference = True
    Params: ClassVar[type[AlgorithmParams]] = ReMaxParams
    params: ReMaxParams


@ALGORITHMS.register("rloo")
class RLOO(PolicyGradientAlgorithm):
    """REINFORCE Leave-One-Out (Ahmadian et al. 2024, arXiv:2402.14740); needs `group_index`."""

    name: ClassVar[str] = "rloo"
    needs_reference = True
    Params: ClassVar[type[AlgorithmParams]] = RLOOParams
    params: RLOOParams


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


def best_and_worst(scores: Tensor, group_index: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Each group's preference pair: its best- and worst-scored samples.

    scores: (B,); group_index: (B,) integer label of each sample's group (G distinct labels).
    Returns `chosen` (B,) bool (the group's first sample with the highest score), `rejected`
    (B,) bool (its first sample with the lowest score) and `has_pair` (G,) bool, groups in
    label order. A group with one sample, or whose scores are all equal, has no pair: none of
    its samples is chosen or rejected.
    """
    ids, num_groups = group_ids(group_index)  # (B,), G
    n = scores.shape[0]
    sizes = torch.zeros(num_groups, dtype=torch.long, device=ids.device).index_add(
        0, ids, torch.ones_like(ids)
    )  # (G,)
    best = torch.full((num_groups,), float("-inf"), dtype=scores.dtype, device=scores.device)
    best = best.scatter_reduce(0, ids, scores, reduce="amax")  # (G,)
    worst = torch.full((num_groups,), float("inf"), dtype=scores.dtype, device=scores.device)
    worst = worst.scatter_reduce(0, ids, scores, reduce="amin")  # (G,)
    has_pair = (sizes >= 2) & (best > worst)  # (G,): a tie has nothing to prefer
    position = torch.arange(n, device=ids.device)  # (B,)
    none = torch.full_like(position, n)

    def first(where: Tensor) -> Tensor:  # (B,) bool -> (G,) first position per group, n if none
        candidate = torch.where(where, position, none)
        return torch.full((num_groups,), n, device=ids.device).scatter_reduce(
            0, ids, candidate, reduce="amin"
        )

    paired = has_pair[ids]  # (B,)
    chosen = (position == first(scores == best[ids])[ids]) & paired
    rejected = (position == first(scores == worst[ids])[ids]) & paired
    return chosen, rejected, has_pair


@ALGORITHMS.register("online_dpo")
class OnlineDPO(Algorithm):
    """Online DPO (Guo et al. 2024, arXiv:2402.04792): DPO/IPO on pairs sampled from the current policy.

    `compute_advantages` does not produce advantages: it makes the pairs. When the batch has no
    `chosen` / `pair_index`, each `group_index` group gives at most one pair: its best-scored
    sample (chosen) and its worst-scored one (rejected), the earliest in the batch on equal
    scores. A group without a pair — one sample left (the reward filter dropped the others) or
    every score equal (a tie: no preference to learn) — is skipped, and so are the samples of a
    group outside its pair. The returned `train_rows` (B,) bool says which samples the update
    trains on; `dpo/pairs` and `dpo/groups_without_pair` count the step's groups.
    `compute_loss` needs `log_probs`, `ref_log_probs`, `response_mask`, `chosen`, `pair_index`;
    `global_seqs`, if given, counts sequences (2 per pair).
    """

    name: ClassVar[str] = "online_dpo"
    needs_reference = True
    needs_entropy = False

    @property
    def advantages_read_old_log_probs(self) -> bool:
        """The pairs come from the scores alone."""
        return False

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
        chosen, rejected, has_pair = best_and_worst(scores, group_index)  # (B,), (B,), (G,)
        train_rows = chosen | rejected
        return {
            **batch,
            "chosen": chosen,
            "pair_index": group_index,
            "train_rows": train_rows,
            "dpo/pairs": float(has_pair.sum()),
            "dpo/groups_without_pair": float((~has_pair).sum()),
        }

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
