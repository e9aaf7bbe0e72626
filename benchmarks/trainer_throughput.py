"""Trainer throughput: GRPO on a fixed tiny configuration, colocated vs disaggregated placement.

    python benchmarks/trainer_throughput.py [--steps 8] [--warmup 2]

Runs the same job twice on one local Ray instance (tiny-arithmetic bootstrap model, 16 prompts x
8 samples, 4 new tokens) and prints, per placement, samples/s and tokens/s over the measured
steps (the first `--warmup` steps are dropped) and each phase's share of step time, then the
ratio of the two placements. Figures are relative: on a shared CPU, compare runs of one process.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

CACHE = Path("~/.cache/rlhf-operator").expanduser()


def job(placement: str, steps: int) -> Any:
    from rlhf_api.loader import parse_job

    roles: dict[str, Any] = {"placement": placement}
    if placement == "disaggregated":
        roles["rollout"] = {"replicas": 1}
    return parse_job(
        {
            "apiVersion": "rlhf.dev/v1alpha1",
            "kind": "RLTrainingJob",
            "metadata": {"name": f"bench-{placement}"},
            "spec": {
                "model": {"path": str(CACHE / "models/tiny-arithmetic"), "bootstrap": "tiny-arithmetic"},
                "data": {"path": str(CACHE / "data/tiny-arithmetic.jsonl")},
                "reward": {"functions": [{"path": "rlhf_trainer.rewards.builtin:arithmetic_exact"}]},
                "algorithm": {"name": "grpo", "params": {"klCoef": 0.0}},
                "rollout": {"samplesPerPrompt": 8, "maxNewTokens": 4},
                "training": {
                    "steps": steps,
                    "promptsPerStep": 16,
                    "microBatchSize": 64,
                    "learningRate": 5e-4,
                },
                "checkpoint": {"every": 0},
                "output": {"progress": False, "report": False},
                "roles": roles,
            },
        }
    )


def measure(placement: str, steps: int, warmup: int) -> dict[str, float]:
    from rlhf_trainer.controller import run
    from rlhf_trainer.metrics import read_jsonl

    with tempfile.TemporaryDirectory() as tmp:
        run(job(placement, steps), run_dir=tmp, resume=False)
        rows = read_jsonl(Path(tmp) / "metrics.jsonl")[warmup:]
    total = sum(r["timing/step"] for r in rows)
    out = {
        "samples/s": sum(r["rollout/samples"] for r in rows) / total,
        "tokens/s": sum(r["rollout/tokens"] for r in rows) / total,
        "step s": total / len(rows),
    }
    phases = sorted({k for r in rows for k in r if k.startswith("timing/") and k != "timing/step"})
    for key in phases:
        out["share " + key.removeprefix("timing/")] = sum(r.get(key, 0.0) for r in rows) / total
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args(argv)
    if args.steps <= args.warmup:
        parser.error("--steps must exceed --warmup")

    from rlhf_trainer.startup import start_ray

    start_ray()
    results = {p: measure(p, args.steps, args.warmup) for p in ("colocated", "disaggregated")}
    keys = sorted({k for r in results.values() for k in r}, key=lambda k: (k.startswith("share"), k))
    print(f"GRPO, tiny-arithmetic, 16 prompts x 8 samples, {args.steps - args.warmup} measured steps")
    print(f"{'':24s}{'colocated':>14s}{'disaggregated':>16s}")
    for key in keys:
        a, b = (results[p].get(key, 0.0) for p in ("colocated", "disaggregated"))
        fmt = "{:>14.1%}{:>16.1%}" if key.startswith("share") else "{:>14.2f}{:>16.2f}"
        print(f"{key:24s}" + fmt.format(a, b))
    ratio = results["disaggregated"]["samples/s"] / results["colocated"]["samples/s"]
    print(f"disaggregated / colocated samples/s: {ratio:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
