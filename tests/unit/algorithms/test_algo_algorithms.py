"""The `Algorithm` contract and the built-ins, checked end to end against the reference formulas."""

from __future__ import annotations

import math

import algo_reference as ref
import pytest
import torch
from algo_reference import LAYOUTS, SEEDS, case, close, randn, to_lists
from torch.autograd import gradcheck

from rlhf_api.fields import BUILTIN_ALGORITHMS
from rlhf_trainer.algorithms import (
    ALGORITHMS,
    GRPO,
    PPO,
    Algorithm,
    DynamicKLPPO,
    OnlineDPO,
    UnknownNameError,
    build_algorithm,
    count_normalizers,
    describe_params,
    list_algorithms,
)
from rlhf_trainer.algorithms.builtin import PPOParams

#: Every shipped algorithm (test_algo_registry keeps the registry equal to this list).
BUILTINS = sorted(BUILTIN_ALGORITHMS)
small_grid = pytest.mark.parametrize(("layout", "seed"), [(lay, sd) for lay in LAYOUTS for sd in SEEDS])


def rollout(shape, layout, seed, groups=True):
    """A rollout batch as the trainer would hand it to compute_advantages."""
    gen, mask = case(shape, layout, seed)
    old = randn(shape, gen) - 1.0
    batch = {
        "response_mask": mask,
        "old_log_probs": old,
        "ref_log_probs": old + randn(shape, gen, 0.2),
        "old_values": randn(shape, gen),
        "scores": randn((shape[0],), gen),
        "baseline_scores": randn((shape[0],), gen),
        "group_index": torch.arange(shape[0]) // 2 if groups else torch.arange(shape[0]),
    }
    return gen, batch


def training(batch, gen):
    """Add what the actor/critic workers compute in the update phase."""
    shape = batch["response_mask"].shape
    return {
        **batch,
        "log_probs": (batch["old_log_probs"] + randn(shape, gen, 0.3)).requires_grad_(True),
        "values": (batch["old_values"] + randn(shape, gen, 0.3)).requires_grad_(True),
        "entropy": randn(shape, gen).abs(),
    }


# ----------------------------------------------------------------------------- registry surface


def test_list_algorithms_matches_the_spec():
    from rlhf_api.fields import BUILTIN_ALGORITHMS

    assert list_algorithms() == BUILTINS
    assert sorted(BUILTIN_ALGORITHMS) == BUILTINS


@pytest.mark.parametrize("name", BUILTINS)
def test_every_builtin_builds_with_defaults_and_documents_its_params(name):
    algo = build_algorithm(name, {})
    assert isinstance(algo, Algorithm) and algo.name == name
    assert isinstance(algo.needs_critic, bool) and isinstance(algo.needs_reference, bool)
    described = describe_params(name)
    assert described
    for field, (hint, default, doc) in described.items():
        assert doc and doc.endswith((".", ")")), field
        assert getattr(algo.params, field) == default
        assert hint is not None


def test_flags():
    assert [n for n in BUILTINS if ALGORITHMS.get(n).needs_critic] == ["dynamic_kl_ppo", "ppo"]
    assert all(ALGORITHMS.get(n).needs_reference for n in BUILTINS)


def test_describe_params_lists_choices():
    described = describe_params("ppo")
    hint, default, doc = described["loss_agg_mode"]
    assert hint is str and default == "token-mean"
    assert "seq-mean-token-sum-norm" in doc
    assert described["clip_ratio_c"][0] == (float | None)
    assert "carry, zero" in described["gae_masking"][2]


# ----------------------------------------------------------------------------- params


def test_params_accept_camel_and_snake_case_and_coerce_ints():
    algo = build_algorithm("ppo", {"clipRatioHigh": 0.28, "kl_coef": 0, "lam": 1})
    assert algo.params.clip_ratio_high == 0.28
    assert algo.params.kl_coef == 0.0 and isinstance(algo.params.kl_coef, float)
    assert algo.params.lam == 1.0


