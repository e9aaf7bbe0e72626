"""The built-in algorithms' params as the CRD sees them: the schema of `spec.algorithm.params`
(every built-in's keys, typed and bounded), the rules keyed on the algorithm's name (each key
only for the algorithms that take it, each class's `CEL_RULES` with unset params at their
defaults), the job's group-size rule, and the params' section of the manifest reference.

The params themselves (their types, defaults and rules) are `algorithm_params`; this module only
renders them.
"""

from __future__ import annotations

import dataclasses
import json
import re
import typing
from typing import Any

from rlhf_api.algorithm_params import (
    BUILTIN_PARAMS,
    IMPORT_PATH_RE,
    MOVED_PARAMS,
    PARAM_ALIASES,
    VALUE_ALIASES,
    Choices,
    _names_in,
    _options,
    _type_name,
    bounds_text,
    camel,
    class_rules,
)


def _union() -> dict[str, list[tuple[str, dataclasses.Field[Any], Any]]]:
    """camelCase key -> [(algorithm, field, type hint)] over the built-ins."""
    out: dict[str, list[tuple[str, dataclasses.Field[Any], Any]]] = {}
    for algo, cls in BUILTIN_PARAMS.items():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            out.setdefault(camel(f.name), []).append((algo, f, hints[f.name]))
    return out


def _position(key: str, expr: str) -> int:
    """Where `key` first appears in `expr` as a name of its own."""
    found = re.search(rf"(?<![\w.']){key}(?![\w'])", expr)
    return found.start() if found else len(expr)


def _cel_list(names: list[str] | tuple[str, ...]) -> str:
    return "[" + ", ".join(f"'{n}'" for n in names) + "]"


def _describe_choices(field: str, choices: Choices) -> str:
    """The valid values of a string param, with verl's names of them (`VALUE_ALIASES`)."""
    verl = VALUE_ALIASES.get(field, {})
    return choices.describe() + "".join(f"; {alias} (verl) = {value}" for alias, value in verl.items())


def _and(fields: tuple[str, ...]) -> str:
    return " and ".join(camel(f) for f in fields)


def _takers(fields: tuple[str, ...]) -> list[str]:
    """The built-ins having every one of `fields`."""
    return [a for a, c in BUILTIN_PARAMS.items() if set(fields) <= {f.name for f in dataclasses.fields(c)}]


def params_schema() -> dict[str, Any]:
    """Schema of `spec.algorithm.params`: every built-in's keys, typed and bounded."""
    props: dict[str, Any] = {}
    for key, uses in _union().items():
        _, f, hint = uses[0]
        options = [o for o in _options(hint) if o is not type(None)]
        kind = {bool: "boolean", int: "integer", float: "number", str: "string"}[options[0]]
        schema: dict[str, Any] = {"type": kind}
        if type(None) in _options(hint):
            schema["nullable"] = True
        meta = f.metadata
        if meta.get("minimum") is not None:
            schema["minimum"] = meta["minimum"]
            if meta.get("exclusive_minimum"):
                schema["exclusiveMinimum"] = True
        if meta.get("maximum") is not None:
            schema["maximum"] = meta["maximum"]
            if meta.get("exclusive_maximum"):
                schema["exclusiveMaximum"] = True
        choices = meta.get("choices")
        if isinstance(choices, Choices) and not choices.open:
            schema["enum"] = list(choices.names)
        elif isinstance(choices, Choices):
            verl = VALUE_ALIASES.get(f.name, {})
            schema["x-kubernetes-validations"] = [
                {
                    "rule": f"self in {_cel_list(choices.names + tuple(verl))} || self.matches('{IMPORT_PATH_RE}')",
                    "messageExpression": f"'\"' + self + '\" is not valid; valid: {_describe_choices(f.name, choices)}'",
                }
            ]
        defaults: dict[str, list[str]] = {}
        for algo, g, _ in uses:
            defaults.setdefault(json.dumps(g.default), []).append(algo)
        default_text = "; ".join(f"{value} ({', '.join(algos)})" for value, algos in defaults.items())
        doc = str(meta.get("doc", ""))
        if isinstance(choices, Choices):
            doc += f" One of: {_describe_choices(f.name, choices)}."
        bounds = bounds_text(meta)
        schema["description"] = (
            doc
            + (f" Valid: {bounds}." if bounds else "")
            + f" Default: {default_text}. Taken by: {', '.join(a for a, _, _ in uses)}."
        )
        props[key] = schema
    for key, alias in PARAM_ALIASES.items():  # deprecated spellings: the schema of the param they set
        target = camel(alias.fields[0])
        schema = {k: v for k, v in props[target].items() if k != "description"}
        schema["description"] = (
            f"Deprecated alias of {_and(alias.fields)} ({alias.origin}): sets {'each' if len(alias.fields) > 1 else 'it'} "
            f"to this value; give one spelling. Taken by: {', '.join(_takers(alias.fields))}. "
            + props[target]["description"].split(" Default: ")[0]
        )
        props[key] = schema
    for key, where in MOVED_PARAMS.items():  # settings that live elsewhere: refused naming the field
        props[key] = {"type": "number", "description": f"Not a parameter: refused. The setting is {where}."}
    return {
        "type": "object",
        "description": "Hyperparameters of a built-in algorithm (camelCase keys; each key names the algorithms "
        "that take it and their defaults). A key the chosen algorithm does not take is refused. A custom "
        "algorithm may use these keys too; its own go in customParams.",
        "properties": props,
    }


