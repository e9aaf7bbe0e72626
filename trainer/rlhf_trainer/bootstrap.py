"""Built-in bootstrap recipes: create a tiny model, tokenizer and prompt file locally.

`ensure_model(model_spec)` creates `model_spec.path` from the recipe named by
`model_spec.bootstrap` when that directory does not exist yet. Creation is atomic (built in a
temporary sibling directory, then renamed) and guarded by a file lock, so concurrent processes
(several Ray workers, two runs) never see a half-written model and build it only once. Nothing
is ever downloaded.

Recipe `tiny-arithmetic`: prompts `"a+b="` with `0 <= a, b <= 9`, answer `a+b` in decimal then
EOS. The tokenizer is character-level (`tokenizers` WordLevel over printable ASCII, wrapped as
`PreTrainedTokenizerFast`, BOS prepended, left padding). The model is a 2-layer Llama with
hidden size 64 in 2 heads of 32 (vLLM's CPU attention kernels take head sizes that are multiples
of 32, so the `vllm` engine runs it too), warmed up by a few seconds of supervised training on a deliberately sloppy
corpus: 70% of its answers end with a stray `"."`. Warm-up stops once the greedy answers are
right (stray suffix ignored) on 97% of held-out problems, so the model knows how to add but
usually answers in the wrong format: the exact-match reward (`rewards.builtin:arithmetic_exact`)
starts low but nonzero (about 0.2 when sampling at temperature 1). RL has to learn to stop
right after the number, one behaviour shared by every prompt, which it does within a few dozen
steps: in `--check`, 60 steps of plain REINFORCE (16 prompts x 8 samples, learning rate 1e-3)
take the mean reward from about 0.2 over the first 6 steps to about 0.73 over the last 6, in
about 10-25 s of CPU. Learning rates of 2e-3 and above were unstable for this model there.

`python -m rlhf_trainer.bootstrap --check` proves the task is learnable by RL: it builds the
model in a temporary folder and runs a plain in-process policy-gradient loop (REINFORCE with a
per-prompt group-mean baseline) using the `hf` rollout engine and the `arithmetic_exact` reward,
printing the mean reward per step.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import logging
import os
import random
import re
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlhf_trainer.tiny_model import build_char_tokenizer, build_tiny_model

log = logging.getLogger(__name__)

_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")


# --------------------------------------------------------------------------------------------
# Recipes
# --------------------------------------------------------------------------------------------


@dataclass
class ArithmeticTask:
    """Addition `a+b=` with `0 <= a, b <= max_operand`; the answer is `a+b` in decimal."""

    max_operand: int = 9

    def sample(self, rng: random.Random) -> tuple[str, str]:
        a, b = rng.randint(0, self.max_operand), rng.randint(0, self.max_operand)
        return f"{a}+{b}=", str(a + b)

    def rows(self, n: int, seed: int) -> list[dict[str, Any]]:
        rng = random.Random(seed)
        out = []
        for _ in range(n):
            prompt, answer = self.sample(rng)
            out.append({"prompt": prompt, "answer": answer})
        return out


@dataclass
class Recipe:
    """A named way to create a model directory and matching prompts."""

    name: str
    build: Callable[[Path, int], dict[str, Any]]
    """Writes model + tokenizer into the (empty) directory; returns facts for `bootstrap.json`."""
    rows: Callable[[int, int], list[dict[str, Any]]]
    """`rows(n, seed)`: prompt-file rows (`prompt` plus reward columns)."""
    reward: str
    """Import path of the matching reward function."""
    version: int = 1
    """Bumped whenever `build` or `rows` change what they produce: a model directory or prompt file
    made by an older version of the recipe is rebuilt (never a directory the recipe did not make)."""


def _build_tiny_arithmetic(path: Path, seed: int) -> dict[str, Any]:
    task = ArithmeticTask()
    tokenizer = build_char_tokenizer()
    model = build_tiny_model(tokenizer, seed=seed)
    facts = warm_up(model, tokenizer, task, seed=seed)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return {"task": f"addition a+b, 0 <= a,b <= {task.max_operand}", **facts}


RECIPES: dict[str, Recipe] = {
    "tiny-arithmetic": Recipe(
        name="tiny-arithmetic",
        build=_build_tiny_arithmetic,
        rows=lambda n, seed: ArithmeticTask().rows(n, seed),
        reward="rlhf_trainer.rewards.builtin:arithmetic_exact",
        # 3: 2 attention heads of 32 (was 4 of 16, which vLLM's CPU kernels do not take);
        # 2: operands 0-9, warm-up on answers with a stray "." (1 and unversioned: 0-19, plain warm-up)
        version=3,
    ),
    # Multi-turn: two-digit products the model answers by calling the calculator tool
    # (`tiny_calculator`; manifests/examples/multiturn-calculator.yaml).
    "tiny-calculator": Recipe(
        name="tiny-calculator",
        build=lambda path, seed: _tiny_calculator().build(path, seed),
        rows=lambda n, seed: _tiny_calculator().MultiplicationTask().rows(n, seed),
        reward="rlhf_trainer.rewards.builtin:final_turn_exact",
        version=1,
    ),
}


def _tiny_calculator() -> Any:
    from rlhf_trainer import tiny_calculator

    return tiny_calculator


def get_recipe(name: str) -> Recipe:
    if name not in RECIPES:
        raise ValueError(f"unknown bootstrap recipe {name!r}; valid: {', '.join(sorted(RECIPES))}")
    return RECIPES[name]


# --------------------------------------------------------------------------------------------
# Supervised warm-up
# --------------------------------------------------------------------------------------------


def _encode_examples(
    tokenizer: Any,
    pairs: list[tuple[str, str]],
    memo: dict[tuple[str, str], tuple[list[int], list[int]]] | None = None,
) -> tuple[Any, Any, Any]:
    """Right-padded `(input_ids, attention_mask, labels)` for `BOS prompt answer EOS`, loss on answer+EOS.

    `memo` caches each pair's token ids: the task has few distinct problems, and tokenizing them
    anew every step was a third of the warm-up's time."""
    import torch

    memo = {} if memo is None else memo
    rows = []
    for pair in pairs:
        if pair not in memo:
            p = tokenizer(pair[0]).input_ids
            a = tokenizer(pair[1], add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
            memo[pair] = (p + a, [-100] * len(p) + a)
        rows.append(memo[pair])
    width = max(len(seq) for seq, _ in rows)
    pad = tokenizer.pad_token_id
    ids = torch.tensor([seq + [pad] * (width - len(seq)) for seq, _ in rows])
    mask = torch.tensor([[1] * len(seq) + [0] * (width - len(seq)) for seq, _ in rows])
    labels = torch.tensor([lab + [-100] * (width - len(lab)) for _, lab in rows])
    return ids, mask, labels


def greedy_accuracy(
    model: Any, tokenizer: Any, pairs: list[tuple[str, str]], max_new_tokens: int = 4, strip: str = ""
) -> float:
    """Fraction of `pairs` whose greedy response is the answer (after removing trailing `strip` chars)."""
    from rlhf_trainer.rollout.batch import decode_responses
    from rlhf_trainer.rollout.hf import HFRolloutEngine

    engine = HFRolloutEngine(model, tokenizer, max_new_tokens=max_new_tokens, temperature=0.0)
    batch = engine.generate([tokenizer(p).input_ids for p, _ in pairs])
    texts = decode_responses(batch, tokenizer)
    return sum(t.strip().rstrip(strip) == a for t, (_, a) in zip(texts, pairs)) / len(pairs)


def warm_up(
    model: Any,
    tokenizer: Any,
    task: ArithmeticTask,
    *,
    seed: int = 0,
    target_accuracy: float = 0.97,
    stray_suffix: str = ".",
    stray_rate: float = 0.7,
    batch_size: int = 64,
    learning_rate: float = 3e-3,
    eval_every: int = 20,
    max_steps: int = 600,
) -> dict[str, Any]:
    """Supervised training on the task until the greedy answers of held-out problems are right
    (ignoring a stray suffix) `target_accuracy` of the time (checked every `eval_every` steps) or
    `max_steps`. A fraction `stray_rate` of the training answers end with `stray_suffix`, so the
    model learns to answer in the wrong format most of the time. Deterministic for a seed."""
    import torch

    torch.manual_seed(seed)
    rng = random.Random(seed)
    eval_pairs = [task.sample(random.Random(10_000 + seed + i)) for i in range(200)]
    opt = torch.optim.AdamW(model.parameters(), lr=learning_rate)
    memo: dict[tuple[str, str], tuple[list[int], list[int]]] = {}
    start = time.monotonic()
    acc, step = 0.0, 0
    for step in range(1, max_steps + 1):
        model.train()
        pairs = [task.sample(rng) for _ in range(batch_size)]
        pairs = [(p, a + stray_suffix if rng.random() < stray_rate else a) for p, a in pairs]
        ids, mask, labels = _encode_examples(tokenizer, pairs, memo)
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % eval_every == 0:
            model.eval()
            acc = greedy_accuracy(model, tokenizer, eval_pairs, strip=stray_suffix)
            log.debug("warm-up step %d loss %.3f greedy accuracy %.3f", step, loss.item(), acc)
            if acc >= target_accuracy:
                break
    model.eval()
    seconds = time.monotonic() - start
    log.info("warm-up: %d supervised steps in %.1fs, greedy accuracy %.2f", step, seconds, acc)
    return {"warmup_steps": step, "warmup_seconds": round(seconds, 2), "warmup_greedy_accuracy": acc}


# --------------------------------------------------------------------------------------------
# ensure_model / write_prompts
# --------------------------------------------------------------------------------------------


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """Run the block with `n` torch intra-op threads. A model this small gains nothing from more, and
    on a shared machine extra threads spin against each other (10x slower on 2 busy cores)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@contextlib.contextmanager
def _file_lock(target: Path) -> Iterator[None]:
    """An exclusive `flock` on `<target>.lock` (a sibling file), held for the block."""
    lock_path = target.parent / f".{target.name}.lock"
    with open(lock_path, "a+") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def _looks_like_hub_id(path: str) -> bool:
    return bool(_HUB_ID.match(path)) and not path.startswith((".", "/", "~"))


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _is_stale(made_by: dict[str, Any] | None, recipe: Recipe) -> bool:
    """True when `made_by` (a bootstrap.json) says an older version of this recipe made the thing."""
    return (
        made_by is not None
        and made_by.get("recipe") == recipe.name
        and made_by.get("version") != recipe.version
    )


def ensure_model(model_spec: Any) -> None:
    """Make sure `model_spec.path` exists, creating it from `model_spec.bootstrap` if needed.

    Without a bootstrap recipe, a missing local path is an error naming it (a `org/name` hub id
    is left to the loader). A directory that an older version of the same recipe made (its
    `bootstrap.json` says so) is rebuilt and swapped in; any other existing directory is used as
    it is. Safe to call from several processes at once.
    """
    path = Path(model_spec.path).expanduser()
    recipe = get_recipe(model_spec.bootstrap) if model_spec.bootstrap else None
    if path.exists() and (recipe is None or not _is_stale(_read_json(path / "bootstrap.json"), recipe)):
        return
    if recipe is None:
        if _looks_like_hub_id(model_spec.path):
            return
        raise FileNotFoundError(
            f"model.path {model_spec.path!r} does not exist; give a local model directory, or set "
            f"model.bootstrap to one of {', '.join(sorted(RECIPES))} to create a tiny model there"
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(path):
        stale = path.exists() and _is_stale(_read_json(path / "bootstrap.json"), recipe)
        if path.exists() and not stale:  # another process built it while we waited for the lock
            return
        tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
        try:
            log.info(
                "%s model %s with recipe %s v%d",
                "rebuilding stale" if stale else "bootstrapping",
                path,
                recipe.name,
                recipe.version,
            )
            with torch_threads(1):
                facts = recipe.build(tmp, 0)
            made_by = {"recipe": recipe.name, "version": recipe.version, "reward": recipe.reward, **facts}
            (tmp / "bootstrap.json").write_text(json.dumps(made_by, indent=2) + "\n")
            if stale:
                old = Path(tempfile.mkdtemp(prefix=f".{path.name}.old-", dir=path.parent))
                os.rename(path, old / "model")
                os.rename(tmp, path)
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.rename(tmp, path)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise


def _prompts_stamp(out: Path) -> Path:
    return out.parent / f".{out.name}.bootstrap.json"


def write_prompts(recipe: str, path: str | Path, n: int, seed: int = 0) -> Path:
    """Write `n` prompt rows of `recipe` as JSONL (`prompt` and `answer` columns), atomically, with a
    hidden `.<name>.bootstrap.json` beside it recording the recipe version."""
    r = get_recipe(recipe)
    rows = r.rows(n, seed)
    out = Path(path).expanduser()
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.tmp-", dir=out.parent)
    with os.fdopen(fd, "w") as fh:
        for row in rows:
            fh.write(json.dumps(row) + "\n")
    os.replace(tmp, out)
    _prompts_stamp(out).write_text(
        json.dumps({"recipe": r.name, "version": r.version, "n": n, "seed": seed}) + "\n"
    )
    return out


def ensure_prompts(recipe: str, path: str | Path, n: int, seed: int = 0) -> Path:
    """`write_prompts` unless the file exists (and was not written by an older version of the
    recipe); locked like `ensure_model`."""
    r = get_recipe(recipe)
    out = Path(path).expanduser()
    if out.exists() and not _is_stale(_read_json(_prompts_stamp(out)), r):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(out):
        if not out.exists() or _is_stale(_read_json(_prompts_stamp(out)), r):
            write_prompts(recipe, out, n, seed)
    return out


# --------------------------------------------------------------------------------------------
# Learnability check: python -m rlhf_trainer.bootstrap --check
# --------------------------------------------------------------------------------------------


def reinforce_check(
    model_dir: str | Path,
    *,
    steps: int = 60,
    prompts_per_step: int = 16,
    samples_per_prompt: int = 8,
    learning_rate: float = 1e-3,
    temperature: float = 1.0,
    normalize_std: bool = True,
    max_operand: int = 9,
    seed: int = 0,
    report: Callable[[str], None] = print,
) -> list[float]:
    """In-process REINFORCE with a group-mean baseline on `tiny-arithmetic`; returns mean reward per step."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlhf_trainer.rewards.builtin import arithmetic_exact
    from rlhf_trainer.rollout.batch import decode_responses
    from rlhf_trainer.rollout.hf import HFRolloutEngine

    torch.manual_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    engine = HFRolloutEngine(model, tokenizer, max_new_tokens=4, temperature=temperature, seed=seed)
    opt = torch.optim.AdamW(model.parameters(), lr=learning_rate)
    rows = ArithmeticTask(max_operand).rows(steps * prompts_per_step, seed)
    rewards: list[float] = []
    start = time.monotonic()
    for step in range(steps):
        chosen = rows[step * prompts_per_step : (step + 1) * prompts_per_step]
        batch = engine.generate([tokenizer(r["prompt"]).input_ids for r in chosen], n=samples_per_prompt)
        texts = decode_responses(batch, tokenizer)
        answers = [chosen[i]["answer"] for i in batch.prompt_index]
        scores = torch.tensor(arithmetic_exact([], texts, answer=answers))  # (B,)
        grouped = scores.view(prompts_per_step, samples_per_prompt)  # (N, G)
        adv = grouped - grouped.mean(-1, keepdim=True)  # (N, G)
        if normalize_std:  # GRPO's scaling (Shao et al. 2024)
            adv = adv / (grouped.std(-1, keepdim=True) + 1e-6)
        adv = adv.view(-1)  # (B,)
        ids, mask = batch.sequences()  # (B, P+T)
        p_len = batch.prompt_ids.shape[1]
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        model.train()
        logits = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits  # (B, P+T, V)
        logp = torch.log_softmax(logits[:, p_len - 1 : -1].float() / temperature, -1)  # (B, T, V)
        token_logp = logp.gather(-1, batch.response_ids[..., None]).squeeze(-1)  # (B, T)
        loss = -(adv[:, None] * token_logp * batch.response_mask).sum() / batch.response_mask.sum()
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        rewards.append(float(scores.mean()))
        report(f"step {step:3d}  mean reward {rewards[-1]:.3f}  ({time.monotonic() - start:.1f}s)")
    return rewards


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m rlhf_trainer.bootstrap", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--recipe", default="tiny-arithmetic", choices=sorted(RECIPES))
    parser.add_argument("--model-dir", help="where to build the model (default: a temporary folder)")
    parser.add_argument("--prompts", help="also write a prompt file here")
    parser.add_argument("--n-prompts", type=int, default=2048)
    parser.add_argument(
        "--check", action="store_true", help="run the in-process REINFORCE learnability check"
    )
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    with tempfile.TemporaryDirectory() as scratch:
        model_dir = args.model_dir or str(Path(scratch) / "model")
        start = time.monotonic()
        ensure_model(argparse.Namespace(path=model_dir, bootstrap=args.recipe))
        print(f"model ready at {model_dir} in {time.monotonic() - start:.1f}s")
        if args.prompts:
            print(f"prompts written to {write_prompts(args.recipe, args.prompts, args.n_prompts, args.seed)}")
        if args.check:
            with torch_threads(1):
                r = reinforce_check(model_dir, steps=args.steps, learning_rate=args.lr, seed=args.seed)
            k = max(1, len(r) // 10)
            first, last = sum(r[:k]) / k, sum(r[-k:]) / k
            print(f"mean reward: first {k} steps {first:.3f} -> last {k} steps {last:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