@pytest.mark.parametrize(
    ("name", "params", "message"),
    [
        (
            "ppo",
            {"clipRatio": 0.2},
            r"unknown param 'clipRatio' for PPOParams; valid: .*clip_ratio_low \(clipRatioLow\)",
        ),
        ("grpo", {"lam": 0.9}, "unknown param 'lam' for GRPOParams"),
        ("ppo", {"klCoef": "high"}, r"param 'kl_coef' must be float, got 'high' \(str\)"),
        ("ppo", {"klInReward": 1}, r"param 'kl_in_reward' must be bool, got 1 \(int\)"),
        ("ppo", {"klCoef": None}, "param 'kl_coef' must be float, got None"),
        ("ppo", {"lossAggMode": "mean"}, "unknown loss aggregation mode 'mean'; valid: seq-mean-token-mean"),
        ("ppo", {"klEstimator": "k4"}, "unknown KL estimator 'k4'; valid: abs, k1, k2, k3, low_var_kl, mse"),
        ("grpo", {"advantageEstimator": "gaee"}, "unknown advantage estimator 'gaee'"),
        ("ppo", {"gaeMasking": "skip"}, "param 'gae_masking' must be one of carry, zero; got 'skip'"),
        ("ppo", {"clipRatioC": 1.0}, r"clip_ratio_c must be > 1 \(or null\), got 1.0"),
        ("ppo", {"gamma": 1.5}, r"gamma must be in \[0, 1\], got 1.5"),
        ("ppo", {"kl_coef": 0.1, "klCoef": 0.2}, "param 'kl_coef' given twice"),
        (
            "dynamic_kl_ppo",
            {"klController": "adaptive"},
            "klController must be 'fixed'; got klController \"adaptive\"",
        ),
        (
            "dynamic_kl_ppo",
            {"betaMin": 0.5, "betaMax": 0.1},
            "betaMin must be <= betaMax; got betaMin 0.5, betaMax 0.1",
        ),
        ("dynamic_kl_ppo", {"klCoef": 2.0}, r"klCoef must lie in \[betaMin, betaMax\]; got klCoef 2.0"),
        ("online_dpo", {"preferenceLoss": "kto"}, "unknown preference loss 'kto'; valid: dpo, ipo"),
        ("online_dpo", {"labelSmoothing": 0.7}, r"label_smoothing must be in \[0, 0.5\)"),
    ],
)
def test_param_errors(name, params, message):
    with pytest.raises(ValueError, match=message):
        build_algorithm(name, params)


def test_unknown_registry_value_is_unknown_name_error():
    with pytest.raises(UnknownNameError):
        build_algorithm("ppo", {"policyLoss": "trpo"})


# ----------------------------------------------------------------------------- advantages through the algorithms


@small_grid
@pytest.mark.parametrize("kl_estimator", ["k1", "k3"])
def test_ppo_advantages_with_kl_in_reward(layout, seed, kl_estimator):
    _, batch = rollout((4, 5), layout, seed)
    algo = PPO(gamma=0.9, lam=0.95, kl_coef=0.2, kl_estimator=kl_estimator)
    out = algo.compute_advantages(batch)
    m = to_lists(batch["response_mask"])
    kl = ref.kl_matrix(
        to_lists(batch["old_log_probs"]),
        to_lists(batch["ref_log_probs"]),
        m,
        kl_estimator,
        10.0 if kl_estimator == "k3" else None,
    )
    rewards = ref.scores_to_token_rewards(to_lists(batch["scores"]), m)
    rewards = [[r - 0.2 * k for r, k in zip(rr, kk)] for rr, kk in zip(rewards, kl)]
    advantages, returns = ref.gae_carry(rewards, to_lists(batch["old_values"]), m, 0.9, 0.95)
    close(out["advantages"], ref.whiten(advantages, m))
    close(out["returns"], returns)
    assert out["scores"] is batch["scores"]  # the input batch is extended, not rewritten


@small_grid
def test_outcome_algorithms_fold_the_reward_kl_into_scores(layout, seed):
    _, batch = rollout((4, 3), layout, seed)
    m = to_lists(batch["response_mask"])
    kl = ref.kl_matrix(to_lists(batch["old_log_probs"]), to_lists(batch["ref_log_probs"]), m, "k1", None)
    scores = [s - 0.1 * sum(row) for s, row in zip(to_lists(batch["scores"]), kl)]
    index = batch["group_index"].tolist()
    rloo = build_algorithm("rloo", {"klCoef": 0.1}).compute_advantages(batch)
    close(rloo["advantages"], ref.rloo(scores, index, m))
    grpo = build_algorithm(
        "grpo", {"klCoef": 0.1, "klInReward": True, "klEstimator": "k1"}
    ).compute_advantages(batch)
    close(grpo["advantages"], ref.grpo(scores, index, m, 1e-6, True))
    # GRPO's default puts the KL in the loss: advantages see the raw scores
    plain = build_algorithm("grpo", {}).compute_advantages(batch)
    close(plain["advantages"], ref.grpo(to_lists(batch["scores"]), index, m, 1e-6, True))


@small_grid
def test_reinforce_plus_plus_variants(layout, seed):
    _, batch = rollout((4, 3), layout, seed)
    m = to_lists(batch["response_mask"])
    token_rewards = randn((4, 3), torch.Generator().manual_seed(seed))
    out = build_algorithm("reinforce_plus_plus", {"klCoef": 0.0, "gamma": 0.9}).compute_advantages(
        {**batch, "token_rewards": token_rewards}
    )
    returns = ref.discounted_returns(to_lists(token_rewards), m, 0.9)
    close(out["returns"], returns)
    close(out["advantages"], ref.whiten(returns, m))
    base = build_algorithm(
        "reinforce_plus_plus", {"klCoef": 0.0, "advantageEstimator": "reinforce_plus_plus_baseline"}
    )
    out = base.compute_advantages(batch)
    close(
        out["advantages"],
        ref.reinforce_pp_baseline(to_lists(batch["scores"]), batch["group_index"].tolist(), m, True),
    )
    remax = build_algorithm(
        "reinforce_plus_plus", {"klCoef": 0.0, "advantageEstimator": "remax"}
    ).compute_advantages(batch)
    expected, _ = ref.remax(
        ref.scores_to_token_rewards(to_lists(batch["scores"]), m), to_lists(batch["baseline_scores"]), m
    )
    close(remax["advantages"], expected)


# ----------------------------------------------------------------------------- losses through the algorithms


@small_grid
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_grpo_loss_is_clip_loss_plus_kl_minus_entropy(layout, seed, mode):
    gen, batch = rollout((4, 5), layout, seed)
    algo = GRPO(kl_coef=0.05, entropy_coef=0.01, loss_agg_mode=mode, clip_ratio_high=0.28)
    batch = training(algo.compute_advantages(batch), gen)
    out = algo.compute_loss(batch)
    m = to_lists(batch["response_mask"])
    lp, old, adv = (
        to_lists(batch["log_probs"]),
        to_lists(batch["old_log_probs"]),
        to_lists(batch["advantages"]),
    )
    pg, pg_metrics = ref.ppo(lp, old, adv, m, 0.2, 0.28, 3.0, 20.0, mode)
    kl = ref.kl_matrix(lp, to_lists(batch["ref_log_probs"]), m, "k3", 10.0)
    entropy = ref.aggregate(to_lists(batch["entropy"]), m, mode)
    close(out["loss"], pg + 0.05 * ref.aggregate(kl, m, mode) - 0.01 * entropy)
    for key, value in pg_metrics.items():
        close(out[key], value)
    close(out["actor/kl"], ref.masked_mean(kl, m))
    close(out["actor/entropy"], ref.masked_mean(to_lists(batch["entropy"]), m))
    assert out["actor/kl_coef"] == 0.05


@pytest.mark.parametrize("name", ["ppo", "grpo", "rloo", "reinforce_plus_plus", "dynamic_kl_ppo"])
@pytest.mark.parametrize("policy_loss", ["ppo", "gspo"])
def test_policy_gradient_loss_gradcheck(name, policy_loss):
    gen, batch = rollout((4, 4), "holes", 0)
    algo = build_algorithm(
        name, {"klInReward": False, "klCoef": 0.1, "entropyCoef": 0.01, "policyLoss": policy_loss}
    )
    batch = training(algo.compute_advantages(batch), gen)
    assert gradcheck(lambda lp: algo.compute_loss({**batch, "log_probs": lp})["loss"], (batch["log_probs"],))


