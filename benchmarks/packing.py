"""Token-budget micro-batching (`training.maxTokensPerMicroBatch`): padded vs packed training step.

    python benchmarks/packing.py [--size tiny|30m] [--rows 64] [--repeats 3] [--device cpu]

Builds a random Llama on the spot (`tiny`: 2 layers, hidden 64; `30m`: 8 layers, hidden 512,
about 30M parameters), a GRPO batch whose response lengths are long-tailed (most responses
short, one in eight near the generation budget: what a reasoning task's rollouts look like), and
runs the same actor update (one optimizer step over the whole batch) two ways:

* padded: `microBatchSize` rows per forward/backward, every row padded to the batch's longest
  prompt and response (today's path);
* packed: micro-batches of at most `maxTokensPerMicroBatch` real tokens, each run as one packed
  row with per-sequence position ids (no padding).

The budget is the padded micro-batch's real-token average times two, rounded (so the two use
similar activation memory). It prints real tokens/s of each (the batch's prompt + response
tokens, padding not counted) over `--repeats` timed steps after one warm-up, and the ratio.
Figures are relative: compare the two lines of one run, on a quiet machine.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

SIZES = {
    "tiny": {"hidden": 64, "layers": 2, "heads": 4, "vocab": 512},
    "30m": {"hidden": 512, "layers": 8, "heads": 8, "vocab": 8192},
}


def make_model(path: Path, size: str, max_len: int) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    s = SIZES[size]
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=s["vocab"],
        hidden_size=s["hidden"],
        intermediate_size=int(2.75 * s["hidden"]),
        num_hidden_layers=s["layers"],
        num_attention_heads=s["heads"],
        num_key_value_heads=s["heads"],
        max_position_embeddings=max_len,
        tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(config)
    print(f"model: {size}, {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters", flush=True)
    model.save_pretrained(path)
    return path


def long_tailed_batch(
    rows: int, prompt_len: int, response_len: int, vocab: int, seed: int = 0
) -> dict[str, Any]:
    """Prompts of prompt_len/4..prompt_len tokens (left-padded); responses mostly short (8..response_len/8),
    one in eight near `response_len` (right-padded)."""
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(prompt_len // 4, prompt_len + 1, (rows,), generator=g)
    short = torch.randint(8, max(9, response_len // 8), (rows,), generator=g)
    long = torch.randint(3 * response_len // 4, response_len + 1, (rows,), generator=g)
    responses = torch.where(torch.rand(rows, generator=g) < 0.125, long, short)
    prompt_mask = (torch.arange(prompt_len)[None] >= prompt_len - prompts[:, None]).long()
    mask = (torch.arange(response_len)[None] < responses[:, None]).float()
    return {
        "prompt_ids": torch.randint(1, vocab, (rows, prompt_len), generator=g) * prompt_mask,
        "prompt_mask": prompt_mask,
        "response_ids": torch.randint(1, vocab, (rows, response_len), generator=g) * mask.long(),
        "response_mask": mask,
        "old_log_probs": -5.0 * mask,
        "advantages": torch.randn(rows, response_len, generator=g) * mask,
    }


def spec_for(model: Path, rows: int, micro: int, budget: int | None, response_len: int) -> Any:
    from rlhf_api.loader import parse_spec

    training: dict[str, Any] = {"promptsPerStep": rows // 4, "microBatchSize": micro, "learningRate": 1e-5}
    if budget is not None:
        training["maxTokensPerMicroBatch"] = budget
    return parse_spec(
        {
            "model": {"path": str(model)},
            "data": {"path": "unused.jsonl"},
            "reward": {"functions": [{"path": "r:f"}]},
            "rollout": {"samplesPerPrompt": 4, "maxNewTokens": response_len},
            "training": training,
        }
    )


def measure(spec: Any, batch: dict[str, Any], device: str, repeats: int) -> tuple[float, str, int]:
    """Median seconds of one actor update, the worker's layout, its micro-batch count."""
    from rlhf_trainer.algorithms import build_algorithm
    from rlhf_trainer.workers import ActorWorker, batching
    from rlhf_trainer.workers.training import UpdateBranch

    worker = ActorWorker(spec, device=device)
    worker.setup()
    params = {"klCoef": 0.0}
    branch = [UpdateBranch("grpo", params, build_algorithm("grpo", params).state_dict())]
    rows = torch.arange(batching.row_count(batch))
    units, total = batching.shard_for_rank(batch, rows, 0, 1)
    micros = len(worker.micro_batches(batch, rows, units, total))
    times = []
    for i in range(repeats + 1):
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        start = time.perf_counter()
        worker.update(batch, i, branch)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        if i:  # the first step warms up (allocator, kernels)
            times.append(time.perf_counter() - start)
    return statistics.median(times), worker.layout, micros


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", choices=sorted(SIZES), default="tiny")
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--response-len", type=int, default=512)
    ap.add_argument("--micro", type=int, default=8, help="microBatchSize of the padded run")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args(argv)

    vocab = SIZES[args.size]["vocab"]
    batch = long_tailed_batch(args.rows, args.prompt_len, args.response_len, vocab)
    real = int(batch["prompt_mask"].sum() + batch["response_mask"].sum())
    padded_tokens = args.rows * (args.prompt_len + args.response_len)
    budget = 2 * real * args.micro // args.rows
    lengths = batch["response_mask"].sum(-1)
    print(
        f"batch: {args.rows} rows, response lengths median {int(lengths.median())} max {int(lengths.max())}; "
        f"{real} real tokens, {padded_tokens} padded ({real / padded_tokens:.0%} real); budget {budget} tokens",
        flush=True,
    )
    with tempfile.TemporaryDirectory() as tmp:
        model = make_model(Path(tmp) / "model", args.size, args.prompt_len + args.response_len)
        results = {}
        for name, budget_or_none in (("padded", None), ("packed", budget)):
            spec = spec_for(model, args.rows, args.micro, budget_or_none, args.response_len)
            seconds, layout, micros = measure(spec, batch, args.device, args.repeats)
            results[name] = real / seconds
            print(
                f"{name:7s} layout={layout:7s} micro-batches={micros:3d}  step {seconds:7.3f} s  "
                f"{results[name]:10.0f} real tokens/s",
                flush=True,
            )
    print(f"packed / padded tokens/s: {results['packed'] / results['padded']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