def _with_defaults(expr: str, algo: str) -> str:
    """`expr` over bare param names, each replaced by `self.params.X` or its default when unset.
    A rule reading a param whose default is None holds while that param is unset (as in
    `AlgorithmParams.validate`): it is guarded by `has(self.params.X)`."""
    cls = BUILTIN_PARAMS[algo]
    guards = [
        f"!has(self.params.{camel(f.name)})"
        for f in dataclasses.fields(cls)
        if f.default is None and re.search(rf"(?<![\w.']){camel(f.name)}(?![\w'])", expr)
    ]
    for f in dataclasses.fields(cls):
        key = camel(f.name)
        if f.default is None:
            expr = re.sub(rf"(?<![\w.']){key}(?![\w'])", f"self.params.{key}", expr)
            continue
        default = f.default if not isinstance(f.default, str) else f"'{f.default}'"
        default = json.dumps(default) if isinstance(default, bool) else default
        if isinstance(default, float):
            default = repr(default)
        for alias, a in PARAM_ALIASES.items():  # unset, the param may be set through its alias
            if f.name in a.fields and set(a.fields) <= {g.name for g in dataclasses.fields(cls)}:
                default = f"(has(self.params.{alias}) ? self.params.{alias} : {default})"
        expr = re.sub(
            rf"(?<![\w.']){key}(?![\w'])",
            f"(has(self.params.{key}) ? self.params.{key} : {default})",
            expr,
        )
    return " || ".join([*guards, f"({expr})"]) if guards else expr


#: Advantage estimators whose baseline is the other samples of the prompt's group: a group of
#: one has none (grpo, rloo: every advantage 0 or the raw score, and nothing says so).
GROUP_ESTIMATORS = ("grpo", "rloo", "reinforce_plus_plus_baseline")


def group_relative_algorithms() -> list[str]:
    """The built-ins whose default advantage estimator is group-relative (`GROUP_ESTIMATORS`)."""
    return [
        algo
        for algo, cls in BUILTIN_PARAMS.items()
        if "advantage_estimator" in cls.__dataclass_fields__  # type: ignore[attr-defined]
        and cls.__dataclass_fields__["advantage_estimator"].default in GROUP_ESTIMATORS  # type: ignore[attr-defined]
    ]


