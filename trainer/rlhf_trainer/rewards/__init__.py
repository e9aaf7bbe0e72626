"""Rewards: the `RewardCalculator` protocol, Python function rewards, a reward-model scorer, and
`CombinedReward`, the weighted sum the reward role computes.

Error policy (`spec.reward.onError`). A reward "fails" on a sample when it raises, returns a
non-number, NaN or ±inf, or returns the wrong number of scores. A batched call that raises (or
returns the wrong length) is retried one sample at a time to find the offending sample(s); the
others keep their scores. Each failure becomes a `RewardError` naming the sample index, prompt,
response, reward and message, and then:

* `skip`: the sample's `valid` is False and its score is NaN (the trainer drops it from the
  update; NaN rather than a number, so a caller that forgets `valid` fails loudly);
* `penalty`: the sample's score is `error_penalty` (valid stays True);
* `fail`: `RewardFailure` is raised naming the first failed sample.

A failure is never turned into a silent zero.
"""

from __future__ import annotations

import inspect
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from rlhf_trainer import user_code

log = logging.getLogger(__name__)

__all__ = [
    "CombinedReward",
    "FunctionReward",
    "RewardCalculator",
    "RewardError",
    "RewardFailure",
    "RewardModelScorer",
    "RewardResult",
    "import_object",
    "reward_object",
]


@runtime_checkable
class RewardCalculator(Protocol):
    """Anything that scores responses: one float per response."""

    def compute_reward(self, prompts: list[str], responses: list[str], **kwargs: Any) -> list[float]: ...


@dataclass
class RewardError:
    """One sample a reward failed on."""

    index: int
    """Position of the sample in the batch given to `compute`."""
    prompt: str
    response: str
    reward_name: str
    message: str

    def __str__(self) -> str:
        return (
            f"reward {self.reward_name!r} failed on sample {self.index} "
            f"(prompt {_clip(self.prompt)!r}, response {_clip(self.response)!r}): {self.message}"
        )


class RewardFailure(RuntimeError):
    """Raised under `onError: fail`; `errors` lists every failed sample of the batch."""

    def __init__(self, errors: list[RewardError]):
        self.errors = errors
        more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
        super().__init__(f"{errors[0]}{more}")


@dataclass
class RewardResult:
    """Scores of one batch. `scores[i]` is the weighted sum over rewards for sample i."""

    scores: list[float]
    """Weighted sum per sample; NaN where `valid` is False (policy `skip`)."""
    valid: list[bool]
    """False for samples to drop from the update."""
    errors: list[RewardError] = field(default_factory=list)
    per_reward: dict[str, list[float]] = field(default_factory=dict)
    """Unweighted score of each reward per sample (NaN where that reward failed)."""

    @property
    def num_valid(self) -> int:
        return sum(self.valid)

    def valid_scores(self) -> list[float]:
        return [s for s, v in zip(self.scores, self.valid) if v]

    def mean(self) -> float:
        """Mean score over valid samples (NaN when none is valid)."""
        vals = self.valid_scores()
        return sum(vals) / len(vals) if vals else math.nan


def _clip(text: str, limit: int = 120) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def import_object(path: str) -> Any:
    """`package.module:attr` (attr may be dotted) -> the object, the error naming the path."""
    try:
        return user_code.import_object(path)
    except user_code.ImportPathError as err:
        raise ValueError(f"reward path {path!r}: {err}") from err


def reward_object(path: str) -> Any:
    """What a reward's import path names, as `FunctionReward` takes it: a function, a
    `RewardCalculator`, or a class with a `compute_reward` method (not yet constructed)."""
    obj = import_object(path)
    if inspect.isclass(obj):
        if not callable(getattr(obj, "compute_reward", None)):
            raise TypeError(f"reward class {path!r} has no compute_reward(prompts, responses, **kw) method")
    elif not (isinstance(obj, RewardCalculator) or callable(obj)):
        raise TypeError(
            f"reward {path!r} is a {type(obj).__name__}, neither a function nor a RewardCalculator class"
        )
    return obj


