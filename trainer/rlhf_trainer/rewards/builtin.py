"""Built-in reward functions (`rlhf_trainer.rewards.builtin:<name>` in a manifest).

Each is a plain function `f(prompts, responses, **columns) -> list[float]`; columns of the
prompt file arrive as keyword arguments (one list entry per sample).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

_INT = re.compile(r"^-?\d+$")


def _answers(answer: Sequence[Any] | None, n: int, name: str) -> list[str]:
    if answer is None:
        raise ValueError(f"{name} needs an `answer` column in the prompt file (the expected result)")
    if len(answer) != n:
        raise ValueError(f"{name}: {len(answer)} answers for {n} responses")
    return [str(a).strip() for a in answer]


def arithmetic_exact(
    prompts: Sequence[str], responses: Sequence[str], answer: Sequence[Any] | None = None, **_: Any
) -> list[float]:
    """1.0 when the response (surrounding whitespace ignored) is exactly the answer, else 0.0."""
    expected = _answers(answer, len(responses), "arithmetic_exact")
    return [1.0 if r.strip() == a else 0.0 for r, a in zip(responses, expected)]


def arithmetic_partial(
    prompts: Sequence[str], responses: Sequence[str], answer: Sequence[Any] | None = None, **_: Any
) -> list[float]:
    """Partial credit: 1.0 exact; otherwise 0.1 for a well-formed integer plus up to 0.4 for closeness
    (0.4 / (1 + |response - answer|)); 0.0 for anything that is not an integer."""
    expected = _answers(answer, len(responses), "arithmetic_partial")
    out = []
    for r, a in zip(responses, expected):
        r = r.strip()
        if r == a:
            out.append(1.0)
        elif _INT.match(r) and _INT.match(a):
            out.append(0.1 + 0.4 / (1 + abs(int(r) - int(a))))
        else:
            out.append(0.0)
    return out


def response_length(
    prompts: Sequence[str], responses: Sequence[str], scale: float = 1.0, **_: Any
) -> list[float]:
    """`scale` × characters in the response (a toy shaping term, useful in examples and tests)."""
    return [scale * len(r) for r in responses]


#: A number as people write it in a worked answer: sign, thousands separators, decimals.
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def final_number(text: str) -> str | None:
    """The final answer of a worked solution: what follows the last `####` marker (GSM8K's format)
    when there is one, else the text; of that, its last number, without thousands separators or a
    trailing `.0`. None when there is no number."""
    tail = text.rsplit("####", 1)[-1]
    numbers = _NUMBER.findall(tail)
    if not numbers:
        return None
    value = numbers[-1].replace(",", "")
    if "." in value:
        value = value.rstrip("0").rstrip(".")
    return value


def final_answer(
    prompts: Sequence[str], responses: Sequence[str], answer: Sequence[Any] | None = None, **_: Any
) -> list[float]:
    """1.0 when the response's final number (`final_number`) equals the reference's, else 0.0 —
    math word problems such as GSM8K, whose `answer` column ends in `#### <number>`."""
    expected = _answers(answer, len(responses), "final_answer")
    out = []
    for r, a in zip(responses, expected):
        want = final_number(a)
        out.append(1.0 if want is not None and final_number(r) == want else 0.0)
    return out


def final_turn_exact(
    prompts: Sequence[str],
    responses: Sequence[str],
    answer: Sequence[Any] | None = None,
    final_turn: Sequence[str] | None = None,
    **_: Any,
) -> list[float]:
    """Multi-turn: 1.0 when the model's last turn (`final_turn`, the text after the environment's
    last observation; the whole response in a single-turn job) is exactly the answer, else 0.0."""
    texts = list(final_turn) if final_turn is not None else list(responses)
    expected = _answers(answer, len(texts), "final_turn_exact")
    return [1.0 if t.strip() == a else 0.0 for t, a in zip(texts, expected)]
