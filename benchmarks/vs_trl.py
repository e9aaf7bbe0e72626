"""GRPO throughput against TRL's `GRPOTrainer`: the same model, prompts, reward and batch, one run.

    pip install -e '.[bench]'        # TRL: a benchmark dependency, never a runtime one
    python benchmarks/vs_trl.py [--sizes tiny,30m] [--steps 10] [--warmup 3] [--threads 2]

For each model size the script makes the model on the spot (nothing is downloaded): `tiny` is
the quickstart's bootstrap model (`tiny-arithmetic`: a 2-layer Llama, hidden 64, warmed up on
the task), `30m` a Llama of the same architecture and tokenizer at about 30M parameters
(hidden 512, 7 layers, randomly initialised: it rarely stops early, so its responses run to the
length budget). Both trainers then run GRPO for `--steps` steps on the same prompt file
(`a+b=` problems), with the same reward (`rewards.builtin:arithmetic_exact`), group size,
prompts per step, response length budget, learning rate, clip range, sampling temperature, no
KL term (so no reference model), one optimizer step per batch (no old-log-prob reuse), no
activation checkpointing (TRL's default turns it on), on CPU with the same intra-op thread
count per process (`--threads`). TRL generates with `transformers`' `generate`, the project
with its `hf` engine (colocated placement: one actor rank samples and trains, one reward worker).

Printed per size: samples/s of each (over the steps after `--warmup`, step time as each
trainer's own step boundaries show it: TRL's `on_step_begin`/`on_step_end` callbacks, the
project's `timing/*` phases), the ratio project / TRL, the wall time of each whole run, and
the project's share of step time per phase. On a shared machine compare figures of one run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

CACHE = Path("~/.cache/rlhf-operator").expanduser()

#: (hidden size, layers, heads) of the sizes made on the spot; None: the bootstrap recipe's model.
SIZES: dict[str, tuple[int, int, int] | None] = {"tiny": None, "30m": (512, 7, 8)}


def make_model(size: str, out: Path) -> Path:
    """The model directory of `size` (the bootstrap model, cached; or a fresh one under `out`)."""
    from rlhf_trainer.bootstrap import build_char_tokenizer, build_tiny_model, ensure_model
    from rlhf_trainer.spec import ModelSpec

    shape = SIZES[size]
    if shape is None:
        path = CACHE / "models/tiny-arithmetic"
        ensure_model(ModelSpec(path=str(path), bootstrap="tiny-arithmetic"))
        return path
    hidden, layers, heads = shape
    path = out / f"llama-{size}"
    tokenizer = build_char_tokenizer()
    model = build_tiny_model(tokenizer, hidden_size=hidden, num_layers=layers, num_heads=heads, seed=0)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def parameters(path: Path) -> int:
    from transformers import AutoModelForCausalLM

    return sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(path).parameters())


# --------------------------------------------------------------------------------------------
# The project
# --------------------------------------------------------------------------------------------


def project_job(model: Path, prompts: Path, a: argparse.Namespace) -> Any:
    from rlhf_trainer.spec import parse_job

    return parse_job(
        {
            "apiVersion": "rlhf.dev/v1alpha1",
            "kind": "RLTrainingJob",
            "metadata": {"name": "vs-trl"},
            "spec": {
                "model": {"path": str(model)},
                "data": {"path": str(prompts)},
                "reward": {"functions": [{"path": "rlhf_trainer.rewards.builtin:arithmetic_exact"}]},
                "algorithm": {
                    "name": "grpo",
                    "params": {
                        "klCoef": 0.0,
                        "clipRatioLow": 0.2,
                        "clipRatioHigh": 0.2,
                        "lossAggMode": "token-mean",
                        "normByStd": True,
                    },
                },
                "rollout": {
                    "samplesPerPrompt": a.group,
                    "maxNewTokens": a.max_new_tokens,
                    "temperature": 1.0,
                },
                "training": {
                    "steps": a.steps,
                    "promptsPerStep": a.prompts,
                    "microBatchSize": a.prompts * a.group,
                    "learningRate": a.lr,
                    "gradClip": 1.0,
                },
                "checkpoint": {"every": 0},
                "output": {"progress": False, "report": False},
            },
        }
    )


def run_project(model: Path, prompts: Path, a: argparse.Namespace) -> dict[str, Any]:
    from rlhf_trainer.controller import run
    from rlhf_trainer.metrics import read_jsonl

    with tempfile.TemporaryDirectory() as tmp:
        started = time.perf_counter()
        run(project_job(model, prompts, a), run_dir=tmp, resume=False)
        wall = time.perf_counter() - started
        rows = read_jsonl(Path(tmp) / "metrics.jsonl")
    return {
        **summarize(rows, a.warmup, wall),
        "old-log-prob pass skipped": all(r.get("update/old_log_probs_skipped") == 1.0 for r in rows),
    }


def summarize(rows: list[dict[str, Any]], warmup: int, wall: float) -> dict[str, Any]:
    """A project run's figures from its metrics rows (one per step), the first `warmup` steps
    left out of the rates: samples/s, seconds per step, wall time, first and last reward, and
    each phase's share of step time. Also used by `ppo_vs_before.py`."""
    measured = rows[warmup:]
    total = sum(r["timing/step"] for r in measured)
    phases = sorted({k for r in measured for k in r if k.startswith("timing/") and k != "timing/step"})
    return {
        "samples/s": sum(r["rollout/samples"] for r in measured) / total,
        "step s": total / len(measured),
        "wall s": wall,
        "reward first": rows[0]["reward/mean"],
        "reward last": rows[-1]["reward/mean"],
        "shares": {k.removeprefix("timing/"): sum(r.get(k, 0.0) for r in measured) / total for k in phases},
    }