class FunctionReward:
    """A Python reward given by import path: a function `f(prompts, responses, **columns)` or a class
    implementing `RewardCalculator` (constructed with `kwargs`). For a function, `kwargs` are passed
    as extra keyword arguments on every call. Columns a function does not accept (no `**kwargs` and
    no parameter of that name) are not passed to it."""

    def __init__(
        self, path: str | Callable[..., Any], kwargs: dict[str, Any] | None = None, name: str | None = None
    ):
        obj = reward_object(path) if isinstance(path, str) else path
        kwargs = dict(kwargs or {})
        self.path = path if isinstance(path, str) else f"{obj.__module__}:{obj.__qualname__}"
        self.name = name or self.path.rsplit(":", 1)[-1].rsplit(".", 1)[-1]
        self._extra: dict[str, Any] = {}
        if inspect.isclass(obj):
            instance: Any = obj(**kwargs)
            if not callable(getattr(instance, "compute_reward", None)):
                raise TypeError(
                    f"reward class {self.path!r} has no compute_reward(prompts, responses, **kw) method"
                )
            self._fn: Callable[..., Any] = instance.compute_reward
        elif isinstance(obj, RewardCalculator):
            self._fn = obj.compute_reward
        elif callable(obj):
            self._fn = obj
            self._extra = kwargs
        else:
            raise TypeError(f"reward {self.path!r} is neither a function nor a RewardCalculator class")
        params = inspect.signature(self._fn).parameters.values()
        self._accepts_all = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)
        self._accepted = {p.name for p in params}

    def declares(self, name: str) -> bool:
        """The function names parameter `name` itself (not only through `**kwargs`)."""
        return name in self._accepted

    def compute_reward(self, prompts: list[str], responses: list[str], **columns: Any) -> list[float]:
        if not self._accepts_all:
            columns = {k: v for k, v in columns.items() if k in self._accepted}
        return list(self._fn(prompts, responses, **columns, **self._extra))


class RewardModelScorer:
    """Scores each (prompt, response) with a local `AutoModelForSequenceClassification` (1 label:
    logit 0).

    When the reward model's tokenizer has a chat template (reward models are trained on chat
    transcripts), the sample is rendered through it as a conversation — the prompt's messages
    (`prompt_messages`: the data's chat messages; else one user turn holding the prompt text),
    then the response as the assistant's turn — and tokenized without adding special tokens
    again (the template places them). Without a template it scores `prompt + response`.

    `max_length` (default: the model's `max_position_embeddings`) bounds the tokens it reads: a
    longer input loses tokens from its left, so the prompt's beginning goes and the response stays
    whole (a leading BOS token is kept); only a response longer than `max_length` alone loses its
    own first tokens."""

    def __init__(
        self,
        path: str,
        batch_size: int = 16,
        device: str = "cpu",
        dtype: str = "float32",
        max_length: int | None = None,
        name: str = "reward_model",
    ):
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        self.name = name
        self.batch_size = batch_size
        self.device = device
        self.max_length = max_length
        try:
            local = str(Path(path).expanduser())
            self.tokenizer = AutoTokenizer.from_pretrained(local)
            self.model = AutoModelForSequenceClassification.from_pretrained(
                local, dtype=getattr(torch, dtype)
            )
        except OSError as err:
            raise ValueError(
                f"reward model {path!r} cannot be loaded (a local directory is expected): {err}"
            ) from err
        self.model.to(device).eval()
        if self.max_length is None:
            self.max_length = getattr(self.model.config, "max_position_embeddings", None)
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        if self.model.config.pad_token_id is None:
            self.model.config.pad_token_id = self.tokenizer.pad_token_id

    def texts(
        self,
        prompts: list[str],
        responses: list[str],
        prompt_messages: Sequence[list[dict[str, Any]] | None] | None = None,
    ) -> tuple[list[str], bool]:
        """What the model reads for each sample, and whether the tokenizer adds special tokens."""
        if getattr(self.tokenizer, "chat_template", None) is None:
            return [p + r for p, r in zip(prompts, responses)], True
        messages = prompt_messages if prompt_messages is not None else [None] * len(prompts)
        texts = []
        for prompt, response, msgs in zip(prompts, responses, messages):
            turns = list(msgs) if msgs else [{"role": "user", "content": prompt}]
            conversation = [*turns, {"role": "assistant", "content": response}]
            texts.append(str(self.tokenizer.apply_chat_template(conversation, tokenize=False)))
        return texts, False

    def input_ids(
        self,
        prompts: list[str],
        responses: list[str],
        prompt_messages: Sequence[list[dict[str, Any]] | None] | None = None,
    ) -> list[list[int]]:
        """The token ids the model reads for each sample, cut to `max_length` from the left."""
        texts, special = self.texts(prompts, responses, prompt_messages)
        encoded = self.tokenizer(texts, add_special_tokens=special)["input_ids"]
        return [self._cut_left(list(ids)) for ids in encoded]

    def _cut_left(self, ids: list[int]) -> list[int]:
        limit = self.max_length
        if limit is None or len(ids) <= limit:
            return ids
        bos = self.tokenizer.bos_token_id
        head = ids[:1] if bos is not None and ids[0] == bos and limit > 1 else []
        return head + ids[len(ids) - (limit - len(head)) :]

    def compute_reward(
        self,
        prompts: list[str],
        responses: list[str],
        prompt_messages: Sequence[list[dict[str, Any]] | None] | None = None,
        **_: Any,
    ) -> list[float]:
        import torch

        scores: list[float] = []
        rows = self.input_ids(prompts, responses, prompt_messages)
        with torch.no_grad():
            for start in range(0, len(rows), self.batch_size):
                chunk = [{"input_ids": ids} for ids in rows[start : start + self.batch_size]]
                enc = self.tokenizer.pad(chunk, padding=True, return_tensors="pt").to(self.device)
                logits = self.model(**enc).logits  # (b, num_labels)
                scores.extend(logits[:, 0].float().tolist())
        return scores


