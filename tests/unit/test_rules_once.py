"""Every cross-field rule of the API is written once, as CEL, and each is proven both ways.

The rules are the `CEL_RULES` of the spec's dataclasses and of the built-in algorithms' params
(`rlhf_api.algorithm_schema.cel_rules`). The API server evaluates them from the CRD; `rlhf
validate`, `rlhf run` and the operator's loader evaluate the same expressions (`rlhf_api.admission`,
`rlhf_api.cel`); there is no Python twin of any of them (the loader converts types and nothing
else; the one Python-only check left, `AlgorithmSpec.check`, is of the free-form `customParams`
CEL cannot see).

Here every rule must hold on the valid base manifest and fail on at least one invalid case (a
transition rule: one refused update) of the shared table (tests/admission_cases.py), which tests/unit/test_admission.py runs through `rlhf
validate` and tests/cluster/test_admission_table.py through a real API server, each naming the
field."""

from __future__ import annotations

import dataclasses
import inspect
import re
from typing import Any

import pytest
from admission_cases import CREATE_CASES, UPDATE_CASES, base, variant

import rlhf_api
from rlhf_api import admission, algorithm_params, algorithm_schema, cel, fields, job, pods, roles, sections

SPEC_MODULES = (fields, pods, sections, roles, job)


def template(expr: str) -> str:
    """A rule with the names it was generated over replaced by placeholders: the rules one
    template writes for every role, param key or algorithm are one rule written once."""
    expr = re.sub(r"self\.(roles\.\w+|controller)\b", "self.<pod>", expr)
    expr = re.sub(r"params\.\w+", "params.<key>", expr)
    expr = re.sub(r"\? self\.params\.<key> : [^)]+\)", "? self.params.<key> : <default>)", expr)
    expr = re.sub(r"\[('\w+'(, )?)+\]", "[<names>]", expr)
    return re.sub(r"self\.name != '\w+'", "self.name != <algorithm>", expr)


def cross_field_rules() -> dict[str, str]:
    """{rule expression: where it is declared} of every dataclass's `CEL_RULES` and of the
    algorithms' params."""
    found: dict[str, str] = {}
    for module in SPEC_MODULES:
        for name, cls in inspect.getmembers(module, inspect.isclass):
            if dataclasses.is_dataclass(cls) and cls.__module__ == module.__name__:
                for entry in cls.__dict__.get("CEL_RULES", []):
                    found.setdefault(entry[0], f"{module.__name__}.{name}")
    for entry in algorithm_schema.cel_rules():
        found.setdefault(entry[0], "algorithm_schema.cel_rules")
    return found


def failed_rules(
    doc: dict[str, Any], monkeypatch: pytest.MonkeyPatch, old: dict[str, Any] | None = None
) -> tuple[set[str], list[str]]:
    """The rule expressions that evaluate to false on `doc` (as `admission` evaluates them; an
    update of `old` when given), and the violations it reports."""
    failed: set[str] = set()
    real = cel.eval_cel

    def recording(expr: str, activation: dict[str, Any]) -> Any:
        result = real(expr, activation)
        if result is False or (
            hasattr(result, "__bool__") and type(result).__name__ == "BoolType" and not result
        ):
            failed.add(expr)
        return result

    monkeypatch.setattr(admission, "eval_cel", recording)
    return failed, admission.admit(doc, old)[1]


def test_there_are_rules_to_hold_and_the_base_breaks_none(monkeypatch: pytest.MonkeyPatch) -> None:
    rules = cross_field_rules()
    assert len(rules) >= 40, len(rules)
    failed, errs = failed_rules(base(), monkeypatch)
    assert errs == [] and not failed & set(rules), (errs, failed & set(rules))


def test_every_cross_field_rule_fails_on_a_case_of_the_table(monkeypatch: pytest.MonkeyPatch) -> None:
    rules = cross_field_rules()
    hit: dict[str, str] = {}
    for case, _kind, change, field in CREATE_CASES:
        failed, errs = failed_rules(variant(change), monkeypatch)
        assert any(e.startswith(field) for e in errs), (case, errs)
        for expr in failed & set(rules):
            hit.setdefault(template(expr), case)
    for case, change, field in UPDATE_CASES:  # transition rules fail on updates only
        if field is None:
            continue
        failed, errs = failed_rules(variant(change), monkeypatch, old=base())
        assert any(e.startswith(field) for e in errs), (case, errs)
        for expr in failed & set(rules):
            hit.setdefault(template(expr), case)
    missing = sorted(
        {f"{where}: {template(expr)[:160]}" for expr, where in rules.items() if template(expr) not in hit}
    )
    assert not missing, "rules no case of tests/admission_cases.py breaks:\n" + "\n".join(missing)


def test_no_section_keeps_a_python_twin_of_its_rules() -> None:
    """A dataclass with CEL rules has no `validate`; only `AlgorithmSpec` keeps a `check`, for
    the free-form customParams."""
    twins = []
    for module in SPEC_MODULES:
        for name, cls in inspect.getmembers(module, inspect.isclass):
            if cls.__module__ != module.__name__ or not dataclasses.is_dataclass(cls):
                continue
            if "validate" in cls.__dict__ or ("check" in cls.__dict__ and name != "AlgorithmSpec"):
                twins.append(f"{module.__name__}.{name}")
            twins += [
                f"{module.__name__}.{name}.{f.name}" for f in dataclasses.fields(cls) if "check" in f.metadata
            ]
    for cls in algorithm_params.BUILTIN_PARAMS.values():
        if "validate" in cls.__dict__ and cls is not algorithm_params.AlgorithmParams:
            twins.append(f"algorithm_params.{cls.__name__}.validate")
    assert not twins, twins
    assert rlhf_api.__doc__  # the package says what it holds
