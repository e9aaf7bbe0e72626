"""GPU figures for tests/gpu/run.sh, printed as `figure: name = value` lines (and a JSON file).

* train-step MFU: one actor rank, bf16 compute over fp32 master weights, on a Qwen2-architecture
  model made on the spot (random weights, ~0.5B parameters; nothing is downloaded);
  MFU = 6 x parameters x tokens / step seconds / the GPU's peak dense bf16 FLOP/s (`--peak-tflops`,
  989 for an H100/H200 SXM).
* weight-sync GB/s through `SyncGroup(backend="nccl")` vs a raw NCCL broadcast of the same bytes
  (one flat tensor), source and receiver on two GPUs. One GPU: printed as skipped (NCCL puts one
  rank per GPU).
* a GRPO job whose reward rises: the quickstart's job on the tiny arithmetic model (made on the
  spot by its bootstrap recipe), with the actor on a GPU (`resources.gpus: 1`).

    python tests/gpu/figures.py [--only mfu sync grpo] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "api"))
sys.path.insert(0, str(ROOT / "trainer"))
sys.path.insert(0, str(ROOT / "tests" / "trainer"))

# Qwen2-0.5B's shape (494M parameters with tied embeddings).
QWEN2_05B = dict(
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    vocab_size=151936,
    tie_word_embeddings=True,
    max_position_embeddings=4096,
)


def _figure(results: dict[str, Any], name: str, value: Any, unit: str = "") -> None:
    results[name] = value
    shown = f"{value:.4g}" if isinstance(value, float) else value
    print(f"figure: {name} = {shown}{(' ' + unit) if unit else ''}", flush=True)


def make_qwen2(path: Path) -> Path:
    """A Qwen2-architecture model with random weights and a byte-level tokenizer stand-in."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    if (path / "config.json").is_file():
        return path
    torch.manual_seed(0)
    Qwen2ForCausalLM(Qwen2Config(**QWEN2_05B)).save_pretrained(path)
    return path


def train_step_mfu(results: dict[str, Any], work: Path, peak_tflops: float, seq: int, rows: int) -> None:
    from rlhf_api.loader import parse_spec
    from rlhf_trainer.workers import ActorWorker

    model = make_qwen2(work / "qwen2-0.5b")
    spec = parse_spec(
        {
            "model": {"path": str(model), "dtype": "bfloat16"},
            "data": {"path": "unused.jsonl"},
            "reward": {"functions": [{"path": "r:f"}]},
            "rollout": {"samplesPerPrompt": 1},
            "training": {"promptsPerStep": rows, "microBatchSize": 2, "learningRate": 1e-6},
        }
    )
    worker = ActorWorker(spec, device="cuda")
    worker.setup()
    params = sum(p.numel() for p in worker.model.parameters())
    g = torch.Generator().manual_seed(0)
    vocab = QWEN2_05B["vocab_size"]
    p_len = seq // 2
    batch = {
        "prompt_ids": torch.randint(3, vocab, (rows, p_len), generator=g),
        "prompt_mask": torch.ones(rows, p_len, dtype=torch.long),
        "response_ids": torch.randint(3, vocab, (rows, seq - p_len), generator=g),
        "response_mask": torch.ones(rows, seq - p_len),
        "advantages": torch.randn(rows, seq - p_len, generator=g),
    }

    def loss_fn(micro: dict[str, Any]) -> dict[str, Any]:
        from rlhf_trainer.workers import modeling

        logp, _ = modeling.token_log_probs(worker.model, micro)
        return {"loss": -(logp * micro["advantages"] * micro["response_mask"]).sum() / micro["global_tokens"]}

    worker.train_batch(batch, 0, loss_fn)  # warm-up (allocator, kernels)
    torch.cuda.synchronize()
    steps, t0 = 3, time.perf_counter()
    for s in range(steps):
        worker.train_batch(batch, s + 1, loss_fn)
    torch.cuda.synchronize()
    seconds = (time.perf_counter() - t0) / steps
    tokens = rows * seq
    flops = 6 * params * tokens
    _figure(results, "train_step_params", float(params))
    _figure(results, "train_step_seconds", seconds, "s")
    _figure(results, "train_step_tokens_per_s", tokens / seconds, "tokens/s")
    _figure(results, "train_step_mfu", flops / seconds / (peak_tflops * 1e12))