@dataclass
class _Weighted:
    name: str
    weight: float
    calc: Any


class CombinedReward:
    """Weighted sum of several rewards with the error policy of the module docstring."""

    def __init__(
        self,
        rewards: Sequence[tuple[str, float, Any]],
        on_error: str = "skip",
        error_penalty: float = -1.0,
    ):
        if not rewards:
            raise ValueError("CombinedReward needs at least one reward")
        if on_error not in ("skip", "penalty", "fail"):
            raise ValueError(f"on_error {on_error!r} is not valid; valid: skip, penalty, fail")
        self.rewards: list[_Weighted] = []
        seen: set[str] = set()
        for name, weight, calc in rewards:
            unique, k = name, 2
            while unique in seen:
                unique, k = f"{name}_{k}", k + 1
            seen.add(unique)
            self.rewards.append(_Weighted(unique, float(weight), calc))
        self.on_error = on_error
        self.error_penalty = float(error_penalty)

    @classmethod
    def from_spec(cls, reward_spec: Any, device: str = "cpu", dtype: str = "float32") -> CombinedReward:
        """Build from a `rlhf_api.sections.RewardSpec`; `dtype`: the dtype of a reward model that
        names none (`model.dtype`). Each reward model is a weighted part of its own, named as
        `RewardSpec.reward_models` says (its scores: `per_reward[name]`, the `reward/<name>` metric)."""
        parts: list[tuple[str, float, Any]] = []
        for f in reward_spec.functions:
            fr = FunctionReward(f.path, f.kwargs)
            parts.append((fr.name, f.weight, fr))
        for name, m in reward_spec.reward_models():
            scorer = RewardModelScorer(
                m.path,
                m.batch_size,
                device=device,
                dtype=m.load_dtype(dtype),
                max_length=m.max_length,
                name=name,
            )
            parts.append((name, m.weight, scorer))
        return cls(parts, on_error=reward_spec.on_error, error_penalty=reward_spec.error_penalty)

    @property
    def names(self) -> list[str]:
        return [r.name for r in self.rewards]

    def compute(
        self,
        prompts: list[str],
        responses: list[str],
        columns: dict[str, list[Any]] | list[dict[str, Any]] | None = None,
        messages: Sequence[list[dict[str, Any]] | None] | None = None,
    ) -> RewardResult:
        """Score a batch. `columns` holds the prompt file's other columns, either by key (a list per
        column) or by sample (one dict per sample, as `PromptItem.columns`). `messages`: each
        prompt as chat messages (`PromptItem.messages`, None for plain text), passed as
        `prompt_messages` to the reward model and to reward functions that name that parameter."""
        n = len(responses)
        if len(prompts) != n:
            raise ValueError(f"compute: {len(prompts)} prompts for {n} responses")
        columns = _columns_by_key(columns, n)
        for key, values in columns.items():
            if len(values) != n:
                raise ValueError(f"compute: column {key!r} has {len(values)} values for {n} responses")
        if messages is not None and len(messages) != n:
            raise ValueError(f"compute: {len(messages)} prompt messages for {n} responses")
        totals = [0.0] * n
        failed = [False] * n
        errors: list[RewardError] = []
        per_reward: dict[str, list[float]] = {}
        for r in self.rewards:
            given = columns
            if messages is not None and _declares(r.calc, PROMPT_MESSAGES):
                given = {**columns, PROMPT_MESSAGES: list(messages)}
            scores, errs = _score_with_retry(r.name, r.calc, prompts, responses, given)
            per_reward[r.name] = scores
            errors.extend(errs)
            for i, s in enumerate(scores):
                if math.isnan(s):
                    failed[i] = True
                else:
                    totals[i] += r.weight * s
        for e in errors:
            log.warning("%s", e)
        if errors and self.on_error == "fail":
            raise RewardFailure(sorted(errors, key=lambda e: e.index))
        valid = [True] * n
        for i in range(n):
            if failed[i]:
                if self.on_error == "penalty":
                    totals[i] = self.error_penalty
                else:
                    totals[i] = math.nan
                    valid[i] = False
        return RewardResult(scores=totals, valid=valid, errors=errors, per_reward=per_reward)


