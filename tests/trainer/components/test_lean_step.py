"""The lean training step computes the same thing as the full one: the skipped old-log-prob
pass, the response-only LM head and the chunked log-prob/entropy give the loss and gradients
the long way gives. Real `ActorWorker`s over a tiny saved Llama, in-process (one rank)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from rlhf_trainer.algorithms import build_algorithm


def _spec(model: Path, params: dict[str, Any], **training: Any) -> Any:
    from rlhf_api.loader import parse_spec

    return parse_spec(
        {
            "model": {"path": str(model)},
            "data": {"path": "unused.jsonl"},
            "reward": {"functions": [{"path": "r:f"}]},
            "algorithm": {"name": "grpo", "params": params},
            "rollout": {"samplesPerPrompt": 4, "maxNewTokens": 4, "temperature": 0.7},
            "training": {"promptsPerStep": 2, "microBatchSize": 8, "learningRate": 1e-3, **training},
        }
    )


def _batch(vocab: int, rows: int = 8, p: int = 5, t: int = 4, seed: int = 0) -> dict[str, torch.Tensor]:
    """Left-padded prompts of different lengths, responses with right padding (one empty row)."""
    g = torch.Generator().manual_seed(seed)
    prompt_mask = torch.ones(rows, p, dtype=torch.long)
    response_mask = torch.ones(rows, t)
    for r in range(rows):
        prompt_mask[r, : r % 3] = 0  # (B, P): left padding
        response_mask[r, t - (r % t) :] = 0.0  # (B, T): right padding
    response_mask[-1] = 0.0
    return {
        "prompt_ids": torch.randint(3, vocab, (rows, p), generator=g) * prompt_mask,
        "prompt_mask": prompt_mask,
        "response_ids": torch.randint(3, vocab, (rows, t), generator=g),
        "response_mask": response_mask,
        "advantages": torch.randn(rows, t, generator=g) * response_mask,
        "ref_log_probs": -torch.rand(rows, t, generator=g) * response_mask,
        "group_index": torch.arange(rows) // 4,
        "scores": torch.rand(rows, generator=g),
    }


def _actor(model: Path, params: dict[str, Any]) -> Any:
    from rlhf_trainer.workers import ActorWorker

    worker = ActorWorker(_spec(model, params), device="cpu")
    worker.setup()
    return worker


def _loss_and_grads(worker: Any, batch: dict[str, Any], params: dict[str, Any]) -> tuple[dict, list]:
    from rlhf_trainer.workers.training import UpdateBranch, step_normalizers

    worker.model.zero_grad(set_to_none=True)
    worker.model.train()
    algo = build_algorithm("grpo", params)
    branch = UpdateBranch("grpo", algo.params.as_dict(), algo.state_dict())
    norms = step_normalizers(batch, torch.arange(len(batch["response_mask"])), 1)
    out = worker.micro_loss({**batch, **norms}, [branch], [algo])
    out["loss"].backward()
    grads = [p.grad.detach().clone() for p in worker.model.parameters()]
    return out, grads


@pytest.mark.parametrize(
    "params",
    [
        {"klCoef": 0.0},
        {"klCoef": 0.05, "klInReward": False, "entropyCoef": 0.01},  # KL and entropy in the loss
        {"klCoef": 0.0, "clipRatioLow": 3e-4, "clipRatioHigh": 4e-4, "policyLoss": "gspo"},
    ],
)
def test_skipped_old_log_prob_pass_gives_the_same_loss_and_gradients(tiny_lm_dir, params):
    """One epoch, one mini-batch: the update's detached log-probs (the skip) and those of a
    separate no-grad pass over the same weights (`compute_log_probs`, what the skipped phase
    runs) give the same loss, metrics and gradients."""
    from rlhf_trainer.workers.base import stitch

    worker = _actor(tiny_lm_dir, params)
    batch = _batch(worker.model.config.vocab_size)
    rows, values = worker.compute_log_probs(batch)
    computed = stitch([(rows, values)], len(batch["response_mask"])) * batch["response_mask"]

    with_pass, grads_with = _loss_and_grads(worker, {**batch, "old_log_probs": computed}, params)
    skipped, grads_skipped = _loss_and_grads(worker, batch, params)

    torch.testing.assert_close(skipped["loss"], with_pass["loss"], rtol=1e-5, atol=1e-6)
    for a, b in zip(grads_skipped, grads_with):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    assert any(float(g.abs().sum()) > 0 for g in grads_skipped), "no gradient at all: nothing compared"
    for key, value in with_pass.items():
        if isinstance(value, float):
            assert skipped[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key


def test_a_wrong_old_log_prob_changes_the_gradients(tiny_lm_dir):
    """The comparison above can fail: old log-probs off by a little (a stale policy) change them."""
    params = {"klCoef": 0.0, "clipRatioLow": 0.01, "clipRatioHigh": 0.01}
    worker = _actor(tiny_lm_dir, params)
    batch = _batch(worker.model.config.vocab_size)
    _, exact = _loss_and_grads(worker, batch, params)
    off = {**batch, "old_log_probs": torch.full_like(batch["response_mask"], -3.0) * batch["response_mask"]}
    _, stale = _loss_and_grads(worker, off, params)
    assert any(not torch.allclose(a, b, rtol=1e-3, atol=1e-6) for a, b in zip(exact, stale))


def _ctx(correction: bool = False, **training: Any) -> Any:
    t = {"epochs_per_batch": 1, "mini_batch_size": 0, **training}
    algorithm = SimpleNamespace(rollout_correction=SimpleNamespace(enabled=correction))
    return SimpleNamespace(spec=SimpleNamespace(training=SimpleNamespace(**t), algorithm=algorithm))


@pytest.mark.parametrize(
    ("training", "name", "params", "needed"),
    [
        ({}, "grpo", {"klCoef": 0.0}, False),
        ({}, "grpo", {"klCoef": 0.05, "klInReward": False}, False),  # KL as a loss: ratio still 1
        ({}, "grpo", {"klCoef": 0.05, "klInReward": True}, True),  # the advantage reads them
        ({}, "online_dpo", {}, False),
        ({"epochs_per_batch": 2}, "grpo", {"klCoef": 0.0}, True),
        ({"mini_batch_size": 4}, "grpo", {"klCoef": 0.0}, True),
        ({"mini_batch_size": 8}, "grpo", {"klCoef": 0.0}, False),  # one mini-batch of all 8 rows
        # spec.algorithm.rolloutCorrection weighs the trainer's log-probs against the engine's
        ({"correction": True}, "grpo", {"klCoef": 0.0}, True),
    ],
)
def test_when_the_old_log_prob_pass_runs(training, name, params, needed):
    from rlhf_trainer.dataflow.phases import old_log_probs_needed

    assert old_log_probs_needed(_ctx(**training), 8, build_algorithm(name, params)) is needed


def test_user_algorithms_with_a_reference_keep_the_pass():
    """An algorithm that does not say what its advantages read keeps the conservative answer."""
    from rlhf_trainer.algorithms import Algorithm
    from rlhf_trainer.dataflow.phases import old_log_probs_needed

    class Mine(Algorithm):
        needs_reference = True

        def compute_advantages(self, batch: Any) -> Any:
            return batch

        def compute_loss(self, batch: Any) -> Any:
            return {}

    assert old_log_probs_needed(_ctx(), 8, Mine()) is True
    assert Mine().needs_entropy is True


def test_response_logits_and_chunked_log_probs_match_the_full_forward(tiny_lm_dir):
    """The LM head sees only the T + 1 last positions, and log-probs, entropy and their
    gradients equal a log-softmax over the full forward's logits."""
    from rlhf_trainer.workers import modeling

    worker = _actor(tiny_lm_dir, {"klCoef": 0.0})
    model = worker.model
    batch = _batch(model.config.vocab_size)
    p, t = batch["prompt_ids"].shape[1], batch["response_ids"].shape[1]
    seen: list[int] = []
    hook = model.lm_head.register_forward_hook(lambda m, args, out: seen.append(args[0].shape[1]))
    try:
        logp, entropy = modeling.token_log_probs(model, batch, 0.7, with_entropy=True)
    finally:
        hook.remove()
    assert seen == [t + 1], f"the LM head ran on {seen} positions, not the {t + 1} that predict the response"
    assert entropy is not None
    (logp.sum() + entropy.sum()).backward()
    lean = [q.grad.clone() for q in model.parameters()]
    model.zero_grad(set_to_none=True)

    ids, mask, pos, _ = modeling.sequence_inputs(batch)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits[:, p - 1 : p + t - 1] / 0.7
    full = torch.log_softmax(logits, -1)  # (B, T, V)
    ref_logp = full.gather(-1, batch["response_ids"][..., None]).squeeze(-1)
    ref_entropy = -(full.exp() * full).sum(-1)
    (ref_logp.sum() + ref_entropy.sum()).backward()
    torch.testing.assert_close(logp, ref_logp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(entropy, ref_entropy, rtol=1e-5, atol=1e-5)
    for a, b in zip(lean, (q.grad for q in model.parameters())):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(("coef", "computed"), [(0.0, False), (0.01, True)])
def test_entropy_is_computed_only_when_the_loss_reads_it(tiny_lm_dir, monkeypatch, coef, computed):
    from rlhf_trainer.algorithms import entropy as entropy_module

    calls: list[int] = []
    real = entropy_module.entropy_from_logits

    def spy(logits: torch.Tensor, **kw: Any) -> torch.Tensor:
        calls.append(1)
        return real(logits, **kw)

    monkeypatch.setattr(entropy_module, "entropy_from_logits", spy)
    params = {"klCoef": 0.0, "entropyCoef": coef}
    worker = _actor(tiny_lm_dir, params)
    out, _ = _loss_and_grads(worker, _batch(worker.model.config.vocab_size), params)
    assert bool(calls) is computed
    assert ("actor/entropy" in out) is computed