# --------------------------------------------------------------------------------------------
# The floor: the same arithmetic with no trainer around it
# --------------------------------------------------------------------------------------------


def run_floor(model: Path, prompts: Path, a: argparse.Namespace) -> dict[str, Any]:
    """What a step costs with nothing but its arithmetic, in this process: sample the batch with
    the KV cache (the project's `hf` engine, a plain decode loop), one forward/backward of the
    same loss over prompt + response (the GRPO surrogate at ratio 1: -advantage * log-prob,
    token mean), one clipped AdamW step. No reward, no advantage bookkeeping, no processes.
    Neither trainer can beat it by much: it is the bar for "near what the hardware allows"."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlhf_trainer.rollout.hf import HFRolloutEngine

    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(model)
    policy = AutoModelForCausalLM.from_pretrained(model)
    engine = HFRolloutEngine(policy, tokenizer, max_new_tokens=a.max_new_tokens, temperature=1.0, seed=0)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=a.lr, weight_decay=0.0)
    rows = [json.loads(line) for line in prompts.read_text().splitlines() if line.strip()]
    seconds = []
    for step in range(a.steps):
        chunk = rows[step * a.prompts : (step + 1) * a.prompts]
        ids = [tokenizer(r["prompt"]).input_ids for r in chunk]
        started = time.perf_counter()
        out = engine.generate(ids, n=a.group)
        tokens = torch.cat([out.prompt_ids, out.response_ids], 1)
        mask = torch.cat([out.prompt_mask, out.response_mask.long()], 1)
        width = out.response_ids.shape[1]
        policy.train()
        logits = policy(input_ids=tokens, attention_mask=mask).logits[:, -width - 1 : -1].float()
        logp = torch.log_softmax(logits, -1).gather(-1, out.response_ids[..., None]).squeeze(-1)
        advantages = torch.randn(len(tokens), 1)  # any advantages: the cost does not depend on them
        loss = -(advantages * logp * out.response_mask).sum() / out.response_mask.sum().clamp(min=1)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        seconds.append(time.perf_counter() - started)
    measured = seconds[a.warmup :]
    return {
        "samples/s": a.prompts * a.group * len(measured) / sum(measured),
        "step s": sum(measured) / len(measured),
    }


# --------------------------------------------------------------------------------------------
# TRL
# --------------------------------------------------------------------------------------------


def run_trl(model: Path, prompts: Path, a: argparse.Namespace, out: Path) -> dict[str, Any]:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from rlhf_trainer.rewards.builtin import arithmetic_exact

    torch.set_num_threads(a.threads)
    rows = [json.loads(line) for line in prompts.read_text().splitlines() if line.strip()]
    dataset = Dataset.from_list([{"prompt": r["prompt"], "answer": str(r["answer"])} for r in rows])

    def exact(prompts: list[str], completions: list[str], answer: list[str], **_: Any) -> list[float]:
        return arithmetic_exact(prompts, completions, answer)

    class StepClock(TrainerCallback):  # type: ignore[misc]
        def __init__(self) -> None:
            self.starts: list[float] = []
            self.seconds: list[float] = []

        def on_step_begin(self, *args: Any, **kwargs: Any) -> None:
            self.starts.append(time.perf_counter())

        def on_step_end(self, *args: Any, **kwargs: Any) -> None:
            self.seconds.append(time.perf_counter() - self.starts[-1])

    batch = a.prompts * a.group
    config = GRPOConfig(
        output_dir=str(out / "trl"),
        max_steps=a.steps,
        per_device_train_batch_size=batch,
        gradient_accumulation_steps=1,
        steps_per_generation=1,
        num_iterations=1,
        num_generations=a.group,
        max_completion_length=a.max_new_tokens,
        temperature=1.0,
        learning_rate=a.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        beta=0.0,
        epsilon=0.2,
        loss_type="dapo",
        scale_rewards="group",
        use_cpu=True,
        bf16=False,
        disable_dropout=True,
        gradient_checkpointing=False,  # TRL's default is on; the project's activationCheckpointing is off
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        seed=0,
        dataloader_num_workers=0,
    )
    tokenizer = AutoTokenizer.from_pretrained(model)
    clock = StepClock()
    trainer = GRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(model),
        reward_funcs=exact,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[clock],
    )
    started = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - started
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    measured = clock.seconds[a.warmup :]
    return {
        "samples/s": batch * len(measured) / sum(measured),
        "step s": sum(measured) / len(measured),
        "wall s": wall,
        "reward first": rewards[0] if rewards else float("nan"),
        "reward last": rewards[-1] if rewards else float("nan"),
    }


# --------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="tiny,30m", help=f"comma-separated, of {', '.join(SIZES)}")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3, help="first steps left out of the rates")
    parser.add_argument("--prompts", type=int, default=8, help="prompts per step")
    parser.add_argument("--group", type=int, default=8, help="responses per prompt (GRPO group)")
    parser.add_argument("--max-new-tokens", type=int, default=4)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="intra-op torch threads per process (default 1: on a small shared machine more threads "
        "per process oversubscribe the cores and slow every contender, TRL's single process included)",
    )
    a = parser.parse_args(argv)
    sizes = [s for s in a.sizes.split(",") if s]
    unknown = [s for s in sizes if s not in SIZES]
    if unknown:
        parser.error(f"--sizes: unknown {', '.join(unknown)}; valid: {', '.join(SIZES)}")
    if a.steps <= a.warmup:
        parser.error("--steps must exceed --warmup")
    try:
        import trl  # noqa: F401
    except ImportError:
        parser.error("TRL is not installed: pip install -e '.[bench]' (or pip install trl)")

    os.environ["RLHF_TORCH_THREADS"] = str(a.threads)  # the project's workers, as TRL's process
    from rlhf_trainer.bootstrap import write_prompts
    from rlhf_trainer.controller import start_ray

    start_ray()
    print(
        f"GRPO, {a.prompts} prompts x {a.group} samples per step, up to {a.max_new_tokens} new tokens, "
        f"lr {a.lr}, {a.steps} steps ({a.steps - a.warmup} measured), {a.threads} torch threads per process"
    )
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        prompts = write_prompts("tiny-arithmetic", out / "prompts.jsonl", n=4096, seed=0)
        for size in sizes:
            model = make_model(size, out)
            project = run_project(model, prompts, a)
            peer = run_trl(model, prompts, a, out)
            floor = run_floor(model, prompts, a)
            print(f"\n== {size}: {parameters(model) / 1e6:.1f}M parameters ({model})")
            print(f"{'':28s}{'project':>12s}{'TRL':>12s}{'floor':>12s}")
            for key in ("samples/s", "step s", "wall s", "reward first", "reward last"):
                cells = [f"{r[key]:>12.3f}" if key in r else f"{'':>12s}" for r in (project, peer, floor)]
                print(f"{key:28s}{''.join(cells)}")
            print(f"project / TRL samples/s: {project['samples/s'] / peer['samples/s']:.2f}")
            print(
                f"of the floor (the step's arithmetic alone, one process): project "
                f"{project['samples/s'] / floor['samples/s']:.2f}, TRL {peer['samples/s'] / floor['samples/s']:.2f}"
            )
            print(f"project old-log-prob pass skipped: {project['old-log-prob pass skipped']}")
            print("project share of step time per phase:")
            for phase, share in sorted(project["shares"].items(), key=lambda kv: -kv[1]):
                print(f"  {phase:26s}{share:>8.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
