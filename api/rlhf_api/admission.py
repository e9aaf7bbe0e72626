"""Admission: the CRD's own schema and CEL rules, evaluated in Python exactly as the API server does.

There is one rule set. The spec's dataclasses (`job`, `sections`, `roles`, `pods`, and the
algorithms' params through `algorithm_schema`) declare every field's type, default, enum, bounds
and pattern, and every cross-field and immutability rule as CEL (`CEL_RULES`, `immutable=True`,
beside the fields they guard; `schema` renders them); from it this module builds the
`openAPIV3Schema` of the job (`job_schema`), which the CRD ships (the operator's `crd.py` adds
only the status) and which `rlhf validate`, `rlhf run` and the operator evaluate here, with the
same steps as the API server:

1. prune `null` from fields that are not nullable (the server drops them before defaulting);
2. apply the schema's defaults (`default`, recursively, as structural defaulting does);
3. check types, enums, bounds, patterns, sizes, required and unknown fields (strict field
   validation, what `kubectl apply` asks for);
4. evaluate every `x-kubernetes-validations` rule with a CEL interpreter (`cel-python`), the
   transition rules (those reading `oldSelf`) only on an update and only where the old object
   has the node too, as the server does.

A violation is one line `<field path>: <message>`, the field path the server reports (a rule's
`fieldPath` included). The loader (`loader.parse_job`) converts the object into the typed spec
and adds no rule of its own but the `customParams` check CEL cannot express. A table-driven test
holds every rule to the same verdict here (tests/unit/test_admission.py) and on a real API server
(tests/cluster/test_admission_table.py).
"""

from __future__ import annotations

import copy
import functools
import re
from typing import Any

from rlhf_api.cel import INT64, eval_cel, to_cel
from rlhf_api.fields import DNS_LABEL_RE, cel_int
from rlhf_api.job import JobSpec
from rlhf_api.schema import openapi_schema

#: Bounds added to every string, list and map that has none, so that the API server can bound the
#: cost of the CEL rules (and so that nobody stores megabytes in a job).
MAX_STRING = 4096
MAX_ITEMS = 64
MAX_PROPERTIES = 64
#: Longest job name: pods are named `<job>-reference-<i>` and must stay DNS labels (63 characters).
MAX_JOB_NAME = 50
#: The job's name becomes the headless Service's name (a DNS-1035 label: it starts with a letter),
#: the pods' hostnames (`<job>-<role>-<i>`, DNS labels) and the `rlhf.dev/job-name` label value.
JOB_NAME_RE = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"
DNS_LABEL_MAX = 63
#: Role name and replica-count field of every per-role pod name `<job>-<role>-<index>`.
_POD_NAME_PARTS = (
    ("actor", "self.spec.roles.actor.replicas"),
    ("critic", "self.spec.roles.critic.replicas"),
    ("reference", "self.spec.roles.reference.replicas"),
    ("reward", "self.spec.roles.reward.replicas"),
    ("rollout", "self.spec.roles.rollout.maxReplicas"),
)
#: Fields of a Kubernetes ObjectMeta (strict field validation refuses any other key).
OBJECT_META_FIELDS = (
    "name",
    "generateName",
    "namespace",
    "selfLink",
    "uid",
    "resourceVersion",
    "generation",
    "creationTimestamp",
    "deletionTimestamp",
    "deletionGracePeriodSeconds",
    "labels",
    "annotations",
    "ownerReferences",
    "finalizers",
    "managedFields",
)


def bound(schema: dict[str, Any]) -> dict[str, Any]:
    """Add maxLength/maxItems/maxProperties where a schema has none, recursively."""

    out = copy.deepcopy(schema)
    kind = out.get("type")
    if kind == "string" and "enum" not in out and "maxLength" not in out:
        out["maxLength"] = DNS_LABEL_MAX if out.get("pattern") == DNS_LABEL_RE else MAX_STRING
    if kind == "array":
        out.setdefault("maxItems", MAX_ITEMS)
        if "items" in out:
            out["items"] = bound(out["items"])
    if kind == "object":
        if "properties" in out:
            out["properties"] = {k: bound(v) for k, v in out["properties"].items()}
        if isinstance(out.get("additionalProperties"), dict):
            out.setdefault("maxProperties", MAX_PROPERTIES)
            out["additionalProperties"] = bound(out["additionalProperties"])
    return out


