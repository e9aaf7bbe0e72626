"""The resource planner (`rlhf_trainer.planner`): the shapes that cannot start are refused naming
the role, the figure and the limit; GPUs paid for and never used are warned about; every shipped
example passes it (with the public configs of its models as fixtures); its estimates match what
a real model measures on the CPU."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from rlhf_api.loader import parse_job, read_manifest
from rlhf_trainer import planner
from rlhf_trainer.planner import GIB, MIB, ModelShape, plan_job

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "manifests" / "examples").glob("*.yaml"))
#: config.json of the examples' models (their public model cards' numbers), by directory name.
CONFIGS = Path(__file__).resolve().parent / "planner_configs"
PROBE = Path(__file__).resolve().parent / "planner_probe.py"


def fixture_shape(path: str) -> ModelShape | None:
    f = CONFIGS / f"{Path(path).name}.json"
    return ModelShape.from_config(json.loads(f.read_text()), str(f)) if f.is_file() else None


def example(name: str) -> dict[str, Any]:
    return read_manifest(ROOT / "manifests" / "examples" / f"{name}.yaml")


def plan(doc: dict[str, Any], **kw: Any) -> planner.Plan:
    return plan_job(parse_job(copy.deepcopy(doc)).spec, shape_of=kw.pop("shape_of", fixture_shape), **kw)


def set_(doc: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    obj = doc
    *head, last = path.split(".")
    for key in head:
        obj = obj.setdefault(key, {})
    obj[last] = value
    return doc


def one(lines: list[str], *needles: str) -> str:
    found = [line for line in lines if all(n in line for n in needles)]
    assert len(found) == 1, f"want one line with {needles}, got: {lines}"
    return found[0]


# -- every example fits its own hardware ------------------------------------------------------


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_every_example_passes_the_planner_with_its_models_configs(path: Path) -> None:
    doc = read_manifest(path)
    result = plan(doc)
    assert result.errors == [], result.errors
    assert result.warnings == [], result.warnings
    gpu_roles = [
        r
        for r, s in doc["spec"].get("roles", {}).items()
        if isinstance(s, dict) and s.get("resources", {}).get("gpus")
    ]
    if gpu_roles:  # a GPU example is really planned: a fixture config and a known GPU for each role
        assert result.notes == [], result.notes
        assert {e.role for e in result.estimates} >= set(gpu_roles) - {"reward"} or result.estimates
        assert all(e.gpu is not None and e.total <= e.gpu.memory for e in result.estimates), result.table()
    else:  # CPU-only local jobs: the planner says nothing
        assert result == planner.Plan()


def test_the_gpu_examples_name_models_the_fixtures_hold() -> None:
    """Without its fixture an example would only be shape-checked: keep the two in step."""
    for name in ("grpo-h100", "grpo-pvc", "ppo-two-pools", "grpo-7b-8xh100"):
        spec = parse_job(example(name)).spec
        assert fixture_shape(spec.model.path) is not None, spec.model.path
        if spec.reward.model is not None:
            assert fixture_shape(spec.reward.model.path) is not None


def test_the_fixture_configs_have_their_models_published_sizes() -> None:
    """Qwen2.5-7B: 7.62B parameters; Llama-3.1-8B: 8.03B (their model cards)."""
    assert fixture_shape("Qwen2.5-7B-Instruct").params() == pytest.approx(7.62e9, rel=0.005)
    assert fixture_shape("Llama-3.1-8B-Instruct").params() == pytest.approx(8.03e9, rel=0.005)
    assert fixture_shape("Llama-3.1-8B-Instruct").kv_bytes_per_token(2) == 128 * 1024


# -- refusals (item 7 of issue 19) ---------------------------------------------------------


def _colocated_8xh100(**changes: Any) -> dict[str, Any]:
    doc = example("grpo-7b-8xh100")
    for path, value in changes.items():
        set_(doc, path, value)
    return doc


def test_colocated_vllm_with_tensor_parallelism_is_refused() -> None:
    result = plan(_colocated_8xh100(**{"spec.rollout.tensorParallelSize": 2}))
    line = one(result.errors, "spec.rollout.tensorParallelSize: 2")
    assert "colocated" in line and "one GPU" in line and "valid: 1" in line


def test_shape_checks_run_without_a_model_config() -> None:
    result = plan(_colocated_8xh100(**{"spec.rollout.tensorParallelSize": 4}), shape_of=lambda path: None)
    one(result.errors, "spec.rollout.tensorParallelSize: 4", "colocated")
    one(result.notes, "spec.model.path", "not available locally; memory not checked")
    assert result.estimates == []


def _ppo_l4(**changes: Any) -> dict[str, Any]:
    doc = example("ppo-two-pools")
    for path, value in changes.items():
        set_(doc, path, value)
    return doc


def test_an_8b_engine_whose_weights_exceed_its_fraction_of_an_l4_is_refused() -> None:
    """8B in bf16 is 15 GiB; 0.5 of an L4 (22.5 GiB) is 11.2 GiB."""
    doc = _ppo_l4(**{"spec.rollout.tensorParallelSize": 1, "spec.rollout.gpuMemoryUtilization": 0.5})
    doc["spec"]["roles"]["rollout"]["resources"]["gpus"] = 1
    line = one(plan(doc).errors, "spec.rollout (vLLM on spec.roles.rollout's NVIDIA-L4 (22.5 GiB))")
    assert "the weights need 15.0 GiB per GPU at tensorParallelSize 1" in line
    assert "gpuMemoryUtilization 0.5 x 22.5 GiB = 11.2 GiB" in line


def test_an_8b_engine_at_half_an_l4_with_a_131k_context_is_refused_for_its_kv_cache() -> None:
    """Weights fit at TP 2 (7.5 GiB of 11.2), but one sequence of 131072 tokens needs 8 GiB of KV
    per GPU (128 KiB per token, halved by TP 2)."""
    doc = _ppo_l4(**{"spec.rollout.gpuMemoryUtilization": 0.5, "spec.rollout.maxModelLength": 131072})
    line = one(plan(doc).errors, "maxModelLength 131072")
    assert "needs 8.0 GiB of KV cache per GPU for one sequence (64 KiB per token)" in line
    assert "gpuMemoryUtilization 0.5 x 22.5 GiB = 11.2 GiB leaves" in line
    fits = int(line.split("rollout.maxModelLength <= ")[1].split(",")[0])
    assert 1536 < fits < 131072
    # ... and the same job at the default length (maxPromptLength + maxNewTokens) fits.
    assert plan(_ppo_l4(**{"spec.rollout.gpuMemoryUtilization": 0.5})).errors == []


def test_a_reward_model_in_float32_on_an_l4_is_refused() -> None:
    """The reward model follows model.dtype; in float32 an 8B classifier is 28 GiB."""
    doc = _ppo_l4(**{"spec.reward.model.dtype": "float32"})
    line = one(plan(doc).errors, "spec.roles.reward: the reward model in float32")
    assert "(28.0 GiB of weights)" in line and "22.5 GiB of its NVIDIA-L4" in line
    assert "reward.model.dtype bfloat16" in line
    assert plan(_ppo_l4(**{"spec.reward.model.dtype": "bfloat16"})).errors == []


def test_a_colocated_engine_that_leaves_no_room_for_the_actor_is_refused() -> None:
    line = one(
        plan(_colocated_8xh100(**{"spec.rollout.gpuMemoryUtilization": 0.9})).errors, "spec.roles.actor"
    )
    assert "gpuMemoryUtilization 0.9 x 79.6 GiB = 71.7 GiB" in line and "79.6 GiB" in line


def test_training_state_that_does_not_fit_is_refused() -> None:
    """7.6B parameters x 16 bytes on one GPU: 113 GiB of fp32 weights, gradients and moments."""
    doc = example("grpo-h100")
    doc["spec"]["roles"]["actor"] = {"replicas": 1, "nodePool": "h100", "resources": {"gpus": 1}}
    line = one(plan(doc).errors, "spec.roles.actor")
    assert "sharded over 1 GPU(s)" in line and "NVIDIA-H100-80GB-HBM3" in line
    lora = set_(copy.deepcopy(doc), "spec.model.lora", {"rank": 16})
    assert not [e for e in plan(lora).errors if "spec.roles.actor" in e]


def test_a_tensor_parallel_size_that_does_not_divide_the_heads_is_refused() -> None:
    """Qwen2.5-7B has 28 attention heads and 4 key/value heads: TP 8 divides neither."""
    doc = example("grpo-h100")
    doc["spec"]["rollout"]["tensorParallelSize"] = 8
    doc["spec"]["roles"]["rollout"]["resources"]["gpus"] = 8
    one(plan(doc).errors, "tensorParallelSize: 8 does not divide the model's 28 attention heads")


# -- warnings: GPUs paid for and never used --------------------------------------------------


def test_rollout_pods_with_more_gpus_than_the_engine_uses_are_warned_about() -> None:
    doc = example("grpo-h100")
    doc["spec"]["rollout"]["tensorParallelSize"] = 1
    result = plan(doc)
    line = one(result.warnings, "spec.roles.rollout.resources.gpus: 4")
    assert "tensorParallelSize 1 uses 1: 3 idle" in line
    assert result.errors == []


def test_a_tensor_parallel_size_that_leaves_gpus_idle_is_warned_about() -> None:
    doc = example("grpo-h100")
    doc["spec"]["rollout"]["tensorParallelSize"] = 2
    one(plan(doc).warnings, "4 GPUs per rollout pod", "uses 2: 2 idle")


def test_reward_gpus_without_a_reward_model_are_warned_about() -> None:
    doc = example("grpo-h100")
    doc["spec"]["roles"]["reward"] = {"replicas": 1, "nodePool": "l4", "resources": {"gpus": 1}}
    one(plan(doc).warnings, "spec.roles.reward.resources.gpus: 1", "no reward model")


# -- where the GPU and the config come from ----------------------------------------------------


def test_known_gpus_by_their_product_label() -> None:
    gpu = planner.known_gpu_memory
    assert gpu("NVIDIA-H100-80GB-HBM3") == 81559 * MIB
    assert gpu("NVIDIA-H200") == 143771 * MIB
    assert gpu("NVIDIA-A100-SXM4-40GB") == 40960 * MIB and gpu("NVIDIA-A100-80GB-PCIe") == 81920 * MIB
    assert gpu("NVIDIA-L4") == 23034 * MIB and gpu("NVIDIA-L40S") == 46068 * MIB
    assert gpu("NVIDIA-A10G") == 23028 * MIB
    assert gpu("NVIDIA-A100-PCIE") is None  # which A100: unknown, not guessed
    assert gpu("Tesla-T4") is None


def test_node_labels_and_gpu_memory_give_a_pools_gpu() -> None:
    doc = example("grpo-h100")
    for pool in doc["spec"]["nodePools"]:
        pool.pop("gpuProduct", None)
    nodes = [
        {
            "metadata": {
                "labels": {
                    "rlhf.dev/pool": "h100",
                    "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3",
                    "nvidia.com/gpu.memory": "81559",
                }
            }
        },
        {"metadata": {"labels": {"rlhf.dev/pool": "l4", "nvidia.com/gpu.product": "NVIDIA-L4"}}},
    ]
    result = plan(doc, nodes=nodes)
    assert result.notes == [] and result.errors == []
    gpus = {e.role: e.gpu for e in result.estimates}
    assert gpus["actor"].memory == 81559 * MIB and "label nvidia.com/gpu.memory" in gpus["actor"].source
    assert gpus["rollout"].memory == 23034 * MIB and gpus["rollout"].source == "known memory of NVIDIA-L4"
    unknown = plan(doc)
    one(unknown.notes, "spec.roles.rollout", "node pool 'l4' is unknown")
    doc["spec"]["nodePools"][1]["gpuMemory"] = "16Gi"  # the manifest's figure wins over the known one
    small = plan(doc)
    assert {e.role: e.gpu for e in small.estimates}["rollout"].memory == 16 * GIB


def test_a_hub_id_is_read_from_the_local_hub_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    snap = tmp_path / "hub" / "models--Qwen--Qwen2.5-7B-Instruct" / "snapshots" / "abc123"
    snap.mkdir(parents=True)
    (snap / "config.json").write_text((CONFIGS / "Qwen2.5-7B-Instruct.json").read_text())
    (snap.parent.parent / "refs").mkdir()
    (snap.parent.parent / "refs" / "main").write_text("abc123")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "hub"))  # its owner
    shape = planner.local_shape("Qwen/Qwen2.5-7B-Instruct")
    assert shape is not None and shape.heads == 28 and shape.source == str(snap / "config.json")
    assert planner.local_shape("Qwen/not-cached") is None
    assert planner.local_shape("/no/such/dir") is None


def test_rlhf_validate_refuses_with_the_planners_errors(tmp_path: Path) -> None:
    """The CLI: refusals are errors of `rlhf validate` (exit 1), warnings printed, `--plan`
    prints the table; a local model directory's config.json is read."""
    model = tmp_path / "Llama-3.1-8B-Instruct"
    model.mkdir()
    (model / "config.json").write_text((CONFIGS / "Llama-3.1-8B-Instruct.json").read_text())
    doc = _ppo_l4(**{"spec.model.path": str(model), "spec.rollout.maxModelLength": 131072})
    doc["spec"]["rollout"]["gpuMemoryUtilization"] = 0.5
    manifest = tmp_path / "job.yaml"
    manifest.write_text(yaml.safe_dump(doc))
    run = [sys.executable, "-m", "rlhf_trainer.cli", "validate", "--plan", str(manifest)]
    done = subprocess.run(run, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stderr
    assert (
        f"{manifest}: does not fit its GPUs\n  - spec.rollout (vLLM on spec.roles.rollout's NVIDIA-L4"
        in done.stderr
    )
    assert "maxModelLength 131072 needs 8.0 GiB of KV cache" in done.stderr
    assert (
        "spec.reward.model.path: model config of /models/Skywork-Reward-Llama-3.1-8B not available"
        in done.stderr
    )
    assert f"{manifest}: memory per GPU\n  actor" in done.stdout


# -- estimates against measured memory -----------------------------------------------------------


def _probe(
    tmp_path: Path, hidden: int, layers: int, heads: int, batch: int, seq: int
) -> tuple[dict[str, int], ModelShape]:
    out = tmp_path / "model"
    done = subprocess.run(
        [sys.executable, str(PROBE), str(hidden), str(layers), str(heads), str(batch), str(seq), str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr
    measured = json.loads(done.stdout.strip().splitlines()[-1])
    return measured, ModelShape.from_config(json.loads((out / "config.json").read_text()))


def _fp32_parts(shape: ModelShape, batch: int, seq: int) -> dict[str, int]:
    return planner.training_parts(shape, world=1, compute="float32", tokens=batch * seq, checkpointing=False)


#: The planner's resident figure (weights + gradients + AdamW state) against the tensors a real
#: model holds after its optimizer steps, and its whole estimate against the process's peak.
STATE_TOLERANCE = 0.15
PEAK_TOLERANCE = 0.15


def test_state_estimate_matches_the_tiny_model(tmp_path: Path) -> None:
    """The tiny-arithmetic shape (hidden 64, 2 layers): parameters counted exactly from its config,
    weights + gradients + AdamW moments within 15% of the bytes the tensors hold."""
    import torch

    from rlhf_trainer.tiny_model import build_char_tokenizer, build_tiny_model

    tok = build_char_tokenizer()
    model = build_tiny_model(tok)
    model.config.save_pretrained(tmp_path)
    shape = ModelShape.from_config(json.loads((tmp_path / "config.json").read_text()))
    assert shape.params() == sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(input_ids=torch.randint(0, len(tok), (2, 16)), use_cache=False).logits.mean().backward()
    opt.step()
    measured = sum(p.numel() * p.element_size() * 2 for p in model.parameters())  # weights, grads
    measured += sum(
        t.numel() * t.element_size() for s in opt.state.values() for t in s.values() if t.dim() > 0
    )
    parts = _fp32_parts(shape, 2, 16)
    estimate = parts["weights"] + parts["grads"] + parts["optimizer"]
    assert estimate == pytest.approx(measured, rel=STATE_TOLERANCE)


@pytest.mark.slow
def test_estimates_match_the_measured_peak_of_a_30m_model(tmp_path: Path) -> None:
    """A ~30M Llama (hidden 512, 7 layers, as benchmarks/vs_trl.py's `30m`), micro-batch 4 x 128
    tokens, two fp32 AdamW steps in a process of its own: the state within 15% of the tracked
    tensors, the whole estimate within 15% of the peak growth of the resident set."""
    measured, shape = _probe(tmp_path, 512, 7, 8, 4, 128)
    assert shape.params() == measured["params"]
    parts = _fp32_parts(shape, 4, 128)
    state = parts["weights"] + parts["grads"] + parts["optimizer"]
    assert state == pytest.approx(measured["state"], rel=STATE_TOLERANCE)
    assert sum(parts.values()) == pytest.approx(measured["peak"], rel=PEAK_TOLERANCE), (parts, measured)


def test_rlhf_run_refuses_what_cannot_start_before_starting_anything(tmp_path: Path, capsys: Any) -> None:
    from rlhf_trainer.cli import main

    manifest = tmp_path / "job.yaml"
    manifest.write_text(yaml.safe_dump(_colocated_8xh100(**{"spec.rollout.tensorParallelSize": 2})))
    assert main(["run", str(manifest)]) == 2
    err = capsys.readouterr().err
    assert (
        f"{manifest}: does not fit its GPUs\n  - spec.rollout.tensorParallelSize: 2 with placement colocated"
        in err
    )


def test_the_planner_runs_without_torch() -> None:
    """`rlhf validate` runs where only the API's dependencies are installed (the operator image)."""
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('torch', 'transformers', 'ray'):\n"
        "            raise ImportError(name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "from rlhf_trainer import planner\n"
        "from rlhf_api.loader import load_manifest\n"
        f"p = planner.plan_job(load_manifest({str(ROOT / 'manifests/examples/ppo-two-pools.yaml')!r}).spec)\n"
        "print(len(p.notes))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert int(done.stdout) >= 1  # the models' configs are not on this machine: noted, not guessed


def test_every_reward_model_counts_on_the_reward_gpu() -> None:
    """Two 8B reward models in bf16 on one reward worker: 2 x 14 GiB of weights exceed an L4's
    22.5 GiB, although each alone fits; their weights add up, one forward's transients count once."""
    doc = _ppo_l4()
    single = doc["spec"]["reward"].pop("model")
    alone = plan(_ppo_l4())
    (est_one,) = [e for e in alone.estimates if e.role == "reward"]
    doc["spec"]["reward"]["models"] = [dict(single, weight=0.3), dict(single, weight=0.7)]
    result = plan(doc)
    assert alone.errors == []
    line = one(result.errors, "spec.roles.reward: the sum of its 2 reward models (in bfloat16, bfloat16)")
    assert "(28.0 GiB of weights)" in line and "22.5 GiB of its NVIDIA-L4" in line
    (est_two,) = [e for e in result.estimates if e.role == "reward"]
    assert est_two.parts["weights"] == 2 * est_one.parts["weights"]
    assert est_two.parts["activations"] == est_one.parts["activations"]
    # maxLength bounds the tokens a forward reads
    doc["spec"]["reward"]["models"] = [dict(single, maxLength=64)]
    (est_short,) = [e for e in plan(doc).estimates if e.role == "reward"]
    assert est_short.parts["weights"] == est_one.parts["weights"]
    assert est_short.parts["activations"] < est_one.parts["activations"]
