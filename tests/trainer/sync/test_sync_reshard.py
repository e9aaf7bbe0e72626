"""ReshardPlan: rules, GQA replication, uneven vocab splits, and shards that reassemble."""

from __future__ import annotations

import pytest
import torch

from rlhf_trainer.sync import ReshardPlan, ShardRule, default_tp_rules

# Qwen2-0.5B-like layer with 14 query heads of 64 and 2 KV heads (GQA), vocab 151936, and a tiny
# variant whose sizes are divisible in interesting ways.
HEAD = 8


def qwen_like(
    vocab: int = 50, hidden: int = 32, q_heads: int = 4, kv_heads: int = 2, ffn: int = 64
) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    p = "model.layers.0."
    return {
        "model.embed_tokens.weight": r(vocab, hidden),
        p + "self_attn.q_proj.weight": r(q_heads * HEAD, hidden),
        p + "self_attn.q_proj.bias": r(q_heads * HEAD),
        p + "self_attn.k_proj.weight": r(kv_heads * HEAD, hidden),
        p + "self_attn.k_proj.bias": r(kv_heads * HEAD),
        p + "self_attn.v_proj.weight": r(kv_heads * HEAD, hidden),
        p + "self_attn.o_proj.weight": r(hidden, q_heads * HEAD),
        p + "mlp.gate_proj.weight": r(ffn, hidden),
        p + "mlp.up_proj.weight": r(ffn, hidden),
        p + "mlp.down_proj.weight": r(hidden, ffn),
        p + "input_layernorm.weight": r(hidden),
        "model.norm.weight": r(hidden),
        "lm_head.weight": r(vocab, hidden),
    }


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_shards_reassemble(tp: int) -> None:
    w = qwen_like()
    plan = ReshardPlan.for_tensors(w.items(), tp, default_tp_rules(head_dim=HEAD))
    for name, full in w.items():
        shards = [plan.shard(name, r).take(full) for r in range(tp)]
        assert torch.equal(plan.assemble(name, shards), full), name


def test_default_rules_tp2() -> None:
    w = qwen_like()
    plan = ReshardPlan.for_tensors(w.items(), 2, default_tp_rules(head_dim=HEAD))
    kinds = {n.split(".")[-2] if "proj" in n else n: (k, d, s) for n, k, d, s in plan.describe()}
    assert kinds["q_proj"][:2] == ("column", 0)
    assert plan.shard("model.layers.0.self_attn.q_proj.weight", 1).shape == (16, 32)
    assert plan.shard("model.layers.0.self_attn.q_proj.bias", 1).shape == (16,)
    assert plan.shard("model.layers.0.self_attn.o_proj.weight", 0).shape == (32, 16)  # row: dim 1
    assert plan.shard("model.layers.0.mlp.down_proj.weight", 1).shape == (32, 32)
    assert plan.shard("model.layers.0.mlp.gate_proj.weight", 0).shape == (32, 32)
    assert (
        plan.shard("model.norm.weight", 1).shape == (32,) and plan.shard("model.norm.weight", 1).dim is None
    )
    assert plan.shard("model.embed_tokens.weight", 0).shape == (25, 32)


def test_kv_heads_replicated_when_fewer_than_ranks() -> None:
    # 2 KV heads over TP 4: ranks 0,1 share head 0, ranks 2,3 share head 1 (vLLM's GQA layout).
    w = qwen_like()
    plan = ReshardPlan.for_tensors(w.items(), 4, default_tp_rules(head_dim=HEAD))
    k = w["model.layers.0.self_attn.k_proj.weight"]
    got = [plan.shard("model.layers.0.self_attn.k_proj.weight", r).take(k) for r in range(4)]
    assert all(g.shape == (HEAD, 32) for g in got)
    assert torch.equal(got[0], got[1]) and torch.equal(got[2], got[3]) and not torch.equal(got[1], got[2])
    assert torch.equal(got[2], k[HEAD:])


def test_uneven_vocab_split() -> None:
    plan = ReshardPlan({"lm_head.weight": (50, 8)}, 4)
    sizes = [plan.shard("lm_head.weight", r).shape[0] for r in range(4)]
    assert sizes == [13, 13, 13, 11]


def test_indivisible_column_split_is_an_error() -> None:
    with pytest.raises(ValueError, match=r"q_proj.weight.*cannot be split over tensor_parallel_size=4"):
        ReshardPlan({"model.layers.0.self_attn.q_proj.weight": (24, 8)}, 4, default_tp_rules(head_dim=8))


def test_custom_rules_first_match_wins() -> None:
    rules = [ShardRule(r"wte$", 1, kind="column"), ShardRule(".*", None)]
    plan = ReshardPlan({"transformer.wte": (10, 6), "ln": (6,)}, 3, rules)
    assert plan.shard("transformer.wte", 2).shape == (10, 2) and plan.shard("transformer.wte", 2).start == 4
    assert plan.shard("ln", 0).dim is None


def test_colocated_take_is_a_view() -> None:
    w = qwen_like()
    plan = ReshardPlan.for_tensors(w.items(), 2, default_tp_rules(head_dim=HEAD))
    name = "model.layers.0.mlp.up_proj.weight"
    view = plan.shard(name, 1).take(w[name])
    assert view.untyped_storage().data_ptr() == w[name].untyped_storage().data_ptr()


def test_metas_follow_the_plan() -> None:
    w = qwen_like()
    plan = ReshardPlan.for_tensors(w.items(), 2, default_tp_rules(head_dim=HEAD))
    metas = plan.metas(0, {n: torch.bfloat16 for n in w})
    assert [m.name for m in metas] == list(w)
    assert metas[1].shape == (16, 32) and metas[1].dtype == "bfloat16"