def full_defaults(schema: dict[str, Any]) -> dict[str, Any]:
    """Replace `default: {}` of an object by the object with its properties' defaults filled in.

    The API server checks each default against the CEL rules of its schema *without* applying the
    nested defaults first, so `{}` would fail `self.minReplicas <= self.maxReplicas`."""
    out = dict(schema)
    if "properties" in out:
        out["properties"] = {k: full_defaults(v) for k, v in out["properties"].items()}
    if isinstance(out.get("items"), dict):
        out["items"] = full_defaults(out["items"])
    if out.get("type") == "object" and out.get("default") == {} and "properties" in out:
        out["default"] = {
            k: copy.deepcopy(v["default"]) for k, v in out["properties"].items() if "default" in v
        }
    return out


def spec_schema() -> dict[str, Any]:
    """The `spec` schema of the CRD."""

    return full_defaults(bound(openapi_schema(JobSpec)))


def name_rules() -> list[dict[str, Any]]:
    """Rules on `metadata.name` (at the root: CEL sees only the name of the metadata), from every
    name the operator derives from it."""

    rules: list[dict[str, Any]] = [
        {
            "rule": f"self.metadata.name.matches('{JOB_NAME_RE}')",
            "message": "metadata.name is not valid: the job name is also its headless Service name; valid: a "
            "DNS-1035 label, lowercase letters, digits and '-', starting with a letter, e.g. grpo-run-1",
            "messageExpression": "'metadata.name: ' + self.metadata.name + ' is not valid: the job name is also its "
            "headless Service name; valid: a DNS-1035 label, lowercase letters, digits and \\'-\\', starting with a "
            "letter and ending with a letter or digit, e.g. grpo-run-1'",
        },
        {
            "rule": f"self.metadata.name.size() <= {MAX_JOB_NAME}",
            "message": f"metadata.name is too long; valid: at most {MAX_JOB_NAME} characters "
            "(pod names <job>-<role>-<index> derive from it)",
            "messageExpression": "'metadata.name: ' + self.metadata.name + ' has ' + "
            + cel_int("self.metadata.name.size()")
            + f" + ' characters; valid: at most {MAX_JOB_NAME} (pod names <job>-<role>-<index> derive from it)'",
        },
    ]
    for role, count in _POD_NAME_PARTS:
        # The longest pod name of the role: `<job>-<role>-<count - 1>` (a DNS label: its hostname).
        rules.append(
            {
                "message": f"metadata.name is too long for {role} pods <job>-{role}-<index> of at most "
                f"{DNS_LABEL_MAX} characters; valid: a shorter job name or fewer {role} replicas",
                "rule": f"{count} <= 1 || self.metadata.name.size() + {len(role) + 2} + "
                f"string({count} - 1).size() <= {DNS_LABEL_MAX}",
                "messageExpression": f"'metadata.name: pod ' + self.metadata.name + '-{role}-' + "
                + cel_int(f"({count} - 1)")
                + f" + ' would be longer than {DNS_LABEL_MAX} characters; valid: a shorter job name or fewer {role} replicas'",
            }
        )
    return rules


#: A messageExpression the API server's cost estimator refuses: it bounds no string joined from a
#: list, nor `string(int)` (integers are written with `fields.cel_int` instead, which it can bound).
#: The CRD carries the rule's static `message` instead, while `rlhf validate` shows the values.
#: Same rule, same verdict; only the wording differs. (Checked against the API server's own CRD
#: validation: the cluster tests install the CRD.)
_COSTLY_MESSAGE = re.compile(r"string\(|\.join\(|\.map\(")


def server_messages(schema: Any) -> Any:
    """`schema` with the messageExpressions the API server cannot afford dropped (see `_COSTLY_MESSAGE`)."""
    if isinstance(schema, list):
        return [server_messages(v) for v in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: server_messages(v) for k, v in schema.items()}
    rules = out.get("x-kubernetes-validations")
    if isinstance(rules, list):
        out["x-kubernetes-validations"] = [
            {k: v for k, v in r.items() if k != "messageExpression"}
            if "message" in r and _COSTLY_MESSAGE.search(r.get("messageExpression", ""))
            else r
            for r in rules
        ]
    return out


def job_schema() -> dict[str, Any]:
    """The openAPIV3Schema of an RLTrainingJob without its status (which users never write)."""
    return {
        "type": "object",
        "description": "An RL post-training job (PPO, GRPO, RLOO, ...): its roles become pods placed on "
        "GPU node pools, restarted as a gang from the last checkpoint, with an elastic rollout fleet.",
        "properties": {
            "apiVersion": {"type": "string", "description": "rlhf.dev/v1alpha1"},
            "kind": {"type": "string", "description": "RLTrainingJob"},
            "metadata": {"type": "object"},
            "spec": spec_schema(),
        },
        "required": ["spec"],
        "x-kubernetes-validations": name_rules(),
    }


# --------------------------------------------------------------------------------------------
# Evaluation
# --------------------------------------------------------------------------------------------

_ABSENT = object()
#: Raise when a messageExpression cannot be evaluated here (tests set it): the server would show
#: its text while `rlhf validate` fell back to the static message, so the two would differ.
STRICT_MESSAGES = False


def prune_nulls(schema: dict[str, Any], value: Any) -> Any:
    """Drop `null` from fields that are not nullable, as the API server does before defaulting."""
    if isinstance(value, dict) and schema.get("type") == "object":
        props = schema.get("properties", {})
        extra = schema.get("additionalProperties")
        out = {}
        for key, item in value.items():
            sub = props.get(key, extra if isinstance(extra, dict) else None)
            if item is None and sub is not None and not sub.get("nullable"):
                continue
            out[key] = prune_nulls(sub, item) if sub is not None else item
        return out
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        return [prune_nulls(schema["items"], v) for v in value]
    return value


def apply_defaults(schema: dict[str, Any], value: Any) -> Any:
    """Structural defaulting: a missing property with a `default` gets it; recursively."""
    if isinstance(value, dict) and schema.get("type") == "object":
        out = dict(value)
        for key, sub in schema.get("properties", {}).items():
            if key not in out and "default" in sub:
                out[key] = copy.deepcopy(sub["default"])
            if key in out:
                out[key] = apply_defaults(sub, out[key])
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict):
            out = {k: apply_defaults(extra, v) for k, v in out.items()}
        return out
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        return [apply_defaults(schema["items"], v) for v in value]
    return value


def _show(value: Any) -> str:
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (dict, list)):
        return '"object"' if isinstance(value, dict) else '"array"'
    return str(value)


_TYPE_WORDS = {
    "integer": "an integer",
    "number": "a number",
    "string": "a string",
    "boolean": "true or false",
    "object": "a mapping",
    "array": "a list",
}


def _type_ok(kind: str, value: Any) -> bool:
    if kind == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind == "string":
        return isinstance(value, str)
    if kind == "boolean":
        return isinstance(value, bool)
    if kind == "object":
        return isinstance(value, dict)
    if kind == "array":
        return isinstance(value, list)
    return True


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _structural(
    schema: dict[str, Any], value: Any, path: str, errs: list[str], blocking: list[str] | None = None
) -> bool:
    """Types, enums, bounds, patterns, sizes, required and unknown fields. False: stop descending.
    `blocking` gets the path of each violation after which the API server evaluates no CEL rule at
    all (its `hasBlockingErr`: a wrong type, a required field missing, a value outside the enum,
    a string, list or map too long)."""
    blocked = blocking if blocking is not None else []
    if value is None:
        if not schema.get("nullable"):
            errs.append(
                f"{path}: Invalid value: null: must be {_TYPE_WORDS.get(schema.get('type', ''), 'set')}"
            )
            blocked.append(path)
        return False
    kind = schema.get("type")
    if kind and not _type_ok(kind, value):
        errs.append(f"{path}: Invalid value: {_show(value)}: must be {_TYPE_WORDS[kind]}")
        blocked.append(path)
        return False
    if kind == "integer" and not -INT64 <= value < INT64:
        errs.append(f"{path}: Invalid value: {value}: must be a 64-bit integer")
        blocked.append(path)
        return False
    if "enum" in schema and value not in schema["enum"]:
        choices = ", ".join(f'"{c}"' for c in schema["enum"])
        errs.append(f"{path}: Unsupported value: {_show(value)}: supported values: {choices}")
        blocked.append(path)
    if kind in ("integer", "number"):
        low, high = schema.get("minimum"), schema.get("maximum")
        if low is not None and (value <= low if schema.get("exclusiveMinimum") else value < low):
            op = ">" if schema.get("exclusiveMinimum") else ">="
            errs.append(f"{path}: Invalid value: {value}: must be {op} {low}{_range(schema)}")
        if high is not None and (value >= high if schema.get("exclusiveMaximum") else value > high):
            op = "<" if schema.get("exclusiveMaximum") else "<="
            errs.append(f"{path}: Invalid value: {value}: must be {op} {high}{_range(schema)}")
    if kind == "string":
        if "minLength" in schema and len(value) < schema["minLength"]:
            errs.append(
                f"{path}: Invalid value: {_show(value)}: should be at least {schema['minLength']} chars long"
            )
        if "maxLength" in schema and len(value) > schema["maxLength"]:
            errs.append(
                f"{path}: Too long: may not be more than {schema['maxLength']} characters (has {len(value)})"
            )
            blocked.append(path)
        if "pattern" in schema and not re.search(schema["pattern"], value):
            hint = schema.get("x-rlhf-valid")
            valid = f"valid: {hint}" if hint else f"must match {schema['pattern']}"
            errs.append(f"{path}: Invalid value: {_show(value)}: {valid}")
    if kind == "array" and "maxItems" in schema and len(value) > schema["maxItems"]:
        errs.append(f"{path}: Too many: {len(value)}: must have at most {schema['maxItems']} items")
        blocked.append(path)
    if kind == "object":
        if "maxProperties" in schema and len(value) > schema["maxProperties"]:
            errs.append(f"{path}: Too many: {len(value)}: must have at most {schema['maxProperties']} items")
            blocked.append(path)
        for key in schema.get("required", []):
            if key not in value:
                errs.append(f"{_join(path, key)}: Required value")
                blocked.append(_join(path, key))
        props = schema.get("properties")
        if (
            props is not None
            and "additionalProperties" not in schema
            and not schema.get("x-kubernetes-preserve-unknown-fields")
        ):
            for key in value:
                if key not in props:
                    valid = ", ".join(props)
                    errs.append(
                        f'{_join(path, key)}: unknown field "{_join(path, key)}"; valid fields: {valid}'
                    )
    return True


def _range(schema: dict[str, Any]) -> str:
    low, high = schema.get("minimum"), schema.get("maximum")
    if low is None or high is None:
        return ""
    left = "(" if schema.get("exclusiveMinimum") else "["
    right = ")" if schema.get("exclusiveMaximum") else "]"
    return f" (valid: {left}{low}, {high}{right})"


def _is_transition(rule: str) -> bool:
    return re.search(r"\boldSelf\b", rule) is not None


def _rules(schema: dict[str, Any], value: Any, old: Any, path: str, errs: list[str]) -> None:
    for r in schema.get("x-kubernetes-validations", []):
        rule = r["rule"]
        activation = {"self": to_cel(schema, value)}
        if _is_transition(rule):
            if old is _ABSENT:
                continue
            activation["oldSelf"] = to_cel(schema, old)
        where = (path + r.get("fieldPath", "")).lstrip(".")
        try:
            ok = eval_cel(rule, activation)
        except Exception as err:  # noqa: BLE001 - the server reports an evaluation error as a refusal
            errs.append(
                f'{where}: Invalid value: "object": {_eval_error(err)} evaluating rule: {r.get("message", rule)}'
            )
            continue
        if ok:
            continue
        message = r.get("message", "")
        if "messageExpression" in r:
            try:
                message = str(eval_cel(r["messageExpression"], activation))
            except Exception as err:  # noqa: BLE001 - the server falls back to `message`, then the rule
                if STRICT_MESSAGES:
                    raise RuntimeError(
                        f"{where}: messageExpression failed: {err}: {r['messageExpression']}"
                    ) from err
                message = message or f"failed rule: {rule}"
        message = message or f"failed rule: {rule}"
        if not where:
            # A rule of the root (the job's name: the API server lets no `fieldPath` point into
            # metadata) begins its message with the field it is about.
            errs.append(message)
            continue
        errs.append(f"{where}: Invalid value: {_show(_at(value, r.get('fieldPath', '')))}: {message}")


def _at(value: Any, field_path: str) -> Any:
    for key in [k for k in field_path.split(".") if k]:
        if not isinstance(value, dict) or key not in value:
            return "object"
        value = value[key]
    return value


def _eval_error(err: Exception) -> str:
    """celpy's error in the API server's words (`no such key: nodePools`)."""
    text = str(err.args[0] if err.args else err)
    missing = re.search(r"no such (?:key|member)[^']*'(\w+)'", text)
    return f"no such key: {missing.group(1)}" if missing else text


#: Said when a blocking schema violation kept the CEL rules from being evaluated (the API server's
#: words, without its `<nil>: Invalid value: "null": ` prefix).
RULES_NOT_CHECKED = (
    "some validation rules were not checked because the object was invalid; correct the existing "
    "errors to complete validation"
)


def _walk(
    schema: dict[str, Any],
    value: Any,
    old: Any,
    path: str,
    errs: list[str],
    blocking: list[str] | None = None,
    structure: bool = True,
    rules: bool = True,
) -> None:
    """The schema's checks of `value` (`structure`) and its CEL rules (`rules`). `admit` runs
    the rules in a pass of their own, only over an object without blocking violations."""
    if structure:
        if not _structural(schema, value, path, errs, blocking):
            return
    elif value is None:  # (nullable: the schema pass stopped here too)
        return
    kind = schema.get("type")
    if kind == "object" and isinstance(value, dict):
        props = schema.get("properties", {})
        extra = schema.get("additionalProperties")
        old_map = old if isinstance(old, dict) else {}
        for key, item in value.items():
            sub = props.get(key, extra if isinstance(extra, dict) else None)
            if sub is not None:
                _walk(
                    sub, item, old_map.get(key, _ABSENT), _join(path, key), errs, blocking, structure, rules
                )
    elif kind == "array" and isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(value):
            # Transition rules below an atomic list have no old value (the server's rule too).
            _walk(schema["items"], item, _ABSENT, f"{path}[{i}]", errs, blocking, structure, rules)
    if rules:
        _rules(schema, value, old, path, errs)


def _metadata_errors(meta: Any) -> list[str]:
    """What the API server checks of an object's metadata that the CRD schema does not say."""
    if not isinstance(meta, dict):
        return [f"metadata: Invalid value: {_show(meta)}: must be a mapping"]
    errs = [
        f'metadata.{key}: unknown field "metadata.{key}"; valid fields: {", ".join(OBJECT_META_FIELDS)}'
        for key in meta
        if key not in OBJECT_META_FIELDS
    ]
    name = meta.get("name")
    if not isinstance(name, str) or not name:
        errs.append("metadata.name: Required value: name is required (e.g. grpo-run-1)")
    for kind in ("labels", "annotations"):
        values = meta.get(kind)
        if values is None:
            continue
        if not isinstance(values, dict) or not all(isinstance(v, str) for v in values.values()):
            errs.append(f"metadata.{kind}: Invalid value: must be a mapping of strings to strings")
    return errs


def admit(doc: dict[str, Any], old: dict[str, Any] | None = None) -> tuple[dict[str, Any], list[str]]:
    """Run `doc` through the API server's admission of the CRD: returns the object as stored
    (nulls pruned, defaults applied) and the violations, one `<field path>: <message>` each.
    `old`: the stored object, for an update (transition rules: immutability)."""
    schema = job_schema_cached()
    body = {k: v for k, v in doc.items() if k != "status"}
    errs = _metadata_errors(body.get("metadata"))
    if errs:
        return body, errs
    obj = apply_defaults(schema, prune_nulls(schema, body))
    previous: Any = _ABSENT
    if old is not None:
        old_body = {k: v for k, v in old.items() if k != "status"}
        previous = apply_defaults(schema, prune_nulls(schema, old_body))
    return obj, errs + _violations(schema, obj, previous, "")


def admit_spec(spec: Any) -> list[str]:
    """The violations of a job's `spec` alone, as `admit` finds them in a whole object (no
    metadata, no update): what `parse_spec` refuses, for callers holding a spec mapping only."""
    schema = job_schema_cached()["properties"]["spec"]
    return _violations(schema, apply_defaults(schema, prune_nulls(schema, spec)), _ABSENT, "spec")


def _violations(schema: dict[str, Any], obj: Any, previous: Any, path: str) -> list[str]:
    """As the API server: the schema first; its CEL rules only when no violation blocks them
    (a rule over a field of the wrong type would only fail to evaluate)."""
    errs: list[str] = []
    blocking: list[str] = []
    _walk(schema, obj, previous, path, errs, blocking, rules=False)
    if blocking:
        errs.append(RULES_NOT_CHECKED)
    else:
        _walk(schema, obj, previous, path, errs, structure=False)
    return errs


@functools.lru_cache(maxsize=1)
def job_schema_cached() -> dict[str, Any]:
    """`job_schema()`, built once per process (callers must not modify it)."""
    return job_schema()
