"""GRPO throughput against TRL's `GRPOTrainer`: the same model, prompts, reward and batch, under a protocol.

    pip install -e '.[bench]'        # TRL: a benchmark dependency, never a runtime one
    python benchmarks/vs_trl.py [--sizes tiny,30m] [--new-tokens 4,64] [--alternations 3] [--steps 10]

For each model size the script makes the model on the spot (nothing is downloaded): `tiny` is
the quickstart's bootstrap model (`tiny-arithmetic`: a 2-layer Llama, hidden 64, warmed up on
the task), `30m` a Llama of the same architecture and tokenizer at about 30M parameters
(hidden 512, 7 layers, randomly initialised: it rarely stops early, so its responses run to the
length budget). Every contender then runs GRPO for `--steps` steps on the same prompt file
(`a+b=` problems), with the same reward (`rewards.builtin:arithmetic_exact`), group size,
prompts per step, response length budget, learning rate, clip range, sampling temperature, no
KL term (so no reference model), one optimizer step per batch (no old-log-prob reuse), no
activation checkpointing (TRL's default turns it on), on CPU. TRL generates with
`transformers`' `generate`, the project with its `hf` engine (colocated placement: one actor
rank samples and trains, one reward worker).

The contenders: `project`, `trl`, and two floors, the step's arithmetic alone in a plain loop
(`run_floor`): `floor` as measured before (each sample's copy of its prompt prefilled and
trained on, AdamW's loop) and `floor-once` (each prompt computed once in the prefill and in the
forward/backward, fused AdamW: the same math, less of it).

The protocol:
- each contender runs in a process of its own (the project with a fresh Ray instance), one
  after another, `--alternations` times, the order rotated each time, so that a change of load
  falls on every contender; medians over the alternations with their range (min-max);
- every process at this script's niceness (the project's Ray workers too: `ray_node`) and with
  the same `--threads` torch threads (the project's workers get `RLHF_TORCH_THREADS`), both
  reported per contender;
- the load average and the CPUs' busy fraction printed before and after each run; the script
  refuses a busy machine (more than `--max-busy` of the CPUs busy with other work) unless
  `--allow-busy`, and then marks its figures BUSY; fewer than 3 alternations are marked as not
  a result of the protocol;
- samples/s and tokens/s (response tokens sampled), over the steps after `--warmup`, step time
  as each trainer's own step boundaries show it (TRL's `on_step_begin`/`on_step_end` callbacks,
  the project's `timing/*` phases), once per response budget in `--new-tokens`.
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import json
import os
import statistics
import subprocess
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
    from rlhf_api.sections import ModelSpec
    from rlhf_trainer.bootstrap import ensure_model
    from rlhf_trainer.tiny_model import build_char_tokenizer, build_tiny_model

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
    from rlhf_api.loader import parse_job

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
    import ray

    from rlhf_trainer.controller import run
    from rlhf_trainer.metrics import read_jsonl
    from rlhf_trainer.startup import start_ray

    # Ray gives a local node a fixed 30 s to register; a loaded machine can miss it.
    for attempt in range(1, 4):
        try:
            start_ray()
            break
        except Exception as err:
            if "timed out during startup" not in str(err) or attempt == 3:
                raise
            print(f"project: Ray did not start in time (attempt {attempt} of 3); again", file=sys.stderr)
            ray.shutdown()

    @ray.remote(num_cpus=0)
    def niceness() -> int:
        return os.nice(0)

    workers = ray.get(niceness.remote())  # a worker started as the role workers are
    with tempfile.TemporaryDirectory() as tmp:
        started = time.perf_counter()
        run(project_job(model, prompts, a), run_dir=tmp, resume=False)
        wall = time.perf_counter() - started
        rows = read_jsonl(Path(tmp) / "metrics.jsonl")
    return {
        **summarize(rows, a.warmup, wall),
        "worker niceness": workers,
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
        "tokens/s": sum(r.get("rollout/tokens", float("nan")) for r in measured) / total,
        "step s": total / len(measured),
        "wall s": wall,
        "reward first": rows[0]["reward/mean"],
        "reward last": rows[-1]["reward/mean"],
        "shares": {k.removeprefix("timing/"): sum(r.get(k, 0.0) for r in measured) / total for k in phases},
    }


# --------------------------------------------------------------------------------------------
# The floor: the same arithmetic with no trainer around it
# --------------------------------------------------------------------------------------------


def mask_positions(mask: Any) -> Any:
    """Position ids counted from each row's first real token (as the `hf` engine counts them)."""
    return (mask.cumsum(-1) - 1).clamp(min=0)


