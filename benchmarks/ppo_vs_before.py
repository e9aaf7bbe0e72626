"""PPO with a critic: this checkout's trainer against an earlier checkout's, on the same job.

    git worktree add /tmp/before 48108ff          # main before the lean step (issue 14)
    python benchmarks/ppo_vs_before.py --before /tmp/before [--sizes tiny,30m] [--steps 8]

TRL no longer ships a PPO trainer (1.16 has neither `trl.PPOTrainer` nor `trl.experimental.ppo`;
the script checks and says so when TRL is installed), so the PPO figures of issue 14 compare the
project with its own earlier code instead of with a peer. Each checkout runs in a process of its
own (its `trainer/` first on the import path, a fresh local Ray instance whose workers import the
same code), on the same model made once by this checkout (`tiny`: the quickstart's bootstrap
model; `30m`: the same architecture at ~30M parameters, as in `vs_trl.py`), the same prompt file
and job: PPO with a critic initialised from the policy, a KL penalty to the reference
(`klCoef`), `arithmetic_exact`, colocated placement (actor, critic, reference and reward one
replica each), two optimizer steps per batch (2 epochs x 1 mini-batch, so the old-log-prob pass
is needed on both sides), one torch thread per process. The runs alternate (before, after,
before, after, ... `--repeats` pairs) so that a change of load on a shared machine falls on both.

Printed per size: samples/s and seconds per step of each checkout (median of its runs, steps
after `--warmup`), the ratio after / before, and each phase's share of step time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

# The same figures as vs_trl.py's, from the same code (this script's folder is on the path when
# it runs, in the parent and in each checkout's child process alike).
from vs_trl import SIZES, make_model, parameters, summarize

HERE = Path(__file__).resolve().parents[1]


def job_document(model: Path, prompts: Path, a: argparse.Namespace) -> dict[str, Any]:
    """The manifest both checkouts run: only fields the earlier checkout's spec knows too."""
    return {
        "apiVersion": "rlhf.dev/v1alpha1",
        "kind": "RLTrainingJob",
        "metadata": {"name": "ppo-vs-before"},
        "spec": {
            "model": {"path": str(model)},
            "data": {"path": str(prompts)},
            "reward": {"functions": [{"path": "rlhf_trainer.rewards.builtin:arithmetic_exact"}]},
            "algorithm": {"name": "ppo", "params": {"klCoef": 0.01}},
            "rollout": {"samplesPerPrompt": a.group, "maxNewTokens": a.max_new_tokens, "temperature": 1.0},
            "training": {
                "steps": a.steps,
                "promptsPerStep": a.prompts,
                "miniBatchSize": a.prompts * a.group,
                "microBatchSize": a.prompts * a.group,
                "epochsPerBatch": 2,
                "learningRate": a.lr,
                "criticLearningRate": 1e-3,
            },
            "roles": {
                "placement": "colocated",
                "actor": {"replicas": 1},
                "critic": {"replicas": 1},
                "reference": {"replicas": 1},
                "reward": {"replicas": 1},
            },
            "checkpoint": {"every": 0},
            "output": {"progress": False, "report": False},
        },
    }


def child(doc_path: Path, out: Path, warmup: int) -> int:
    """In the checkout's own process: run the job, write the measured figures as JSON."""
    import time

    import rlhf_trainer
    from rlhf_api.loader import parse_job
    from rlhf_trainer.controller import run
    from rlhf_trainer.metrics import read_jsonl

    doc = json.loads(doc_path.read_text())
    with tempfile.TemporaryDirectory() as tmp:
        started = time.perf_counter()
        run(parse_job(doc), run_dir=tmp)
        wall = time.perf_counter() - started
        rows = read_jsonl(Path(tmp) / "metrics.jsonl")
    code = str(Path(rlhf_trainer.__file__).resolve().parents[2])
    out.write_text(json.dumps({"code": code, **summarize(rows, warmup, wall)}))
    return 0


def run_checkout(code: Path, doc_path: Path, a: argparse.Namespace, out: Path) -> dict[str, Any]:
    """One run of the job with the trainer of `code`, in a fresh process (and Ray instance)."""
    env = dict(os.environ)
    # The checkout's own API package where it has one (older checkouts kept it inside the trainer).
    parts = [code / "api", code / "trainer", code / "operator"]
    env["PYTHONPATH"] = os.pathsep.join(str(p) for p in parts if p.is_dir())
    env["RLHF_TORCH_THREADS"] = str(a.threads)
    cmd = [sys.executable, __file__, "--child", str(doc_path), "--out", str(out), "--warmup", str(a.warmup)]
    res = subprocess.run(cmd, env=env, cwd=code, capture_output=True, text=True)
    if res.returncode != 0:
        raise SystemExit(
            f"the run with the trainer of {code} failed ({res.returncode}):\n{res.stderr[-3000:]}"
        )
    result: dict[str, Any] = json.loads(out.read_text())
    if Path(result["code"]) != code.resolve():
        raise SystemExit(f"the run meant for {code} imported the trainer of {result['code']}")
    return result