def group_size_rule() -> tuple[Any, ...]:
    """The job's rule (CEL over the spec): a group-relative advantage (the algorithm's default
    estimator, or `params.advantageEstimator` when set) needs samplesPerPrompt >= 2."""
    estimator = "self.algorithm.params.advantageEstimator"
    grouped = (
        f"(has({estimator}) ? {estimator} in {_cel_list(GROUP_ESTIMATORS)}"
        f" : self.algorithm.name in {_cel_list(group_relative_algorithms())})"
    )
    why = (
        "a group-relative advantage (algorithms "
        + ", ".join(group_relative_algorithms())
        + "; advantageEstimator "
        + ", ".join(GROUP_ESTIMATORS)
        + ") has no baseline in a group of one"
    )
    return (
        f"!{grouped} || self.rollout.samplesPerPrompt >= 2",
        f"spec.rollout.samplesPerPrompt must be >= 2: {why}",
        {
            "fieldPath": ".rollout.samplesPerPrompt",
            "messageExpression": "'spec.rollout.samplesPerPrompt must be >= 2 for algorithm ' + self.algorithm.name"
            f" + ' (' + (has({estimator}) ? 'advantageEstimator ' + {estimator} : 'its default advantage "
            "estimator') + ' is group-relative: a group of one has no baseline, every advantage would be 0); "
            "got 1'",
        },
    )


def reference_switch_algorithms() -> tuple[list[str], list[str]]:
    """The built-ins whose `klCoef` decides whether the job runs the reference role (0: no KL
    term, no reference pods; `AlgorithmParams.uses_reference`), and those of them whose default
    `klCoef` runs it."""
    switch, on = [], []
    for name, cls in BUILTIN_PARAMS.items():
        if "kl_coef" not in {f.name for f in dataclasses.fields(cls)}:
            continue
        zero = cls.from_dict({"klCoef": 0.0}, rules=False).uses_reference()
        if zero != cls.from_dict({"klCoef": 1.0}, rules=False).uses_reference():
            switch.append(name)
            if cls.from_dict({}, rules=False).uses_reference():
                on.append(name)
    return switch, on


def reference_pods_rule() -> tuple[Any, ...]:
    """The job's transition rule (CEL over the spec and the stored spec): `klCoef` may change but
    not between 0 and non-zero, which would add or drop the reference pods of a running job (a
    pod-shaping change, like `roles.reference.replicas`). A custom pipeline keeps every role."""

    # klCoef and its aliases (`PARAM_ALIASES`: the seeds' betaInit): whichever spelling is set.
    spellings = ["klCoef", *(key for key, alias in PARAM_ALIASES.items() if "kl_coef" in alias.fields)]

    def runs_reference(obj: str) -> str:
        test = f"{obj}.algorithm.name in {_cel_list(on)}"
        for key in reversed(spellings):
            kl = f"{obj}.algorithm.params.{key}"
            test = f"(has({kl}) ? {kl} != 0.0 : {test})"
        return test

    switch, on = reference_switch_algorithms()
    return (
        f"has(self.pipeline) || !(self.algorithm.name in {_cel_list(switch)})"
        f" || {runs_reference('self')} == {runs_reference('oldSelf')}",
        "spec.algorithm.params.klCoef may not move between 0 and non-zero once the job exists (0 runs "
        "no reference pods); delete and recreate the job to change it",
        {"fieldPath": ".algorithm.params.klCoef"},
    )


