"""CEL, evaluated in Python as the API server evaluates a CRD's `x-kubernetes-validations`.

One evaluator for every rule of the API: `admission` runs the job schema's rules with it, and
`algorithm_params` runs each algorithm's cross-field rules with it when its params are built
(so a rule is written once, as CEL, and holds the same in a manifest and in Python).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

#: Integers CEL holds as int64; beyond them a JSON number is a double.
INT64 = 2**63


def to_cel(schema: dict[str, Any] | None, value: Any) -> Any:
    """A JSON value as CEL sees it: `number` fields are doubles even when written as integers."""
    import celpy.celtypes as ct

    schema = schema or {}
    if value is None:
        return None
    if isinstance(value, bool):
        return ct.BoolType(value)
    if isinstance(value, dict):
        props = schema.get("properties", {})
        extra = schema.get("additionalProperties")
        return ct.MapType(
            {
                ct.StringType(k): to_cel(props.get(k, extra if isinstance(extra, dict) else None), v)
                for k, v in value.items()
            }
        )
    if isinstance(value, list):
        return ct.ListType([to_cel(schema.get("items"), v) for v in value])
    if isinstance(value, str):
        return ct.StringType(value)
    if schema.get("type") == "number" or isinstance(value, float) or not -INT64 <= value < INT64:
        return ct.DoubleType(float(value))  # (an integer beyond int64 is refused by the schema already)
    return ct.IntType(value)


def _cel_join(items: Any, sep: Any = "") -> Any:
    import celpy.celtypes as ct

    return ct.StringType(str(sep).join(str(i) for i in items))


#: Kubernetes CEL library functions the rules use, beyond standard CEL.
_K8S_FUNCTIONS: dict[str, Callable[..., Any]] = {"join": _cel_join}


@functools.cache
def program(expr: str) -> Any:
    try:
        import celpy
    except ModuleNotFoundError as err:  # pragma: no cover - a dependency of the package
        raise RuntimeError("rlhf validate needs the `cel-python` package (pip install cel-python)") from err
    env = celpy.Environment()
    return env.program(env.compile(expr), functions=_K8S_FUNCTIONS)


def eval_cel(expr: str, activation: dict[str, Any]) -> Any:
    """Evaluate a CEL expression; raises celpy's error when it cannot (a missing key, a type error)."""
    import celpy

    result = program(expr).evaluate(activation)
    if isinstance(result, celpy.CELEvalError):
        raise result
    return result