def full_log_probs(policy: Any, out: Any) -> Any:
    """`(B, T)` log-probs of the sampled responses from one forward over every row's prompt +
    response (each prompt computed once per sample, the last response token fed for nothing)."""
    import torch

    tokens = torch.cat([out.prompt_ids, out.response_ids], 1)
    mask = torch.cat([out.prompt_mask, out.response_mask.long()], 1)
    width = out.response_ids.shape[1]
    logits = policy(input_ids=tokens, attention_mask=mask, position_ids=mask_positions(mask)).logits
    logits = logits[:, -width - 1 : -1].float()  # (B, T, V): position P+t-1 predicts response token t
    return torch.log_softmax(logits, -1).gather(-1, out.response_ids[..., None]).squeeze(-1)


def prompt_once_log_probs(policy: Any, out: Any, group: int) -> Any:
    """The same `(B, T)` log-probs with each prompt computed once per group (rows of a prompt
    adjacent, `group` of them): a prefix pass over the unique prompts, its KV cache repeated to
    the group (gradients flow back through the repeat), then a suffix pass over the responses
    minus their last token. Equal to `full_log_probs` to float rounding (tested)."""
    import torch

    from rlhf_trainer.rollout.hf import _cache_of

    first = slice(None, None, group)
    prompt_mask = out.prompt_mask[first]  # (B/G, P)
    positions = mask_positions(prompt_mask)
    prefix = policy(
        input_ids=out.prompt_ids[first], attention_mask=prompt_mask, position_ids=positions, use_cache=True
    )
    logits = prefix.logits[:, -1:].repeat_interleave(group, 0)  # (B, 1, V): predicts response token 0
    width = out.response_ids.shape[1]
    if width > 1:
        cache = _cache_of(prefix)
        cache.batch_repeat_interleave(group)
        # transformers 5 renamed `past_key_values` to `cache` (as the `hf` engine handles it).
        cache_kwarg = (
            "cache" if "cache" in inspect.signature(policy.forward).parameters else "past_key_values"
        )
        mask = torch.cat([out.prompt_mask, out.response_mask[:, :-1].long()], 1)  # (B, P+T-1)
        steps = torch.arange(1, width, device=mask.device)[None]  # (1, T-1)
        suffix = policy(
            input_ids=out.response_ids[:, :-1],
            attention_mask=mask,
            position_ids=positions[:, -1:].repeat_interleave(group, 0) + steps,
            use_cache=True,
            **{cache_kwarg: cache},
        )
        logits = torch.cat([logits, suffix.logits], 1)  # (B, T, V)
    return torch.log_softmax(logits.float(), -1).gather(-1, out.response_ids[..., None]).squeeze(-1)


def run_floor(model: Path, prompts: Path, a: argparse.Namespace, once: bool = False) -> dict[str, Any]:
    """What a step costs with nothing but its arithmetic, in this process: sample the batch with
    the KV cache (the project's `hf` engine, a plain decode loop), one forward/backward of the
    same loss over prompt + response (the GRPO surrogate at ratio 1: -advantage * log-prob,
    token mean), one clipped AdamW step. No reward, no advantage bookkeeping, no processes.

    `once` False ("floor", as measured before): every sample's copy of its prompt is prefilled
    and trained on, AdamW is torch's loop. `once` True ("floor once"): each prompt is prefilled
    once (the engine's shared prefill) and computed once in the forward/backward
    (`prompt_once_log_probs`), AdamW fused (`modeling.build_optimizer`): the same math, less of it."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlhf_trainer.rollout.hf import HFRolloutEngine
    from rlhf_trainer.workers.modeling import build_optimizer

    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(model)
    policy = AutoModelForCausalLM.from_pretrained(model)
    engine = HFRolloutEngine(policy, tokenizer, max_new_tokens=a.max_new_tokens, temperature=1.0, seed=0)
    engine.share_prefill = once
    if once:
        optimizer = build_optimizer(policy, a.lr, 0.0)
    else:
        optimizer = torch.optim.AdamW(policy.parameters(), lr=a.lr, weight_decay=0.0, foreach=False)
    rows = [json.loads(line) for line in prompts.read_text().splitlines() if line.strip()]
    seconds, tokens = [], []
    for step in range(a.steps):
        chunk = rows[step * a.prompts : (step + 1) * a.prompts]
        ids = [tokenizer(r["prompt"]).input_ids for r in chunk]
        started = time.perf_counter()
        out = engine.generate(ids, n=a.group)
        policy.train()
        logp = prompt_once_log_probs(policy, out, a.group) if once else full_log_probs(policy, out)
        advantages = torch.randn(len(out.response_ids), 1)  # any advantages: the cost does not depend on them
        loss = -(advantages * logp * out.response_mask).sum() / out.response_mask.sum().clamp(min=1)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        seconds.append(time.perf_counter() - started)
        tokens.append(float(out.response_mask.sum()))
    measured = seconds[a.warmup :]
    return {
        "samples/s": a.prompts * a.group * len(measured) / sum(measured),
        "tokens/s": sum(tokens[a.warmup :]) / sum(measured),
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
    logged = [h for h in trainer.state.log_history if "reward" in h]  # one row per step (logging_steps=1)
    rewards = [h["reward"] for h in logged]
    lengths = [h.get("completions/mean_length", float("nan")) for h in logged][a.warmup :]
    measured = clock.seconds[a.warmup :]
    return {
        "samples/s": batch * len(measured) / sum(measured),
        "tokens/s": batch * sum(lengths) / sum(measured),
        "step s": sum(measured) / len(measured),
        "wall s": wall,
        "reward first": rewards[0] if rewards else float("nan"),
        "reward last": rewards[-1] if rewards else float("nan"),
    }


# --------------------------------------------------------------------------------------------


# The protocol: each contender in a process of its own, alternated, on a quiet machine
# --------------------------------------------------------------------------------------------

#: Every contender, in the order of the first alternation (later ones rotate it).
CONTENDERS = ("project", "trl", "floor", "floor-once")
#: The fewest alternations whose medians the script reports as a result of its protocol.
MIN_ALTERNATIONS = 3


def cpu_busy(seconds: float = 1.0) -> float | None:
    """The fraction of the machine's CPU time spent busy over `seconds` (from /proc/stat; None
    where there is none). Sampled while this script only waits, so it is everyone else's load."""

    def sample() -> tuple[int, int] | None:
        try:
            fields = [int(x) for x in Path("/proc/stat").read_text().split("\n")[0].split()[1:]]
        except (OSError, ValueError):
            return None
        return sum(fields), fields[3] + fields[4]  # total, idle + iowait

    first = sample()
    time.sleep(seconds)
    second = sample()
    if first is None or second is None or second[0] == first[0]:
        return None
    return 1.0 - (second[1] - first[1]) / (second[0] - first[0])


def machine_state() -> dict[str, Any]:
    """The load average (1, 5, 15 min) and the busy fraction of the CPUs right now."""
    return {"load": os.getloadavg(), "busy": cpu_busy(), "cpus": os.cpu_count() or 1}


def busy_reason(state: dict[str, Any], max_busy: float) -> str | None:
    """Why the machine counts as busy for a benchmark (None: quiet). The busy fraction is the
    measure (the load average lags by minutes and still counts the previous contender); a
    1-minute load above the CPU count flags an overloaded machine where /proc/stat is missing."""
    busy, load, cpus = state["busy"], state["load"][0], state["cpus"]
    if busy is not None and busy > max_busy:
        return f"{busy:.0%} of the CPUs busy with other work (more than --max-busy {max_busy:.0%})"
    if load > cpus:
        return f"load average {load:.2f} over {cpus} CPUs"
    return None


def describe(state: dict[str, Any]) -> str:
    busy = "?" if state["busy"] is None else f"{state['busy']:.0%}"
    return f"load {' '.join(f'{x:.2f}' for x in state['load'])}, CPUs busy {busy}"


def child_args(a: argparse.Namespace, max_new_tokens: int) -> list[str]:
    """The job's arguments, as the child process receives them."""
    return [
        f"--steps={a.steps}", f"--warmup={a.warmup}", f"--prompts={a.prompts}", f"--group={a.group}",
        f"--max-new-tokens={max_new_tokens}", f"--lr={a.lr}", f"--threads={a.threads}",
    ]  # fmt: skip


def run_contender(
    contender: str, model: Path, prompts: Path, a: argparse.Namespace, max_new_tokens: int, out: Path
) -> dict[str, Any]:
    """One run of `contender` in a fresh process (a fresh Ray instance for the project), at this
    script's niceness, with `--threads` torch threads offered to it; its figures and the machine
    before and after."""
    env = dict(os.environ)
    env["RLHF_TORCH_THREADS"] = str(a.threads)  # the project's workers, as the others' process
    cmd = [
        sys.executable,
        __file__,
        "--child",
        contender,
        "--model",
        str(model),
        "--prompt-file",
        str(prompts),
    ]
    cmd += ["--out", str(out), *child_args(a, max_new_tokens)]
    before = machine_state()
    res = subprocess.run(cmd, env=env, capture_output=True, text=True)
    after = machine_state()
    if res.returncode != 0:
        raise SystemExit(f"{contender} failed ({res.returncode}):\n{res.stderr[-3000:]}")
    return {**json.loads(out.read_text()), "before": before, "after": after}


def child(a: argparse.Namespace) -> int:
    """In the contender's own process: run it, write its figures (and its priority) as JSON."""
    import torch

    torch.set_num_threads(a.threads)
    runners = {
        "project": lambda: run_project(a.model, a.prompt_file, a),
        "trl": lambda: run_trl(a.model, a.prompt_file, a, a.out.parent),
        "floor": lambda: run_floor(a.model, a.prompt_file, a),
        "floor-once": lambda: run_floor(a.model, a.prompt_file, a, once=True),
    }
    result = runners[a.child]()
    result |= {"niceness": os.nice(0), "threads": torch.get_num_threads()}
    a.out.write_text(json.dumps(result))
    return 0


def spread(values: list[float]) -> str:
    med = statistics.median(values)
    return f"{med:>9.3f} ({min(values):.3f}-{max(values):.3f})"


