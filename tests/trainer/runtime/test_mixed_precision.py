"""`dtype: bfloat16` is bf16 compute over fp32 master weights and optimizer state; FSDP2 reduces
gradients once per optimizer step; activation checkpointing recomputes the blocks. On CPU, real
workers on the tiny model."""

from __future__ import annotations

import pytest
import torch

from .precision_ranks import batch, full_weights, run_ranks, spec_for, train_once


def _changed(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> int:
    return sum(int((before[k] != after[k]).sum()) for k in before)


def _actor(tiny_model, dtype: str, lr: float = 1e-6, micro: int = 4, checkpointing: bool = False):
    from rlhf_trainer.workers import ActorWorker

    worker = ActorWorker(spec_for(tiny_model, dtype, lr, micro, checkpointing), device="cpu")
    worker.setup()
    return worker


def test_pure_bf16_adamw_rounds_rl_sized_updates_away():
    """Why fp32 master weights: the old pure-bf16 path moved no weight at lr 1e-6."""
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(1000).to(torch.bfloat16))
    before = w.detach().clone()
    opt = torch.optim.AdamW([w], lr=1e-6, weight_decay=0.0)
    for _ in range(100):
        w.grad = torch.randn_like(w)
        opt.step()
    assert int((w.detach() != before).sum()) == 0


def test_bf16_one_rank_keeps_fp32_master_weights_and_changes_them_at_lr_1e_6(tiny_model):
    worker = _actor(tiny_model, "bfloat16")
    assert {p.dtype for p in worker.model.parameters()} == {torch.float32}
    before = full_weights(worker)
    after = train_once(worker, batch(worker.model.config.vocab_size))
    changed = _changed(before, after)
    total = sum(v.numel() for v in before.values())
    assert changed > total // 2, f"only {changed} of {total} weights changed at lr 1e-6"
    moments = {v.dtype for s in worker.optimizer.state.values() for v in s.values() if v.dim() > 0}
    assert moments == {torch.float32}


def test_bf16_one_rank_computes_in_bf16(tiny_model):
    """The forward runs under bf16 autocast: its logits are bf16, the weights stay fp32."""
    worker = _actor(tiny_model, "bfloat16")
    rows = batch(worker.model.config.vocab_size)
    ids = torch.cat([rows["prompt_ids"], rows["response_ids"]], 1)
    with worker.compute():
        assert worker.model(input_ids=ids).logits.dtype == torch.bfloat16
    fp32 = _actor(tiny_model, "float32")
    with fp32.compute():
        assert fp32.model(input_ids=ids).logits.dtype == torch.float32


def test_activation_checkpointing_recomputes_blocks_and_keeps_the_gradient(tiny_model):
    """With the option on, each decoder block's layers run forward twice per micro-batch (once
    again in backward); the update is the same as without it, and the parameter names too."""
    results = {}
    for on in (False, True):
        worker = _actor(tiny_model, "float32", lr=1e-3, micro=8, checkpointing=on)
        blocks = [m for m in worker.model.modules() if type(m).__name__ in worker.model._no_split_modules]
        calls = [0]
        layer = next(m for m in blocks[0].modules() if isinstance(m, torch.nn.Linear))
        layer.register_forward_hook(lambda *_, c=calls: c.__setitem__(0, c[0] + 1))
        results[on] = (train_once(worker, batch(worker.model.config.vocab_size)), calls[0])
    assert results[False][1] == 1 and results[True][1] == 2
    assert results[True][0].keys() == results[False][0].keys()
    for k, v in results[False][0].items():
        torch.testing.assert_close(results[True][0][k], v, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_fsdp2_bf16_two_ranks_fp32_shards_one_reduction_per_step(tiny_model, tmp_path):
    """Two gloo ranks, FSDP2 with MixedPrecisionPolicy(bf16, fp32 reduce), 2 micro-batches per
    rank: shards and AdamW state stay fp32, the weights move at lr 1e-6, and the gradients are
    reduce-scattered only in the last micro-batch's backward (once per FSDP module), with the same
    result as one micro-batch per rank."""
    two = run_ranks(tiny_model, "bfloat16", micro=2, out=tmp_path / "two.pt")
    one = run_ranks(tiny_model, "bfloat16", micro=4, out=tmp_path / "one.pt")
    assert {d for d, _ in two["sharded"].values()} == {torch.float32}
    assert {kind for _, kind in two["sharded"].values()} == {"DTensor"}
    assert two["optim_dtypes"] == ["torch.float32"]
    assert _changed(two["before"], two["after"]) > 0
    assert two["reduce_scatters"] == two["fsdp_modules"] == one["reduce_scatters"]
    for k, v in one["after"].items():
        torch.testing.assert_close(two["after"][k], v, rtol=0, atol=2e-6)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_quickstart_learns_in_bf16(tiny_model, ray_session, tmp_path):
    """The quickstart's job (GRPO, exact-answer reward, its learning rate and batch) with
    `dtype: bfloat16`: bf16 compute over fp32 master weights still raises the reward."""
    import dataclasses
    from pathlib import Path

    from rlhf_api.loader import load_manifest
    from rlhf_trainer.controller import run

    from .conftest import PROMPTS, read_metrics

    examples = Path(__file__).resolve().parents[3] / "manifests" / "examples"
    job = load_manifest(examples / "quickstart.yaml")
    spec = job.spec
    spec = dataclasses.replace(
        spec,
        model=dataclasses.replace(spec.model, path=str(tiny_model), dtype="bfloat16"),
        data=dataclasses.replace(spec.data, path=str(PROMPTS)),
        training=dataclasses.replace(spec.training, steps=24),
        checkpoint=dataclasses.replace(spec.checkpoint, every=0),
        output=dataclasses.replace(spec.output, progress=False, report=False),
    )
    run(dataclasses.replace(job, spec=spec), run_dir=tmp_path)
    rows = read_metrics(tmp_path)
    first = sum(r["reward/mean"] for r in rows[:4]) / 4
    last = sum(r["reward/mean"] for r in rows[-4:]) / 4
    assert last > first + 0.1, [round(r["reward/mean"], 3) for r in rows]


def test_the_checkpoints_config_names_the_compute_dtype(tiny_model, tmp_path):
    """The actor trains fp32 master weights; its checkpoint's config.json still says bfloat16, the
    dtype `rlhf export --dtype auto` writes."""
    import json

    worker = _actor(tiny_model, "bfloat16")
    worker.write_model_files(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert (config.get("dtype") or config.get("torch_dtype")) == "bfloat16"
    assert worker.model.config.dtype == torch.float32 or worker.model.dtype == torch.float32