@small_grid
def test_ppo_value_loss(layout, seed):
    gen, batch = rollout((3, 4), layout, seed)
    algo = PPO(clip_range_value=0.2, loss_agg_mode="seq-mean-token-mean")
    batch = training(algo.compute_advantages(batch), gen)
    out = algo.compute_value_loss(batch)
    expected, clipfrac = ref.value_loss(
        to_lists(batch["values"]),
        to_lists(batch["old_values"]),
        to_lists(batch["returns"]),
        to_lists(batch["response_mask"]),
        0.2,
        "seq-mean-token-mean",
    )
    close(out["loss"], expected)
    close(out["critic/vf_clipfrac"], clipfrac)
    assert gradcheck(lambda v: algo.compute_value_loss({**batch, "values": v})["loss"], (batch["values"],))


def test_value_loss_only_with_a_critic():
    with pytest.raises(ValueError, match="algorithm 'grpo' has no critic"):
        GRPO().compute_value_loss({})


@pytest.mark.parametrize("name", ["ppo", "grpo"])
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_algorithm_loss_over_ranks_and_micro_batches_equals_full_batch(name, mode):
    gen, batch = rollout((8, 6), "holes", 1)
    batch["response_mask"][5] = 0
    algo = build_algorithm(
        name, {"lossAggMode": mode, "klInReward": False, "klCoef": 0.1, "entropyCoef": 0.01, "normLength": 6}
    )
    batch = training(algo.compute_advantages(batch), gen)
    full = algo.compute_loss(batch)["loss"]
    pieces = [(0, 3), (3, 4), (4, 6), (6, 8)]  # 2 ranks x 2 micro-batches
    counts = [count_normalizers(batch["response_mask"][a:b]) for a, b in pieces]
    norms = {"global_tokens": sum(c[0] for c in counts), "global_seqs": sum(c[1] for c in counts)}
    per_sample = {k: v for k, v in batch.items() if isinstance(v, torch.Tensor)}
    total = sum(
        algo.compute_loss({**{k: v[a:b] for k, v in per_sample.items()}, **norms})["loss"] for a, b in pieces
    )
    close(total, full.item())
    # metrics describe each micro-batch alone: the global normalizers do not change them
    micro = {k: v[0:3] for k, v in per_sample.items()}
    plain, shared = algo.compute_loss(micro), algo.compute_loss({**micro, **norms})
    assert {k: v for k, v in plain.items() if k != "loss"} == {k: v for k, v in shared.items() if k != "loss"}
    if mode == "token-mean":  # so token-weighted averaging recovers the full-batch value
        outs = [algo.compute_loss({k: v[a:b] for k, v in per_sample.items()}) for a, b in pieces]
        tokens = [c[0] for c in counts]
        averaged = sum(o["actor/pg_loss"] * n for o, n in zip(outs, tokens)) / sum(tokens)
        close(averaged, algo.compute_loss(batch)["actor/pg_loss"])
    (g_full,) = torch.autograd.grad(full, batch["log_probs"])
    (g_sum,) = torch.autograd.grad(total, batch["log_probs"])
    close(g_sum, to_lists(g_full))