def report(
    size: str, max_new_tokens: int, runs: dict[str, list[dict[str, Any]]], a: argparse.Namespace
) -> None:
    """The table of one (size, response budget): medians over the alternations with their range."""
    n = len(next(iter(runs.values())))
    print(f"\n== {size}, {max_new_tokens} new tokens: median of {n} alternations (min-max)")
    print(f"{'':12s}{'samples/s':>24s}{'tokens/s':>24s}{'step s':>24s}")
    for name, rs in runs.items():
        cells = "".join(f"{spread([r[k] for r in rs]):>24s}" for k in ("samples/s", "tokens/s", "step s"))
        print(f"{name:12s}{cells}")
    if n < MIN_ALTERNATIONS:
        print(f"NOT A RESULT OF THE PROTOCOL: {n} alternation(s), fewer than {MIN_ALTERNATIONS}")
    med = {k: statistics.median(r["samples/s"] for r in v) for k, v in runs.items()}
    if "project" in runs:
        for other in (k for k in runs if k != "project"):
            per = [p["samples/s"] / o["samples/s"] for p, o in zip(runs["project"], runs[other])]
            print(
                f"project / {other} samples/s: {med['project'] / med[other]:.2f} (per alternation {min(per):.2f}-{max(per):.2f})"
            )
    if "trl" in runs:
        for floor in (k for k in ("floor", "floor-once") if k in runs):
            print(f"TRL / {floor} samples/s: {med['trl'] / med[floor]:.2f}")
    nice = ", ".join(f"{k} {sorted({r['niceness'] for r in v})}" for k, v in runs.items())
    threads = ", ".join(f"{k} {sorted({r['threads'] for r in v})}" for k, v in runs.items())
    if "project" in runs:
        nice += f"; the project's Ray workers {sorted({r['worker niceness'] for r in runs['project']})}"
    print(f"niceness: {nice}; torch threads: {threads}")
    busy = [(k, i) for k, v in runs.items() for i, r in enumerate(v) if busy_reason(r["before"], a.max_busy)]
    if busy:
        print(f"BUSY MACHINE: {len(busy)} of {n * len(runs)} runs started on a busy machine: {busy}")
    if "project" in runs:
        first = runs["project"][0]
        print(
            f"project: rewards {first['reward first']:.3f} -> {first['reward last']:.3f}; share of step time per phase (first run):"
        )
        for phase, share in sorted(first["shares"].items(), key=lambda kv: -kv[1]):
            print(f"  {phase:26s}{share:>8.1%}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="tiny,30m", help=f"comma-separated, of {', '.join(SIZES)}")
    parser.add_argument(
        "--new-tokens", default="4,64", help="comma-separated response budgets, one table each (default 4,64)"
    )
    parser.add_argument(
        "--contenders", default=",".join(CONTENDERS), help=f"comma-separated, of {', '.join(CONTENDERS)}"
    )
    parser.add_argument(
        "--alternations", type=int, default=MIN_ALTERNATIONS, help="runs of each contender, alternated"
    )
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3, help="first steps left out of the rates")
    parser.add_argument("--prompts", type=int, default=8, help="prompts per step")
    parser.add_argument("--group", type=int, default=8, help="responses per prompt (GRPO group)")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="intra-op torch threads offered to every contender's process (the project's workers each)",
    )
    parser.add_argument(
        "--max-busy", type=float, default=0.15, help="busiest CPU fraction that counts as quiet"
    )
    parser.add_argument(
        "--allow-busy", action="store_true", help="run on a busy machine (the output says so)"
    )
    parser.add_argument("--child", choices=CONTENDERS, help=argparse.SUPPRESS)
    parser.add_argument("--model", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--prompt-file", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--max-new-tokens", type=int, default=4, help=argparse.SUPPRESS)
    a = parser.parse_args(argv)
    if a.child:
        return child(a)
    sizes, contenders = (
        _listed(parser, "--sizes", a.sizes, SIZES),
        _listed(parser, "--contenders", a.contenders, CONTENDERS),
    )
    try:
        budgets = [int(x) for x in a.new_tokens.split(",") if x]
    except ValueError:
        parser.error(f"--new-tokens {a.new_tokens}: expected comma-separated integers, e.g. 4,64")
    if not budgets or min(budgets) < 1:
        parser.error(f"--new-tokens {a.new_tokens}: each budget must be at least 1")
    if a.steps <= a.warmup:
        parser.error("--steps must exceed --warmup")
    if a.alternations < 1:
        parser.error(f"--alternations {a.alternations}: at least 1 ({MIN_ALTERNATIONS} for a result)")
    if "trl" in contenders and importlib.util.find_spec("trl") is None:
        parser.error("TRL is not installed: pip install -e '.[bench]' (or leave trl out of --contenders)")
    state = machine_state()
    print(f"machine before: {describe(state)}; this script at niceness {os.nice(0)}")
    why = busy_reason(state, a.max_busy)
    if why and not a.allow_busy:
        parser.exit(
            3,
            f"vs_trl: the machine is busy ({why}): its figures would not compare; run it on a quiet machine, or pass --allow-busy (the output then says BUSY)\n",
        )
    if why:
        print(f"BUSY MACHINE ({why}): --allow-busy given; the figures below are not a quiet machine's")
    from rlhf_trainer.bootstrap import write_prompts

    print(
        f"GRPO, {a.prompts} prompts x {a.group} samples per step, lr {a.lr}, {a.steps} steps "
        f"({a.steps - a.warmup} measured), {a.threads} torch thread(s) per process, {a.alternations} alternations"
    )
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        prompts = write_prompts("tiny-arithmetic", out / "prompts.jsonl", n=4096, seed=0)
        for size in sizes:
            model = make_model(size, out)
            print(f"\n{size}: {parameters(model) / 1e6:.1f}M parameters")
            for budget in budgets:
                runs: dict[str, list[dict[str, Any]]] = {c: [] for c in contenders}
                for i in range(a.alternations):
                    order = contenders[i % len(contenders) :] + contenders[: i % len(contenders)]
                    for c in order:
                        r = run_contender(c, model, prompts, a, budget, out / f"{size}-{budget}-{c}-{i}.json")
                        runs[c].append(r)
                        print(
                            f"  [{budget} tokens, alternation {i + 1}] {c}: {r['samples/s']:.3f} samples/s; "
                            f"{describe(r['before'])} -> {describe(r['after'])}",
                            flush=True,
                        )
                report(size, budget, runs, a)
    print(f"\nmachine after: {describe(machine_state())}")
    return 0


def _listed(parser: argparse.ArgumentParser, flag: str, value: str, valid: Any) -> list[str]:
    names = [x for x in value.split(",") if x]
    unknown = [x for x in names if x not in valid]
    if unknown or not names:
        parser.error(
            f"{flag} {value}: unknown {', '.join(unknown) or '(none given)'}; valid: {', '.join(valid)}"
        )
    return names


if __name__ == "__main__":
    sys.exit(main())
