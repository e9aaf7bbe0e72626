"""The benchmarks' jobs stay valid manifests of this checkout (a renamed spec field would break
them silently: they are not run by the suite), and their argument errors name the flag."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def _ppo_module() -> Any:
    sys.path.insert(0, str(BENCH))
    try:
        import ppo_vs_before
    finally:
        sys.path.remove(str(BENCH))
    return ppo_vs_before


def test_the_ppo_benchmark_job_is_a_valid_ppo_job_with_a_critic_trained_twice_per_batch(
    tmp_path: Path,
) -> None:
    from rlhf_api.loader import parse_job

    bench = _ppo_module()
    a = argparse.Namespace(group=8, prompts=8, max_new_tokens=4, steps=8, lr=3e-4)
    job = parse_job(bench.job_document(tmp_path / "model", tmp_path / "prompts.jsonl", a))
    assert job.spec.algorithm.name == "ppo"
    assert job.spec.roles.critic.replicas == 1 and job.spec.roles.reference.replicas == 1
    assert job.spec.training.epochs_per_batch == 2
    assert job.spec.training.mini_batch_size == 64  # one mini-batch: the old-log-prob pass is needed twice


@pytest.mark.parametrize(
    "args, named",
    [
        ([], "--before"),
        (["--before", "/nonexistent"], "--before /nonexistent"),
        (["--before", str(BENCH.parent)], "--steps"),
    ],
)
def test_the_ppo_benchmark_refuses_bad_arguments_naming_them(args: list[str], named: str) -> None:
    extra = ["--steps", "2", "--warmup", "2"] if named == "--steps" else []
    res = subprocess.run(
        [sys.executable, str(BENCH / "ppo_vs_before.py"), *args, *extra],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 2, res.stderr
    assert named in res.stderr, res.stderr


def _vs_trl() -> Any:
    sys.path.insert(0, str(BENCH))
    try:
        import vs_trl
    finally:
        sys.path.remove(str(BENCH))
    return vs_trl


@pytest.mark.parametrize("budget", [4, 64])
def test_the_trl_benchmark_job_is_a_valid_grpo_job_for_each_response_budget(
    tmp_path: Path, budget: int
) -> None:
    bench = _vs_trl()
    a = argparse.Namespace(group=8, prompts=8, max_new_tokens=budget, steps=10, lr=1e-3)
    job = bench.project_job(tmp_path / "model", tmp_path / "prompts.jsonl", a)
    assert job.spec.algorithm.name == "grpo"
    assert (job.spec.rollout.samples_per_prompt, job.spec.rollout.max_new_tokens) == (8, budget)
    assert job.spec.training.micro_batch_size == 64


@pytest.mark.parametrize("width", [1, 5])
def test_the_computed_once_floor_scores_as_the_full_forward(width: int) -> None:
    """`floor-once` computes each prompt once (prefix pass, cache repeated to the group, suffix
    pass): the same log-probs and gradients as one forward over every row, in fp32."""
    import torch

    from rlhf_trainer.rollout.hf import HFRolloutEngine
    from rlhf_trainer.tiny_model import build_char_tokenizer, build_tiny_model

    bench = _vs_trl()
    tok = build_char_tokenizer()
    model = build_tiny_model(tok, hidden_size=32, seed=0)
    engine = HFRolloutEngine(model, tok, max_new_tokens=width, seed=0)
    out = engine.generate([tok(t).input_ids for t in ["1+2=", "13+4=", "7"]], n=3)
    model.train()
    grads = []
    for score in (bench.full_log_probs, lambda m, o: bench.prompt_once_log_probs(m, o, 3)):
        model.zero_grad()
        logp = score(model, out)
        (logp * out.response_mask).sum().backward()
        grads.append((logp.detach(), [p.grad.clone() for p in model.parameters()]))
    (full, full_grads), (once, once_grads) = grads
    mask = out.response_mask.bool()
    assert full.shape == once.shape == out.response_ids.shape
    torch.testing.assert_close(once[mask], full[mask], atol=1e-5, rtol=1e-5)
    for g_once, g_full in zip(once_grads, full_grads):
        torch.testing.assert_close(g_once, g_full, atol=1e-5, rtol=1e-4)
    # The sampled log-probs are the engine's: the floor scores what it sampled.
    torch.testing.assert_close(once[mask], out.log_probs[mask], atol=1e-5, rtol=1e-5)


def test_the_trl_benchmark_tells_a_busy_machine_from_a_quiet_one() -> None:
    bench = _vs_trl()
    quiet = {"load": (0.3, 0.2, 0.1), "busy": 0.05, "cpus": 2}
    assert bench.busy_reason(quiet, 0.15) is None
    assert "40% of the CPUs busy" in str(bench.busy_reason(quiet | {"busy": 0.4}, 0.15))
    assert "load average 3.50 over 2 CPUs" in str(
        bench.busy_reason({"load": (3.5, 1, 1), "busy": None, "cpus": 2}, 0.15)
    )


def test_the_trl_benchmark_refuses_a_busy_machine_unless_allowed(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    bench = _vs_trl()
    monkeypatch.setattr(bench, "machine_state", lambda: {"load": (1.9, 1, 1), "busy": 0.8, "cpus": 2})
    with pytest.raises(SystemExit) as refused:
        bench.main(["--contenders", "floor", "--steps", "2", "--warmup", "1"])
    assert refused.value.code == 3
    err = capsys.readouterr().err
    assert "80% of the CPUs busy" in err and "--allow-busy" in err


@pytest.mark.parametrize(
    "args, named",
    [
        (["--new-tokens", "4,x"], "--new-tokens 4,x"),
        (["--new-tokens", "0"], "--new-tokens 0"),
        (["--contenders", "project,vllm"], "--contenders project,vllm"),
        (["--sizes", "7b"], "--sizes 7b"),
        (["--alternations", "0"], "--alternations 0"),
        (["--steps", "2", "--warmup", "2"], "--steps"),
    ],
)
def test_the_trl_benchmark_refuses_bad_arguments_naming_them(args: list[str], named: str) -> None:
    res = subprocess.run(
        [sys.executable, str(BENCH / "vs_trl.py"), "--contenders", "floor", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 2, res.stderr
    assert named in res.stderr, res.stderr
