"""The `tiny-calculator` bootstrap recipe: a tiny model that can call the calculator tool.

The task is two-digit multiplication, `37*48=`, which a 2-layer character model cannot do in its
head. The supervised warm-up teaches it both ways to answer: a guess (the product written
directly: mostly wrong) and, for `tool_rate` of the examples, the tool call
`<tool>37*48</tool>`, then, after the environment's `<result>1776</result>`, the result copied
(right whenever the copy is). It learns to copy but calls the tool only about as often as
taught; reinforcement learning with the exact-answer reward then raises the call rate
(`manifests/examples/multiturn-calculator.yaml`).
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


@dataclass
class MultiplicationTask:
    """`a*b=` with two-digit `a`, `b`; the answer is the product."""

    low: int = 10
    high: int = 99

    def sample(self, rng: random.Random) -> tuple[str, str]:
        a, b = rng.randint(self.low, self.high), rng.randint(self.low, self.high)
        return f"{a}*{b}=", str(a * b)

    def rows(self, n: int, seed: int) -> list[dict[str, Any]]:
        rng = random.Random(seed)
        return [dict(zip(("prompt", "answer"), self.sample(rng))) for _ in range(n)]


def _example(tokenizer: Any, env: Any, prompt: str, answer: str, tool: bool) -> tuple[list[int], list[int]]:
    """`(ids, labels)` of one supervised episode: labels -100 on the prompt and on the
    environment's tokens (the model never learns to write the tool's result itself)."""
    ids = tokenizer(prompt).input_ids
    labels = [-100] * len(ids)

    def add(text: str, learn: bool) -> None:
        piece = tokenizer(text, add_special_tokens=False).input_ids
        ids.extend(piece)
        labels.extend(piece if learn else [-100] * len(piece))

    if tool:
        add(f"{env.open}{prompt.rstrip('=')}{env.close}", True)
        add(f"{env.result_open}{answer}{env.result_close}", False)
    add(answer, True)
    ids.append(tokenizer.eos_token_id)
    labels.append(tokenizer.eos_token_id)
    return ids, labels


def episode_stats(
    model: Any, tokenizer: Any, env: Any, pairs: list[tuple[str, str]], seed: int = 0
) -> dict[str, float]:
    """Sampled episodes of `pairs`: the tool-call rate, the accuracy, and the accuracy of the
    episodes that called the tool."""
    from rlhf_trainer.rewards.builtin import final_turn_exact
    from rlhf_trainer.rollout.hf import HFRolloutEngine
    from rlhf_trainer.rollout.multiturn import final_turns, rollout_episodes

    engine = HFRolloutEngine(model, tokenizer, max_new_tokens=20, temperature=1.0, seed=seed)
    batch = rollout_episodes(
        engine, tokenizer, env, [tokenizer(p).input_ids for p, _ in pairs], max_turns=2, max_total_tokens=48
    )
    assert batch.observation_mask is not None
    called = (batch.observation_mask.sum(-1) > 0).tolist()
    right = final_turn_exact([], [], answer=[a for _, a in pairs], final_turn=final_turns(batch, tokenizer))
    n_called = max(1, sum(called))
    return {
        "tool_call_rate": sum(called) / len(pairs),
        "accuracy": sum(right) / len(pairs),
        "tool_accuracy": sum(r for r, c in zip(right, called) if c) / n_called,
    }


def warm_up(
    model: Any,
    tokenizer: Any,
    *,
    seed: int = 0,
    tool_rate: float = 0.25,
    batch_size: int = 64,
    learning_rate: float = 3e-3,
    max_steps: int = 1500,
    eval_every: int = 100,
    target_tool_accuracy: float = 0.85,
) -> dict[str, Any]:
    """Supervised steps until sampled tool-calling episodes are right `target_tool_accuracy` of
    the time (or `max_steps`); deterministic for a seed."""
    import torch

    from rlhf_trainer.environments.calculator import CalculatorEnv

    task, env = MultiplicationTask(), CalculatorEnv()
    torch.manual_seed(seed)
    rng = random.Random(seed)
    held_out = [task.sample(random.Random(10_000 + seed + i)) for i in range(200)]
    opt = torch.optim.AdamW(model.parameters(), lr=learning_rate)
    start, stats, step = time.monotonic(), {}, 0
    for step in range(1, max_steps + 1):
        model.train()
        rows = [
            _example(tokenizer, env, *task.sample(rng), tool=rng.random() < tool_rate)
            for _ in range(batch_size)
        ]
        width = max(len(i) for i, _ in rows)
        pad = tokenizer.pad_token_id
        ids = torch.tensor([i + [pad] * (width - len(i)) for i, _ in rows])
        mask = torch.tensor([[1] * len(i) + [0] * (width - len(i)) for i, _ in rows])
        labels = torch.tensor([lab + [-100] * (width - len(lab)) for _, lab in rows])
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % eval_every == 0:
            model.eval()
            stats = episode_stats(model, tokenizer, env, held_out, seed=seed)
            log.info("tiny-calculator warm-up step %d loss %.3f %s", step, loss.item(), stats)
            if stats["tool_accuracy"] >= target_tool_accuracy:
                break
    model.eval()
    return {"warmup_steps": step, "warmup_seconds": round(time.monotonic() - start, 2), **stats}


def build(path: Path, seed: int) -> dict[str, Any]:
    """The recipe's `build`: tokenizer and tiny Llama of `bootstrap`, warmed up on the task."""
    from rlhf_trainer.tiny_model import build_char_tokenizer, build_tiny_model

    tokenizer = build_char_tokenizer()
    model = build_tiny_model(tokenizer, seed=seed)
    facts = warm_up(model, tokenizer, seed=seed)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return {"task": "two-digit multiplication with a calculator tool", **facts}