def trl_has_ppo() -> str:
    """What TRL offers for PPO here, in words."""
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    try:
        import trl
    except ImportError:
        return "TRL is not installed"
    for name in ("trl.PPOTrainer", "trl.experimental.ppo.PPOTrainer"):
        module, _, attr = name.rpartition(".")
        try:
            getattr(__import__(module, fromlist=[attr]), attr)
            return f"TRL {trl.__version__} has {name} (not compared here)"
        except (ImportError, AttributeError):
            continue
    return f"TRL {trl.__version__} ships no PPO trainer"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", type=Path, help="an earlier checkout of this project (a git worktree)")
    parser.add_argument("--sizes", default="tiny,30m", help="comma-separated, of tiny, 30m")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2, help="first steps left out of the rates")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each checkout, alternated")
    parser.add_argument("--prompts", type=int, default=8, help="prompts per step")
    parser.add_argument("--group", type=int, default=8, help="responses per prompt")
    parser.add_argument("--max-new-tokens", type=int, default=4)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--threads", type=int, default=1, help="intra-op torch threads per process")
    parser.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    a = parser.parse_args(argv)
    if a.child:
        return child(a.child, a.out, a.warmup)
    if a.before is None:
        parser.error("--before: an earlier checkout is needed (e.g. git worktree add /tmp/before 48108ff)")
    if not (a.before / "trainer" / "rlhf_trainer").is_dir():
        parser.error(f"--before {a.before}: no trainer/rlhf_trainer there; give the root of a checkout")
    if a.steps <= a.warmup:
        parser.error("--steps must exceed --warmup")
    sizes = [s for s in a.sizes.split(",") if s]
    unknown = [s for s in sizes if s not in SIZES]
    if unknown:
        parser.error(f"--sizes: unknown {', '.join(unknown)}; valid: {', '.join(SIZES)}")
    from rlhf_trainer.bootstrap import write_prompts

    print(trl_has_ppo() + ": PPO is compared with the project's earlier code")
    print(
        f"PPO + critic + KL to the reference, {a.prompts} prompts x {a.group} samples per step, up to "
        f"{a.max_new_tokens} new tokens, 2 epochs per batch, {a.steps} steps ({a.steps - a.warmup} measured), "
        f"{a.repeats} alternated runs per checkout, {a.threads} torch thread(s) per process"
    )
    codes = {"before": a.before.resolve(), "after": HERE}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        prompts = write_prompts("tiny-arithmetic", out / "prompts.jsonl", n=4096, seed=0)
        for size in sizes:
            model = make_model(size, out)
            doc_path = out / f"job-{size}.json"
            doc_path.write_text(json.dumps(job_document(model, prompts, a)))
            runs: dict[str, list[dict[str, Any]]] = {"before": [], "after": []}
            for i in range(a.repeats):
                for label, code in codes.items():
                    runs[label].append(run_checkout(code, doc_path, a, out / f"{size}-{label}-{i}.json"))
            print(f"\n== {size}: {parameters(model) / 1e6:.1f}M parameters")
            print(f"{'':22s}{'before':>12s}{'after':>12s}   (median of {a.repeats}; every run)")
            for key in ("samples/s", "step s", "wall s", "reward first", "reward last"):
                med = {k: statistics.median(r[key] for r in v) for k, v in runs.items()}
                each = "  ".join(f"{k} " + ", ".join(f"{r[key]:.3f}" for r in v) for k, v in runs.items())
                print(f"{key:22s}{med['before']:>12.3f}{med['after']:>12.3f}   ({each})")
            ratio = statistics.median(r["samples/s"] for r in runs["after"]) / statistics.median(
                r["samples/s"] for r in runs["before"]
            )
            print(f"after / before samples/s: {ratio:.2f}")
            same = all(
                (b["reward first"], b["reward last"]) == (f["reward first"], f["reward last"])
                for b, f in zip(runs["before"], runs["after"])
            )
            print(f"same rewards in every pair of runs (the math unchanged): {same}")
            print("share of step time per phase (first run of each):")
            phases = sorted(set(runs["before"][0]["shares"]) | set(runs["after"][0]["shares"]))
            for phase in sorted(phases, key=lambda p: -runs["after"][0]["shares"].get(p, 0.0)):
                b = runs["before"][0]["shares"].get(phase, 0.0)
                f = runs["after"][0]["shares"].get(phase, 0.0)
                print(f"  {phase:24s}{b:>10.1%}{f:>10.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
