"""Asynchronous rollouts: step time with `rollout.maxStaleness` 0 (generate, then train) vs 1
(the fleet generates step k+1 while the actor trains step k), on the same disaggregated job.

    python benchmarks/async_rollout.py [--steps 10] [--warmup 3] [--delays 0,0.05]

For each generation delay (seconds per prompt a rollout replica sleeps before generating: a
stand-in for an engine on its own accelerator, which does not compete with the trainer for the
host's cores; 0: the plain CPU engine) it runs the job with maxStaleness 0, then 1, on one local
Ray instance, and prints the median wall time per step (the first `--warmup` steps dropped), the
rollout and train times of the synchronous run (train: reward, old log-probs, advantages and
update, the phases a rollout ahead overlaps; other: data, weight sync, log), their sum, the ideal
max(rollout, train) + other, and the ratio async / sync. The target: the asynchronous step falls
from rollout + train toward max(rollout, train). Figures are relative: on a shared CPU (a CPU
engine and the trainer share the cores) the overlap is bounded by the cores free.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

CACHE = Path("~/.cache/rlhf-operator").expanduser()
#: The phases a rollout generated ahead overlaps (everything after the rollout up to the update).
TRAIN_PHASES = ("reward", "reference", "critic", "old_log_probs", "baseline", "advantage", "update")


def job(max_staleness: int, steps: int) -> Any:
    from rlhf_api.loader import parse_job

    return parse_job(
        {
            "apiVersion": "rlhf.dev/v1alpha1",
            "kind": "RLTrainingJob",
            "metadata": {"name": f"bench-async-{max_staleness}"},
            "spec": {
                "model": {"path": str(CACHE / "models/tiny-arithmetic"), "bootstrap": "tiny-arithmetic"},
                "data": {"path": str(CACHE / "data/tiny-arithmetic.jsonl")},
                "reward": {"functions": [{"path": "rlhf_trainer.rewards.builtin:arithmetic_exact"}]},
                "algorithm": {"name": "grpo", "params": {"klCoef": 0.0}},
                "rollout": {"samplesPerPrompt": 8, "maxNewTokens": 8, "maxStaleness": max_staleness},
                "training": {
                    "steps": steps,
                    "promptsPerStep": 16,
                    "microBatchSize": 32,
                    "learningRate": 5e-4,
                },
                "checkpoint": {"every": 0},
                "output": {"progress": False, "report": False},
                "roles": {
                    "placement": "disaggregated",
                    "critic": {"replicas": 0},
                    "reference": {"replicas": 0},
                    "rollout": {"replicas": 1},
                },
            },
        }
    )


def measure(max_staleness: int, steps: int, warmup: int, delay: float) -> dict[str, float]:
    """Median seconds per step (wall clock between step ends) and per phase of one run."""
    from rlhf_trainer.controller import run
    from rlhf_trainer.fleet.elastic import ElasticOptions
    from rlhf_trainer.metrics import read_jsonl

    ends: list[float] = []
    options = ElasticOptions(generation_delay=(lambda step: delay) if delay else None)
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        run(
            job(max_staleness, steps),
            run_dir=tmp,
            resume=False,
            elastic=options,
            on_status=lambda done, total, m, checkpoint_step: ends.append(time.perf_counter()),
        )
        rows = read_jsonl(Path(tmp) / "metrics.jsonl")
    walls = [b - a for a, b in zip([start, *ends], ends)][warmup:]
    rows = rows[warmup:]

    def median(key: str) -> float:
        return statistics.median(r.get(key, 0.0) for r in rows)

    train = statistics.median(sum(r.get(f"timing/{p}", 0.0) for p in TRAIN_PHASES) for r in rows)
    step = statistics.median(walls)
    phases = sorted({k for r in rows for k in r if k.startswith("timing/") and k != "timing/step"})
    print(
        f"  [maxStaleness {max_staleness}, delay {delay:g}] median phase seconds: "
        + ", ".join(f"{k.removeprefix('timing/')} {median(k):.3f}" for k in phases)
    )
    return {
        "step": step,
        "rollout": median("timing/rollout"),
        "train": train,
        "generation": median("rollout/ahead_seconds"),
        "staleness": median("offpolicy/staleness_mean"),
        "reward": statistics.mean(r["reward/mean"] for r in rows),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument(
        "--delays", default="0,0.05", help="seconds per prompt added to generation, comma-separated"
    )
    args = parser.parse_args(argv)
    if args.steps <= args.warmup:
        parser.error("--steps must exceed --warmup")

    from rlhf_trainer.startup import start_ray

    owns = start_ray()
    try:
        for delay in [float(d) for d in args.delays.split(",")]:
            sync = measure(0, args.steps, args.warmup, delay)
            ahead = measure(1, args.steps, args.warmup, delay)
            other = max(0.0, sync["step"] - sync["rollout"] - sync["train"])
            total = sync["rollout"] + sync["train"] + other
            ideal = max(sync["rollout"], sync["train"]) + other
            print(f"\ngeneration delay {delay:g} s/prompt  (median of steps {args.warmup}..{args.steps - 1})")
            print(f"  maxStaleness 0  step {sync['step']:.3f} s   (rollout {sync['rollout']:.3f} + train "
                  f"{sync['train']:.3f} + other {other:.3f} = {total:.3f})")  # fmt: skip
            print(f"  maxStaleness 1  step {ahead['step']:.3f} s   (waited for rollout {ahead['rollout']:.3f}, "
                  f"generation ran {ahead['generation']:.3f}, train {ahead['train']:.3f}, "
                  f"staleness {ahead['staleness']:.2f})")  # fmt: skip
            print(f"  ideal max(rollout, train) + other = {ideal:.3f} s")
            print(f"  async / sync step time            = {ahead['step'] / sync['step']:.3f}")
            print(f"  ideal / sync                      = {ideal / sync['step']:.3f}")
            if sync["step"] > ideal:
                achieved = (sync["step"] - ahead["step"]) / (sync["step"] - ideal)
                print(f"  overlap achieved (sync - async) / (sync - ideal) = {achieved:.2f}")
            print(f"  mean reward (measured steps): sync {sync['reward']:.3f}, async {ahead['reward']:.3f}")
    finally:
        if owns:
            import ray

            ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