def test_missing_batch_keys_are_named():
    with pytest.raises(ValueError, match=r"shape mismatch: token_rewards \(2, 3\), response_mask \(2, 2\)"):
        GRPO().compute_advantages({"response_mask": torch.ones(2, 2), "token_rewards": torch.ones(2, 3)})
    with pytest.raises(ValueError, match=r"scores \(3,\) must be \(B,\) = \(2,\)"):
        GRPO().compute_advantages({"response_mask": torch.ones(2, 2), "scores": torch.ones(3)})
    with pytest.raises(ValueError, match="needs batch key 'scores' .* or 'token_rewards'"):
        GRPO().compute_advantages({"response_mask": torch.ones(2, 2)})
    with pytest.raises(
        ValueError, match="advantage estimator 'grpo' needs batch key 'group_index'; the batch has"
    ):
        GRPO().compute_advantages({"response_mask": torch.ones(2, 2), "scores": torch.ones(2)})
    with pytest.raises(ValueError, match="advantage estimator 'gae' needs batch key 'old_values'"):
        PPO(kl_coef=0).compute_advantages({"response_mask": torch.ones(2, 2), "scores": torch.ones(2)})
    with pytest.raises(
        ValueError, match=r"ppo compute_advantages \(kl_in_reward\) needs batch key 'ref_log_probs'"
    ):
        PPO().compute_advantages(
            {"response_mask": torch.ones(2, 2), "scores": torch.ones(2), "old_log_probs": torch.ones(2, 2)}
        )
    with pytest.raises(ValueError, match=r"grpo compute_loss \(KL loss\) needs batch key 'ref_log_probs'"):
        GRPO().compute_loss(
            {k: torch.zeros(2, 2) for k in ("log_probs", "old_log_probs", "advantages")}
            | {"response_mask": torch.ones(2, 2)}
        )
    with pytest.raises(ValueError, match=r"entropy_coef != 0\) needs batch key 'entropy'"):
        GRPO(entropy_coef=0.1, kl_coef=0).compute_loss(
            {k: torch.zeros(2, 2) for k in ("log_probs", "old_log_probs", "advantages")}
            | {"response_mask": torch.ones(2, 2)}
        )
    with pytest.raises(ValueError, match=r"shape mismatch: log_probs \(2, 2\), old_log_probs \(2, 3\)"):
        GRPO(kl_coef=0).compute_loss(
            {
                "log_probs": torch.zeros(2, 2),
                "old_log_probs": torch.zeros(2, 3),
                "advantages": torch.zeros(2, 2),
                "response_mask": torch.ones(2, 2),
            }
        )


# ----------------------------------------------------------------------------- KL control and state


def test_adaptive_controller_follows_ziegler_and_checkpoints():
    algo = PPO(kl_controller="adaptive", kl_coef=0.1, target_kl=0.05, horizon=1000)
    beta = 0.1
    for measured, samples in [(0.2, 64), (0.051, 64), (0.0, 128), (0.06, 1)]:
        algo.update_step({"actor/kl": measured, "batch/num_samples": samples})
        beta *= 1 + max(min(measured / 0.05 - 1, 0.2), -0.2) * samples / 1000
        assert algo.kl_coef == pytest.approx(beta, rel=1e-12)
    state = algo.state_dict()
    assert state["algorithm"] == "ppo" and state["num_updates"] == 4
    fresh = PPO(kl_controller="adaptive", kl_coef=0.1, target_kl=0.05, horizon=1000)
    fresh.load_state_dict(state)
    assert fresh.kl_coef == algo.kl_coef and fresh.num_updates == 4
    with pytest.raises(ValueError, match="needs 'actor/kl' in loss_dict"):
        algo.update_step({"actor/pg_loss": 1.0})
    with pytest.raises(ValueError, match="checkpoint holds state of algorithm 'ppo', not 'grpo'"):
        GRPO().load_state_dict(state)


def test_fixed_controller_ignores_missing_kl():
    algo = GRPO(kl_coef=0.01)
    algo.update_step({"actor/pg_loss": 0.3})
    algo.update_step({"actor/kl": 5.0})
    assert algo.kl_coef == 0.01 and algo.num_updates == 2


def test_dynamic_kl_ppo_schedule():
    algo = DynamicKLPPO(kl_coef=0.1, target_kl=0.1, beta_min=0.02, beta_max=0.3)
    schedule = [
        (0.2, 0.15),  # > 1.5 x target: x1.5
        (0.151, 0.225),  # still above: x1.5
        (0.16, 0.3),  # x1.5 would be 0.3375: capped at beta_max
        (0.1, 0.3),  # within [0.5, 1.5] x target: unchanged
        (0.15, 0.3),  # exactly 1.5 x target is not "exceeds": unchanged
        (0.049, 0.15),  # < 0.5 x target: x0.5
        (0.0, 0.075),
        (0.0, 0.0375),
        (0.0, 0.02),  # x0.5 would be 0.01875: floored at beta_min
        (0.05, 0.02),  # exactly 0.5 x target: unchanged
    ]
    for measured, expected in schedule:
        algo.update_step({"actor/kl": measured})
        assert algo.kl_coef == pytest.approx(expected, rel=1e-12)
    restored = DynamicKLPPO(kl_coef=0.1, target_kl=0.1, beta_min=0.02, beta_max=0.3)
    restored.load_state_dict(algo.state_dict())
    assert restored.kl_coef == pytest.approx(0.02) and restored.num_updates == len(schedule)
    with pytest.raises(ValueError, match="dynamic_kl_ppo update_step needs batch key 'actor/kl'"):
        algo.update_step({})


