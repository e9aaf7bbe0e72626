"""Field helpers of the spec: the documented field (`_f`), the patterns and bounds the sections
share, the CEL text helpers the rules are written with, and the type helpers the loader, the
schema and the reference read the dataclasses through.

Importable without torch, Ray or a Kubernetes client.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import field
from typing import Any, Literal, Union, get_args, get_origin

#: Algorithms shipped with the library (`rlhf_trainer.algorithms`). A custom one is given by
#: import path, `my_pkg.algos:MyAlgo`.
BUILTIN_ALGORITHMS = (
    "ppo",
    "grpo",
    "gspo",
    "dr_grpo",
    "rloo",
    "reinforce_plus_plus",
    "remax",
    "online_dpo",
    "dynamic_kl_ppo",
)
IMPORT_PATH_RE = r"^[A-Za-z_][A-Za-z0-9_.]*:[A-Za-z_][A-Za-z0-9_.]*$"
DNS_LABEL_RE = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
QUANTITY_RE = r"^([0-9]+(\.[0-9]+)?|\.[0-9]+)(m|k|Ki|M|Mi|G|Gi|T|Ti)?$"
#: What an error shows instead of a field's regular expression (unless the field gives `valid`).
PATTERN_HINTS = {
    QUANTITY_RE: "a Kubernetes quantity such as 8Gi, 512Mi, 2 or 500m",
    IMPORT_PATH_RE: "an import path package.module:name, e.g. my_rewards:exact_match",
    DNS_LABEL_RE: "a DNS label: at most 63 lowercase letters, digits and '-', starting and ending with a "
    "letter or digit, e.g. h100-pool",
}


#: The most pods of one role (and of the rollout fleet's maxReplicas): the CRD's `maximum`. A
#: replica count is a tenant's request for the shared operator's memory and API calls, so it is
#: bounded where it is written. `MAX_PODS_PER_JOB` bounds the sum over roles (the controller pod
#: included); an operator may set a lower bound of its own (`rlhf operator --max-pods-per-job`).
MAX_REPLICAS = 1024
MAX_PODS_PER_JOB = 1024
#: Free-form fields (reward kwargs, custom algorithm params, pool tolerations/affinity): the
#: deepest nesting and the most keys (the CRD's `maxProperties`) accepted. The API server cannot
#: bound the depth of a free-form field; the Python loader (the operator's included) refuses it.
MAX_FREE_FORM_DEPTH = 8
MAX_FREE_FORM_PROPERTIES = 64


class SpecError(ValueError):
    """An invalid manifest. `errors` holds one line per problem, each starting with the field path."""

    def __init__(self, errors: list[str]):
        self.errors = errors
        super().__init__("\n".join(f"  - {e}" for e in errors))


def _f(default: Any = dataclasses.MISSING, doc: str = "", **meta: Any) -> Any:
    """A documented field. `meta` keys: enum, minimum, maximum, exclusive_minimum, pattern (with
    `valid`: the words an error shows instead of the regex), cel (the field's own CEL rules,
    `(rule, messageExpression)`: every rule of a field is CEL, evaluated by the API server and by
    the loader alike),
    max_length, value_max_length (of a map's values), immutable (CEL `self == oldSelf` once the job
    exists), cluster_only, free_form (no schema)."""
    meta["doc"] = doc
    if isinstance(default, (list, dict)):
        value = default
        return field(default_factory=lambda: type(value)(value), metadata=meta)
    if dataclasses.is_dataclass(default) and isinstance(default, type):
        return field(default_factory=default, metadata=meta)
    return field(default=default, metadata=meta)


def camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(p[:1].upper() + p[1:] for p in rest)


def _cel_string(text: str) -> str:
    """`text` as a single-quoted CEL string literal."""
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _one_of_cel(names: tuple[str, ...]) -> str:
    return " + ".join(f"(has(self.{camel(n)}) ? 1 : 0)" for n in names) + " == 1"


def _one_of_rule(names: tuple[str, ...], what: str) -> tuple[str, str, dict[str, str]]:
    """The rule `exactly one of names`, its message saying which are set (`got none`, `got a, b`)."""
    valid = ", ".join(camel(n) for n in names)
    given = " + ".join(f"(has(self.{camel(n)}) ? ' {camel(n)}' : '')" for n in names)
    return (
        _one_of_cel(names),
        f"{what} needs exactly one of {valid}",
        {
            "messageExpression": f"'{what} needs exactly one of {valid}; got' + ({given} == '' ? ' none' : {given})"
        },
    )


def cel_int(expr: str, digits: int = 7) -> str:
    """A CEL expression giving the decimal text of the non-negative integer `expr`, for a rule's
    messageExpression. The API server's cost estimator cannot bound the length of `string(int)`
    and so refuses every message built with it; this builds the text from one-character
    constants, which it can bound (`digits` at most; larger or negative values are described)."""
    d = "['0', '1', '2', '3', '4', '5', '6', '7', '8', '9']"
    parts = [f"({expr} >= {10**k} ? {d}[{expr} / {10**k} % 10] : '')" for k in range(digits - 1, 0, -1)]
    parts.append(f"{d}[{expr} % 10]")
    return (
        f"({expr} < 0 ? 'a negative number' : {expr} >= {10**digits} ? 'a number of more than {digits} digits' : "
        + " + ".join(parts)
        + ")"
    )


def cel_names(items: str, key: str = "name", limit: int = 8) -> str:
    """A CEL expression listing `items[i].key` (a non-empty list), comma-separated, the first
    `limit` of them: `join` has a result the API server's cost estimator cannot bound."""
    parts = [f"{items}[0].{key}"]
    parts += [f"(size({items}) > {i} ? ', ' + {items}[{i}].{key} : '')" for i in range(1, limit)]
    parts.append(f"(size({items}) > {limit} ? ', ...' : '')")
    return "(" + " + ".join(parts) + ")"


def _cel_in(values: tuple[str, ...] | list[str]) -> str:
    return "[" + ", ".join(f"'{v}'" for v in values) + "]"


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _unwrap_optional(tp: Any) -> tuple[Any, bool]:
    if get_origin(tp) in (Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        if len(args) == 1 and len(get_args(tp)) == 2:
            return args[0], True
    return tp, False


def _describe(tp: Any) -> str:
    tp, _ = _unwrap_optional(tp)
    if get_origin(tp) is Literal:
        return "one of " + ", ".join(repr(a) for a in get_args(tp))
    if dataclasses.is_dataclass(tp):
        return "a mapping"
    if get_origin(tp) is list:
        return "a list"
    if get_origin(tp) is dict:
        return "a mapping"
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false"}.get(tp, str(tp))


def to_dict(obj: Any) -> Any:
    """The camelCase mapping of a spec object (defaults filled in), as it would appear in a manifest."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {
            camel(f.name): to_dict(getattr(obj, f.name))
            for f in dataclasses.fields(obj)
            if getattr(obj, f.name) is not None
        }
    if isinstance(obj, list):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj
