"""The CRD's OpenAPI v3 schema, rendered from the spec's dataclasses: a description on every
field, defaults, enums, bounds, patterns and `x-kubernetes-validations` (the CEL rules, and
`self == oldSelf` for immutable fields).

Importable without torch, Ray or a Kubernetes client.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Literal, get_args, get_origin

from rlhf_api.fields import (
    DNS_LABEL_RE,
    IMPORT_PATH_RE,
    MAX_FREE_FORM_PROPERTIES,
    PATTERN_HINTS,
    QUANTITY_RE,
    _cel_string,
    _hints,
    _unwrap_optional,
    camel,
    to_dict,
)
from rlhf_api.job import JobSpec
from rlhf_api.pods import CONFIG_KEY_RE, DNS_SUBDOMAIN_RE, ENV_NAME_RE, FIELD_PATH_RE

# --------------------------------------------------------------------------------------------
# OpenAPI schema for the CRD
# --------------------------------------------------------------------------------------------


def _schema_for(tp: Any, meta: dict[str, Any]) -> dict[str, Any]:
    inner, optional = _unwrap_optional(tp)
    out: dict[str, Any] = {}
    origin = get_origin(inner)
    if "schema" in meta:
        out = meta["schema"]()
    elif meta.get("free_form"):
        # The API server bounds the keys, not the depth (`free_form_errors` does, in the loader).
        free = {
            "type": "object",
            "x-kubernetes-preserve-unknown-fields": True,
            "maxProperties": MAX_FREE_FORM_PROPERTIES,
        }
        out = {"type": "array", "items": free} if origin is list else dict(free)
    elif dataclasses.is_dataclass(inner):
        out = openapi_schema(inner)
    elif origin is Literal:
        out = {"type": "string", "enum": list(get_args(inner))}
    elif origin is list:
        (item,) = get_args(inner)
        out = {"type": "array", "items": _schema_for(item, {})}
    elif origin is dict:
        _, vt = get_args(inner)
        out = {"type": "object", "additionalProperties": _schema_for(vt, {})}
        if "value_max_length" in meta:  # bounds the API server's cost estimate of rules on the values
            out["additionalProperties"]["maxLength"] = meta["value_max_length"]
    else:
        out = {
            bool: {"type": "boolean"},
            int: {"type": "integer", "format": "int64"},
            float: {"type": "number"},
            str: {"type": "string"},
        }[inner]
        out = dict(out)
    if "minimum" in meta:
        out["minimum"] = meta["minimum"]
    if "exclusive_minimum" in meta:
        out["minimum"] = meta["exclusive_minimum"]
        out["exclusiveMinimum"] = True
    if "maximum" in meta:
        out["maximum"] = meta["maximum"]
    if "min_length" in meta:
        out["minLength"] = meta["min_length"]
    if "max_length" in meta:
        out["maxLength"] = meta["max_length"]
    if "pattern" in meta:
        valid = meta.get("valid") or PATTERN_HINTS.get(meta["pattern"])
        if valid:
            # A rule rather than `pattern`, so that the API server's message says what is valid
            # (an example) instead of showing the regular expression.
            out["x-kubernetes-validations"] = [
                {
                    "rule": f"self.matches({_cel_string(meta['pattern'])})",
                    "messageExpression": f"'\"' + self + '\" is not valid; valid: ' + {_cel_string(valid)}",
                }
            ]
            # A bound on the string bounds the API server's cost estimate of the rule.
            out["maxLength"] = _PATTERN_MAX_LENGTH.get(meta["pattern"], 1024)
        else:
            out["pattern"] = meta["pattern"]
    # A field's own rules (`cel`: the CRD's counterparts of its Python `check`).
    for rule, message_expression in meta.get("cel", ()):
        out.setdefault("x-kubernetes-validations", []).append(
            {"rule": rule, "messageExpression": message_expression}
        )
    if optional and not dataclasses.is_dataclass(inner):
        out["nullable"] = True
    return out


#: Longest value of each pattern (Kubernetes' own limits where it has them).
_PATTERN_MAX_LENGTH = {
    DNS_LABEL_RE: 63,
    DNS_SUBDOMAIN_RE: 253,
    QUANTITY_RE: 64,
    ENV_NAME_RE: 256,
    FIELD_PATH_RE: 320,
    CONFIG_KEY_RE: 253,
    IMPORT_PATH_RE: 512,
}


def _cel_rule(entry: tuple[Any, ...]) -> dict[str, Any]:
    """A `CEL_RULES` entry, `(rule, message)` or `(rule, message, {fieldPath, messageExpression})`."""
    rule, message, *extra = entry
    out = {"rule": rule, "message": message}
    if extra:
        out.update(extra[0])
    return out


def immutability_rule(key: str) -> dict[str, Any]:
    """The parent's transition rule keeping `key` as it was at creation: set or unset alike, so
    that adding or removing an optional field is a change too (a rule on the field itself would
    be skipped whenever the old or the new value is absent)."""
    return {
        "rule": f"has(self.{key}) == has(oldSelf.{key}) && (!has(self.{key}) || self.{key} == oldSelf.{key})",
        "message": f"{key} is immutable once the job exists (it may be neither changed, added nor "
        "removed); delete and recreate the job to change it",
        "fieldPath": f".{key}",
    }


def openapi_schema(cls: Any = JobSpec) -> dict[str, Any]:
    """Structural OpenAPI v3 schema of a spec class, with descriptions, defaults, enums, bounds and CEL rules."""
    hints = _hints(cls)
    props: dict[str, Any] = {}
    required: list[str] = []
    immutable: list[str] = []
    for f in dataclasses.fields(cls):
        meta = dict(f.metadata)
        schema = _schema_for(hints[f.name], meta)
        schema["description"] = meta["doc"] + (
            " Immutable once the job exists." if meta.get("immutable") else ""
        )
        if f.default is not dataclasses.MISSING and f.default is not None:
            schema["default"] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = to_dict(f.default_factory())
            # Every documented default is in the schema, empty lists and maps included, so that
            # a rule may read the field of any stored job.
            if dataclasses.is_dataclass(_unwrap_optional(hints[f.name])[0]):
                schema["default"] = {}
            elif not meta.get("free_form"):  # free-form: a rule can only ask whether it is set
                schema["default"] = default
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            required.append(camel(f.name))
        if meta.get("immutable"):
            immutable.append(camel(f.name))
        props[camel(f.name)] = schema
    out: dict[str, Any] = {
        "type": "object",
        "description": inspect.cleandoc(cls.__doc__ or "").split("\n\n")[0],
        "properties": props,
    }
    if required:
        out["required"] = required
    rules = [_cel_rule(r) for r in getattr(cls, "CEL_RULES", [])]
    rules += [immutability_rule(key) for key in immutable]
    if rules:
        out["x-kubernetes-validations"] = rules
    return out