def _sync_rank(rank: int, port: int, size_mb: int, out: str) -> None:
    from datetime import timedelta

    import torch.distributed as dist

    from rlhf_trainer.sync import SyncGroup, WeightReceiver, connect_store

    # The rank's GPU by index: CUDA_VISIBLE_DEVICES set here would come after CUDA's initialisation.
    torch.cuda.set_device(rank)
    device = f"cuda:{rank}"
    numel = size_mb * 2**20 // 2
    flat = torch.randn(numel, device=device).to(torch.bfloat16)
    names = [(f"t{i}", flat[i * (numel // 64) : (i + 1) * (numel // 64)]) for i in range(64)]
    store = connect_store("127.0.0.1", port, is_source=rank == 0, timeout=120)
    group = SyncGroup(store, "actor" if rank == 0 else "r1", timeout=60, backend="nccl", device=device)
    group.rebuild(["actor", "r1"], 1)
    sink = WeightReceiver(device=device)
    times = []
    for version in range(4):  # the first is a warm-up (communicator creation)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        if rank == 0:
            group.push(names, version)
        else:
            group.receive(sink)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    raw_pg = dist.ProcessGroupNCCL(dist.PrefixStore("raw/", store), rank, 2, dist.ProcessGroupNCCL.Options())
    opts = dist.BroadcastOptions()
    opts.rootRank, opts.rootTensor, opts.timeout = 0, 0, timedelta(seconds=60)
    raw = []
    for _ in range(4):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        raw_pg.broadcast([flat], opts).wait()
        torch.cuda.synchronize()
        raw.append(time.perf_counter() - t0)
    if rank == 0:
        torch.save({"sync": min(times[1:]), "raw": min(raw[1:]), "bytes": flat.numel() * 2}, out)


def weight_sync(results: dict[str, Any], work: Path, size_mb: int) -> None:
    if torch.cuda.device_count() < 2:
        print("figure: weight_sync = skipped (needs a GPU pair: NCCL puts one rank per GPU)", flush=True)
        results["weight_sync"] = "skipped: needs a GPU pair"
        return
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = work / "sync.pt"
    mp.spawn(_sync_rank, args=(port, size_mb, str(out)), nprocs=2, join=True)
    got = torch.load(out)
    _figure(results, "weight_sync_gb_per_s", got["bytes"] / got["sync"] / 1e9, "GB/s")
    _figure(results, "raw_nccl_broadcast_gb_per_s", got["bytes"] / got["raw"] / 1e9, "GB/s")
    _figure(results, "weight_sync_vs_raw", got["raw"] / got["sync"])


def grpo_rises(results: dict[str, Any], work: Path, steps: int) -> None:
    import dataclasses

    from rlhf_api.loader import load_manifest
    from rlhf_api.sections import ModelSpec
    from rlhf_trainer.bootstrap import ensure_model, write_prompts
    from rlhf_trainer.controller import run
    from rlhf_trainer.metrics import read_jsonl

    model, prompts = work / "tiny-arithmetic", work / "prompts.jsonl"
    ensure_model(ModelSpec(path=str(model), bootstrap="tiny-arithmetic"))
    write_prompts("tiny-arithmetic", prompts, n=1024, seed=0)
    job = load_manifest(ROOT / "manifests" / "examples" / "quickstart.yaml")
    spec = job.spec
    roles = dataclasses.replace(
        spec.roles,
        actor=dataclasses.replace(
            spec.roles.actor, resources=dataclasses.replace(spec.roles.actor.resources, gpus=1)
        ),
    )
    spec = dataclasses.replace(
        spec,
        model=dataclasses.replace(spec.model, path=str(model), dtype="bfloat16", bootstrap=None),
        data=dataclasses.replace(spec.data, path=str(prompts)),
        roles=roles,
        training=dataclasses.replace(spec.training, steps=steps),
        checkpoint=dataclasses.replace(spec.checkpoint, every=0),
        output=dataclasses.replace(spec.output, progress=False, report=False),
    )
    t0 = time.perf_counter()
    run(dataclasses.replace(job, spec=spec), run_dir=work / "grpo-run")
    rows = read_jsonl(work / "grpo-run" / "metrics.jsonl")
    first = sum(r["reward/mean"] for r in rows[:5]) / 5
    last = sum(r["reward/mean"] for r in rows[-5:]) / 5
    _figure(results, "grpo_seconds", time.perf_counter() - t0, "s")
    _figure(results, "grpo_reward_first5", first)
    _figure(results, "grpo_reward_last5", last)
    results["grpo_rises"] = last > first + 0.1
    print(f"figure: grpo_rises = {results['grpo_rises']}", flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", nargs="+", default=["mfu", "sync", "grpo"], choices=["mfu", "sync", "grpo"])
    ap.add_argument("--peak-tflops", type=float, default=989.0, help="peak dense bf16 TFLOP/s of the GPU")
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--sync-mb", type=int, default=1024, help="bytes pushed per weight sync, in MiB")
    ap.add_argument("--grpo-steps", type=int, default=30)
    ap.add_argument("--work", type=Path, default=Path("/tmp/rlhf-gpu-figures"))
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("skipped: needs a GPU (no CUDA device on this machine)")
        return 0
    a.work.mkdir(parents=True, exist_ok=True)
    print(
        f"# {torch.cuda.get_device_name(0)} x{torch.cuda.device_count()}; torch {torch.__version__}",
        flush=True,
    )
    results: dict[str, Any] = {}
    if "mfu" in a.only:
        train_step_mfu(results, a.work, a.peak_tflops, a.seq, a.rows)
    if "sync" in a.only:
        weight_sync(results, a.work, a.sync_mb)
    if "grpo" in a.only:
        grpo_rises(results, a.work, a.grpo_steps)
    if a.json:
        a.json.write_text(json.dumps(results, indent=1))
    return 0 if results.get("grpo_rises", True) else 1


if __name__ == "__main__":
    sys.exit(main())
