"""TEMPORARY stand-ins for components being written concurrently (data, rewards, metrics).
Removed as soon as the real modules land."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class PromptItem:
    index: int
    text: str
    ids: list[int]
    columns: dict[str, Any] = field(default_factory=dict)


class PromptDataset:
    def __init__(self, spec: Any, tokenizer: Any, seed: int = 0):
        p = Path(spec.path)
        if not p.is_file():
            raise FileNotFoundError(f"spec.data.path: {spec.path!r} cannot be read")
        self.rows = [json.loads(line) for line in p.read_text().splitlines() if line.strip()]
        if not self.rows:
            raise ValueError(f"spec.data.path: {spec.path!r} holds no prompts")
        self.spec, self.tok, self.seed = spec, tokenizer, seed
        self.epoch, self.pos, self.skipped, self.consumed = 0, 0, 0, 0
        self._order()

    def _order(self) -> None:
        self.order = list(range(len(self.rows)))
        random.Random(self.seed + self.epoch).shuffle(self.order)

    def next_batch(self, n: int) -> list[PromptItem]:
        out: list[PromptItem] = []
        while len(out) < n:
            if self.pos >= len(self.order):
                self.epoch, self.pos = self.epoch + 1, 0
                self._order()
            i = self.order[self.pos]
            self.pos += 1
            row = self.rows[i]
            text = row[self.spec.prompt_field]
            ids = self.tok(text).input_ids
            if len(ids) > self.spec.max_prompt_length:
                if self.spec.overlong_prompts == "error":
                    raise ValueError(f"prompt {i} has {len(ids)} tokens > maxPromptLength")
                self.skipped += 1
                continue
            self.consumed += 1
            out.append(
                PromptItem(i, text, ids, {k: v for k, v in row.items() if k != self.spec.prompt_field})
            )
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "pos": self.pos, "skipped": self.skipped, "consumed": self.consumed}

    def load_state_dict(self, s: dict[str, Any]) -> None:
        self.epoch, self.pos, self.skipped, self.consumed = s["epoch"], s["pos"], s["skipped"], s["consumed"]
        self._order()


@dataclass
class RewardResult:
    scores: list[float]
    valid: list[bool]
    errors: list[str]
    per_reward: dict[str, list[float]]


class CombinedReward:
    def __init__(self, spec: Any):
        from rlhf_trainer.algorithms.registry import Registry

        self.spec = spec
        self.fns = [(Registry[Any]("reward").get(f.path), f.weight, f.path) for f in spec.functions]

    @classmethod
    def from_spec(cls, spec: Any) -> CombinedReward:
        return cls(spec)

    def compute(
        self, prompts: list[str], responses: list[str], columns: list[dict[str, Any]]
    ) -> RewardResult:
        kw = {k: [c.get(k) for c in columns] for k in (columns[0] if columns else {})}
        total = [0.0] * len(responses)
        valid = [True] * len(responses)
        errors: list[str] = []
        per: dict[str, list[float]] = {}
        for fn, w, name in self.fns:
            try:
                vals = [float(v) for v in fn(prompts, responses, **kw)]
            except Exception as err:
                if self.spec.on_error == "fail":
                    raise
                errors.append(f"{name}: {err}")
                valid = [False] * len(responses)
                vals = [0.0] * len(responses)
            per[name] = vals
            total = [t + w * v for t, v in zip(total, vals)]
        return RewardResult(total, valid, errors, per)


class JsonlLogger:
    def __init__(self, path: Path):
        self.path = Path(path)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        with self.path.open("a") as fh:
            fh.write(json.dumps({"step": step, **metrics}) + "\n")


class MetricsServer:
    def __init__(self, port: int):
        self.port = port

    def update(self, step: int, metrics: dict[str, float]) -> None:
        pass
