"""A calculator tool: the model writes `<tool>37*48</tool>`, the environment answers
`<result>1776</result>` and the model goes on; a turn without a tool call ends the episode.

    multiTurn:
      environment: rlhf_trainer.environments.calculator:CalculatorEnv
      kwargs: {callReward: 0.0}

The expression is evaluated by walking its syntax tree (numbers, + - * / // % **, parentheses,
unary signs; no names, no calls), with bounds on its length and on exponents, so a model's text is
never run as Python.
"""

from __future__ import annotations

import ast
import operator
from collections.abc import Callable
from typing import Any

from rlhf_trainer.environments import EnvStep, Episode

_BINARY: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type, Callable[[Any], Any]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}

#: Longest expression evaluated, and the largest exponent (`9**9**9` would never finish).
MAX_EXPRESSION = 64
MAX_EXPONENT = 64


def evaluate(expression: str) -> str:
    """The value of an arithmetic `expression` as text (an integer without `.0`), or `error: ...`."""
    if len(expression) > MAX_EXPRESSION:
        return f"error: expression longer than {MAX_EXPRESSION} characters"
    try:
        value = _eval(ast.parse(expression.strip(), mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError, OverflowError, TypeError) as err:
        return f"error: {type(err).__name__}"
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value) if isinstance(value, int) else f"{value:.6g}"


def _eval(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value  # type: ignore[return-value]
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))  # type: ignore[no-any-return]
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise ValueError("exponent too large")
        return _BINARY[type(node.op)](left, right)  # type: ignore[no-any-return]
    raise ValueError(f"not arithmetic: {type(node).__name__}")


class CalculatorEnv:
    """Answers the model's `<tool>expr</tool>` calls; the first turn without one ends the episode.

    `open`/`close`: the call's tags; `result_open`/`result_close`: the answer's. `callReward`
    (kwargs spelling as in the manifest, or `call_reward`): the reward of each call (a negative
    one is a cost per call). `stop`: the rollout ends a model turn right after the closing tag
    (`rollout.multiturn`), so the model never writes past its call."""

    def __init__(
        self,
        open: str = "<tool>",  # noqa: A002 - the tag's name
        close: str = "</tool>",
        result_open: str = "<result>",
        result_close: str = "</result>",
        call_reward: float = 0.0,
        **camel: Any,
    ):
        names = {"resultOpen": "result_open", "resultClose": "result_close", "callReward": "call_reward"}
        unknown = sorted(set(camel) - set(names))
        if unknown:
            raise TypeError(
                f"CalculatorEnv: unknown kwargs {unknown}; valid: open, close, {', '.join(names)}"
            )
        given = {names[k]: v for k, v in camel.items()}
        self.open, self.close = open, close
        self.result_open = given.get("result_open", result_open)
        self.result_close = given.get("result_close", result_close)
        self.call_reward = float(given.get("call_reward", call_reward))
        if not self.open or not self.close:
            raise ValueError("CalculatorEnv: open and close tags must not be empty")
        self.stop = [self.close]

    def call_in(self, text: str) -> str | None:
        """The expression of the last complete tool call in `text`, or None."""
        end = text.rfind(self.close)
        start = text.rfind(self.open, 0, end) if end >= 0 else -1
        if start < 0:
            return None
        return text[start + len(self.open) : end]

    def step(self, episode: Episode) -> EnvStep:
        expression = self.call_in(episode.last_model_text)
        if expression is None:
            return EnvStep(done=True)
        episode.state["calls"] = episode.state.get("calls", 0) + 1
        answer = evaluate(expression)
        return EnvStep(observation=f"{self.result_open}{answer}{self.result_close}", reward=self.call_reward)