def cel_rules() -> list[tuple[Any, ...]]:
    """Rules of `spec.algorithm` (CEL, `self` is the algorithm): each key of `params` must be one
    the chosen built-in takes; each built-in's cross-field rules; customParams only for a custom
    algorithm."""
    names = list(BUILTIN_PARAMS)
    valid_by_algo = (
        "{"
        + ", ".join(
            f"'{a}': '{', '.join(camel(f.name) for f in dataclasses.fields(c))}'"
            for a, c in BUILTIN_PARAMS.items()
        )
        + "}"
    )
    rules: list[tuple[Any, ...]] = []
    takers = {key: {u[0] for u in uses} for key, uses in _union().items()}
    takers.update({key: set(_takers(a.fields)) for key, a in PARAM_ALIASES.items()})
    for key, algos in takers.items():
        lacking = [a for a in names if a not in algos]
        if not lacking:
            continue
        rules.append(
            (
                f"!has(self.params.{key}) || !(self.name in {_cel_list(lacking)})",
                f"params.{key} is not a parameter of this algorithm",
                {
                    "fieldPath": f".params.{key}",
                    "messageExpression": f"'params.{key} is not a parameter of ' + self.name + '; valid: ' + "
                    f"{valid_by_algo}[self.name]",
                },
            )
        )
    for key, alias in PARAM_ALIASES.items():  # an alias or its param, not both (one would be lost)
        fields = _and(alias.fields)
        rules.append(
            (
                f"!has(self.params.{key}) || ("
                + " && ".join(f"!has(self.params.{camel(f)})" for f in alias.fields)
                + ")",
                f"params.{key} is a deprecated alias of {fields} ({alias.origin}); valid: one spelling, "
                f"{fields} (preferred) or {key}",
                {"fieldPath": f".params.{key}"},
            )
        )
    for key, where in MOVED_PARAMS.items():
        rules.append(
            (
                f"!has(self.params.{key})",
                f"params.{key} is not a parameter of the algorithm; the setting is {where}",
                {"fieldPath": f".params.{key}"},
            )
        )
    for algo, cls in BUILTIN_PARAMS.items():
        keys = {camel(f.name): None for f in dataclasses.fields(cls)}
        for expr, message in class_rules(cls):
            # The message names the param the rule reads first.
            first = min(_names_in(expr, keys), key=lambda k: _position(k, expr))
            rules.append(
                (
                    f"self.name != '{algo}' || ({_with_defaults(expr, algo)})",
                    f"{algo}: {message}",
                    {"fieldPath": f".params.{first}"},
                )
            )
    rules.append(
        (
            # (no size(): CEL sees no fields of a free-form object, only whether it is set)
            f"!has(self.customParams) || !(self.name in {_cel_list(names)})",
            "customParams are for a custom algorithm (an import path); a built-in's params go in params",
            {"fieldPath": ".customParams"},
        )
    )
    return rules


def reference_markdown() -> str:
    """The manifest reference's section on each built-in's params: key, type, default, bounds, doc."""
    lines = [
        "## `spec.algorithm.params` by algorithm",
        "",
        "Keys are camelCase; a key the chosen algorithm does not take is refused (by the API server and "
        "`rlhf validate`). A custom algorithm (`name: package.module:Class`) may use these keys and puts its "
        "own in `customParams`.",
        "",
    ]
    for algo, cls in BUILTIN_PARAMS.items():
        lines += [
            f"### `{algo}`",
            "",
            (cls.__doc__ or "").strip(),
            "",
            "| param | type | default | valid | description |",
            "|---|---|---|---|---|",
        ]
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            choices = f.metadata.get("choices")
            valid = bounds_text(f.metadata) or (choices.describe() if isinstance(choices, Choices) else "")
            lines.append(
                f"| `{camel(f.name)}` | {_type_name(hints[f.name]).replace(' | None', ' or null')} | `{json.dumps(f.default)}` | {valid} | "
                f"{f.metadata.get('doc', '')} |"
            )
        rules = class_rules(cls)
        if rules:
            lines += ["", "Cross-field rules: " + "; ".join(message for _, message in rules) + "."]
        lines.append("")
    lines += [
        "### verl's spellings",
        "",
        "Accepted as deprecated aliases (one spelling per param: an alias beside its param is refused), "
        "or refused naming where the setting lives ([from-verl.md](from-verl.md)):",
        "",
        "| key | meaning | taken by |",
        "|---|---|---|",
    ]
    for key, alias in PARAM_ALIASES.items():
        lines.append(
            f"| `{key}` | alias of {_and(alias.fields)} ({alias.origin}) | {', '.join(_takers(alias.fields))} |"
        )
    for field, values in VALUE_ALIASES.items():
        for verl, ours in values.items():
            lines.append(
                f"| `{camel(field)}: {verl}` | `{camel(field)}: {ours}` (verl's name) | {', '.join(_takers((field,)))} |"
            )
    for key, where in MOVED_PARAMS.items():
        lines.append(f"| `{key}` | refused: the setting is {where} | none |")
    lines.append("")
    return "\n".join(lines)