def test_dynamic_kl_ppo_coefficient_reaches_the_rewards():
    _, batch = rollout((2, 3), "right", 0)
    algo = DynamicKLPPO(kl_coef=0.1, target_kl=0.01, beta_min=0.01, beta_max=1.0, whiten_advantages=False)
    before = algo.compute_advantages(batch)["returns"]
    algo.update_step({"actor/kl": 1.0})  # way above target: beta 0.1 -> 0.15
    after = algo.compute_advantages(batch)["returns"]
    assert algo.kl_coef == pytest.approx(0.15)
    m = to_lists(batch["response_mask"])
    kl = ref.kl_matrix(to_lists(batch["old_log_probs"]), to_lists(batch["ref_log_probs"]), m, "k1", None)
    rewards = ref.scores_to_token_rewards(to_lists(batch["scores"]), m)
    for beta, got in ((0.1, before), (0.15, after)):
        shaped = [[r - beta * k for r, k in zip(rr, kk)] for rr, kk in zip(rewards, kl)]
        close(got, ref.gae_carry(shaped, to_lists(batch["old_values"]), m, 1.0, 1.0)[1])


def test_ppo_params_type():
    assert isinstance(PPO().params, PPOParams)


# ----------------------------------------------------------------------------- online DPO


def test_online_dpo_pairs_from_scores():
    batch = {
        "response_mask": torch.ones(6, 2, dtype=torch.float64),
        "scores": torch.tensor([0.1, 0.9, 0.5, 0.7, 2.0, -1.0], dtype=torch.float64),
        "group_index": torch.tensor([7, 7, 3, 3, 1, 1]),
    }
    out = OnlineDPO().compute_advantages(batch)
    assert out["chosen"].tolist() == [False, True, False, True, True, False]
    assert out["train_rows"].tolist() == [True] * 6
    assert out["pair_index"] is batch["group_index"]
    assert (out["dpo/pairs"], out["dpo/groups_without_pair"]) == (3.0, 0.0)


def test_online_dpo_skips_and_counts_groups_without_a_pair():
    """A group of one (the reward filter dropped its partner) and a tie give no pair; a group of
    three pairs its best with its worst. The old code raised on the group sizes and trained on
    the tie."""
    batch = {
        "response_mask": torch.ones(8, 2, dtype=torch.float64),
        #                      lone  tie  tie  best mid  worst  a    b
        "scores": torch.tensor([0.3, 0.5, 0.5, 0.9, 0.4, 0.1, 1.0, 0.0], dtype=torch.float64),
        "group_index": torch.tensor([0, 1, 1, 2, 2, 2, 3, 3]),
    }
    out = OnlineDPO().compute_advantages(batch)
    assert out["train_rows"].tolist() == [False, False, False, True, False, True, True, True]
    assert out["chosen"].tolist() == [False, False, False, True, False, False, True, False]
    assert (out["dpo/pairs"], out["dpo/groups_without_pair"]) == (2.0, 2.0)
    # the kept rows make valid pairs for the loss
    keep = out["train_rows"]
    kept = {k: v[keep] for k, v in out.items() if isinstance(v, torch.Tensor)}
    lp = torch.zeros(4, 2, dtype=torch.float64, requires_grad=True)
    loss = OnlineDPO().compute_loss({**kept, "log_probs": lp, "ref_log_probs": torch.zeros(4, 2).double()})
    assert loss["loss"].item() == pytest.approx(math.log(2.0))  # margin 0: -log sigmoid(0), 2 pairs
    # every group tied or alone: nothing to train on, no error
    none = OnlineDPO().compute_advantages({**batch, "scores": torch.zeros(8, dtype=torch.float64)})
    assert not none["train_rows"].any() and none["dpo/groups_without_pair"] == 4.0