#: Columns every reward function may take besides the dataset's: whether the response was cut at
#: `rollout.maxNewTokens` without an end-of-sequence token (bool), and its length in tokens
#: (int, EOS included). The reward phase adds them (`dataflow.phases.reward_columns`).
RESPONSE_COLUMNS = ("truncated", "response_length")

#: The keyword under which a reward gets each prompt's chat messages (when it names it).
PROMPT_MESSAGES = "prompt_messages"


def _declares(calc: Any, name: str) -> bool:
    declares = getattr(calc, "declares", None)
    if callable(declares):
        return bool(declares(name))
    return name in inspect.signature(calc.compute_reward).parameters


def _columns_by_key(
    columns: dict[str, list[Any]] | list[dict[str, Any]] | None, n: int
) -> dict[str, list[Any]]:
    if columns is None:
        return {}
    if isinstance(columns, dict):
        return {k: list(v) for k, v in columns.items()}
    rows = list(columns)
    if len(rows) != n:
        raise ValueError(f"compute: {len(rows)} column rows for {n} responses")
    keys = sorted({k for row in rows for k in row})
    return {k: [row.get(k) for row in rows] for k in keys}


def _check_scores(raw: Any, n: int) -> list[Any]:
    try:
        values = list(raw)
    except TypeError as err:
        raise TypeError(f"returned {type(raw).__name__}, expected a list of {n} floats") from err
    if len(values) != n:
        raise ValueError(f"returned {len(values)} scores for {n} responses")
    return values


def _as_score(value: Any) -> tuple[float, str | None]:
    """`(score, None)` or `(nan, reason)` for one returned value."""
    try:
        score = float(value)
    except (TypeError, ValueError):
        return math.nan, f"returned a non-number {value!r}"
    if not math.isfinite(score):
        return math.nan, f"returned {score}"
    return score, None


def _score_with_retry(
    name: str, calc: Any, prompts: list[str], responses: list[str], columns: dict[str, list[Any]]
) -> tuple[list[float], list[RewardError]]:
    """Scores of one reward (NaN where it failed) and its errors; a failing batch is retried per sample."""
    n = len(responses)
    try:
        values = _check_scores(calc.compute_reward(list(prompts), list(responses), **columns), n)
    except Exception as batch_err:  # noqa: BLE001 - any failure of user code is reported per sample
        log.info("reward %r failed on a batch of %d (%s); retrying sample by sample", name, n, batch_err)
        values = []
        errors: list[RewardError] = []
        for i in range(n):
            try:
                one = _check_scores(
                    calc.compute_reward(
                        [prompts[i]], [responses[i]], **{k: [v[i]] for k, v in columns.items()}
                    ),
                    1,
                )
                values.append(one[0])
            except Exception as err:  # noqa: BLE001
                values.append(None)
                errors.append(RewardError(i, prompts[i], responses[i], name, f"{type(err).__name__}: {err}"))
        if not errors:  # every sample passes alone: the batch-level failure is the reward's own
            log.warning("reward %r raised on the batch but on no single sample: %s", name, batch_err)
        scores = []
        for i, v in enumerate(values):
            if v is None:
                scores.append(math.nan)
                continue
            s, why = _as_score(v)
            if why:
                errors.append(RewardError(i, prompts[i], responses[i], name, why))
            scores.append(s)
        return scores, errors
    scores, errors = [], []
    for i, v in enumerate(values):
        s, why = _as_score(v)
        if why:
            errors.append(RewardError(i, prompts[i], responses[i], name, why))
        scores.append(s)
    return scores, errors