@pytest.mark.parametrize("loss", ["dpo", "ipo"])
@pytest.mark.parametrize("length_normalize", [False, True])
@pytest.mark.parametrize("seed", SEEDS)
def test_online_dpo_loss(loss, length_normalize, seed):
    gen, batch = rollout((6, 4), "right", seed)
    algo = build_algorithm(
        "online_dpo",
        {"preferenceLoss": loss, "beta": 0.3, "lengthNormalize": length_normalize, "labelSmoothing": 0.0},
    )
    batch = training(algo.compute_advantages(batch), gen)
    out = algo.compute_loss(batch)
    m = to_lists(batch["response_mask"])

    def seq(x):
        sums = [sum(v for v, k in zip(row, mr) if k == 1.0) for row, mr in zip(to_lists(x), m)]
        return [s / max(sum(mr), 1) for s, mr in zip(sums, m)] if length_normalize else sums

    lp, rp = seq(batch["log_probs"]), seq(batch["ref_log_probs"])
    chosen, pairs = batch["chosen"].tolist(), batch["pair_index"].tolist()
    losses = []
    for p in sorted(set(pairs)):
        (c,) = [i for i in range(6) if pairs[i] == p and chosen[i]]
        (r,) = [i for i in range(6) if pairs[i] == p and not chosen[i]]
        args = (lp[c], lp[r], rp[c], rp[r], 0.3)
        losses.append(ref.dpo(*args, 0.0) if loss == "dpo" else ref.ipo(*args))
    close(out["loss"], sum(losses) / len(losses))
    assert math.isclose(out["actor/dpo_loss"], out["loss"].item())
    if seed == 0:
        assert gradcheck(
            lambda x: algo.compute_loss({**batch, "log_probs": x})["loss"], (batch["log_probs"],)
        )
    halves = [
        algo.compute_loss(
            {**{k: v[a:b] for k, v in batch.items() if isinstance(v, torch.Tensor)}, "global_seqs": 6}
        )["loss"]
        for a, b in ((0, 2), (2, 6))
    ]
    close(sum(halves), out["loss"].item())


@pytest.mark.parametrize("name", ["ppo", "grpo", "rloo", "reinforce_plus_plus"])
def test_kl_coef_zero_needs_no_reference(name):
    assert build_algorithm(name, {"klCoef": 0.0}).needs_reference is False
    assert build_algorithm(name, {"klCoef": 0.01}).needs_reference is True


# ----------------------------------------------------------------------------- presets: gspo, dr_grpo, remax


def _one_sequence_up(log_ratio: float):
    """Two sequences of one group (scores 1 and 0: GRPO advantages +-1/sqrt(2)... here we set
    them), each 2 valid tokens whose log-ratio to the old policy is `log_ratio` per token."""
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]], dtype=torch.float64)
    old = torch.full((2, 3), -1.0, dtype=torch.float64) * mask
    return {
        "response_mask": mask,
        "old_log_probs": old,
        "log_probs": (old + log_ratio * mask).requires_grad_(True),
        "advantages": torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]], dtype=torch.float64),
    }


def test_gspo_preset_has_the_papers_defaults_and_clips_the_sequence_ratio():
    algo = build_algorithm("gspo")
    p = algo.params
    assert (p.policy_loss, p.clip_ratio_low, p.clip_ratio_high) == ("gspo", 3e-4, 4e-4)
    assert (p.loss_agg_mode, p.advantage_estimator, p.norm_by_std, p.kl_coef) == (
        "seq-mean-token-mean",
        "grpo",
        True,
        0.0,
    )
    assert not algo.needs_reference and not algo.needs_critic
    # sequence ratio exp(0.001) = 1.0010005 > 1 + 4e-4: clipped, loss = -(1 + 4e-4) per token
    out = algo.compute_loss(_one_sequence_up(0.001))
    assert out["loss"].item() == pytest.approx(-(1 + 4e-4), rel=1e-12)
    assert out["actor/pg_clipfrac"] == 1.0
    # within the range: the unclipped ratio exp(2e-4)
    inside = algo.compute_loss(_one_sequence_up(2e-4))
    assert inside["loss"].item() == pytest.approx(-math.exp(2e-4), rel=1e-12)
    assert inside["actor/pg_clipfrac"] == 0.0


def test_policy_loss_gspo_under_grpo_warns_about_the_ppo_clip_range():
    with pytest.warns(UserWarning, match=r"policyLoss gspo with clipRatioLow 0.2 / clipRatioHigh 0.2"):
        wide = build_algorithm("grpo", {"policyLoss": "gspo", "klCoef": 0.0})
    # what the warning is about: the PPO range leaves the same ratio unclipped
    assert wide.compute_loss(_one_sequence_up(0.001))["loss"].item() == pytest.approx(
        -math.exp(0.001), rel=1e-12
    )
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        build_algorithm("grpo", {"policyLoss": "gspo", "clipRatioLow": 3e-4, "clipRatioHigh": 4e-4})
        build_algorithm("gspo")


def test_dr_grpo_preset_no_std_and_a_constant_length_normaliser_from_the_job():
    from rlhf_api.loader import parse_job

    job = parse_job(
        {
            "apiVersion": "rlhf.dev/v1alpha1",
            "kind": "RLTrainingJob",
            "metadata": {"name": "dr"},
            "spec": {
                "model": {"path": "m"},
                "data": {"path": "d.jsonl"},
                "reward": {"functions": [{"path": "rlhf_trainer.rewards.builtin:arithmetic_exact"}]},
                "algorithm": {"name": "dr_grpo"},
                "rollout": {"samplesPerPrompt": 4, "maxNewTokens": 8},
            },
        }
    )
    algo = build_algorithm("dr_grpo", {"klCoef": 0.0}, job=job.spec)
    p = algo.params
    assert (p.norm_by_std, p.loss_agg_mode, p.norm_length) == (False, "seq-mean-token-sum-norm", 8.0)
    assert build_algorithm("dr_grpo", {"normLength": 16}, job=job.spec).params.norm_length == 16.0
    assert build_algorithm("dr_grpo").params.norm_length is None  # no job: the padded length T
    with pytest.raises(ValueError, match="normByStd must be false"):
        build_algorithm("dr_grpo", {"normByStd": True})

    lengths = [2, 3, 1, 4]
    for width in (4, 6):  # the normaliser does not follow the batch's longest response
        mask = torch.tensor([[1.0] * n + [0.0] * (width - n) for n in lengths], dtype=torch.float64)
        batch = {
            "response_mask": mask,
            "scores": torch.tensor([1.0, 0.0, 0.0, 0.0], dtype=torch.float64),
            "group_index": torch.zeros(4, dtype=torch.long),
        }
        adv = algo.compute_advantages(batch)["advantages"]
        # r - mean: no division by the group std (GRPO would give 1.5 and -0.5)
        assert adv[:, 0].tolist() == pytest.approx([0.75, -0.25, -0.25, -0.25])
        lp = torch.zeros_like(mask).requires_grad_(True)
        out = algo.compute_loss({**batch, "advantages": adv, "log_probs": lp, "old_log_probs": lp.detach()})
        # ratio 1: sum_i sum_t -A_i / (S * normLength) = (-0.75*2 + 0.25*(3+1+4)) / (4 * 8)
        assert out["loss"].item() == pytest.approx(0.5 / 32, rel=1e-12)


def test_remax_preset_uses_the_greedy_baseline():
    algo = build_algorithm("remax", {"klCoef": 0.0})
    assert algo.needs_baseline and not build_algorithm("grpo").needs_baseline
    assert build_algorithm("reinforce_plus_plus", {"advantageEstimator": "remax"}).needs_baseline
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]], dtype=torch.float64)
    out = algo.compute_advantages(
        {
            "response_mask": mask,
            "scores": torch.tensor([1.0, 0.0], dtype=torch.float64),
            "baseline_scores": torch.tensor([0.25, 0.5], dtype=torch.float64),
        }
    )
    assert out["advantages"].tolist() == [[0.75, 0.75, 0.0], [-0.5, 0.0, 0.0]]


def test_the_algorithms_doc_lists_every_builtin():
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[3] / "docs" / "algorithms.md").read_text()
    table = doc.split("## The built-ins", 1)[1].split("\n## ", 1)[0]
    assert sorted(line.split("`")[1] for line in table.splitlines() if line.startswith("| `")) == BUILTINS
