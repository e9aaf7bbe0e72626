"""The loader: a manifest (YAML or an object read from the API server) is admitted with the CRD's
own schema and CEL rules (`admission`) and then converted into typed sections (`parse_job`): an
unknown key names its path and the valid keys, a wrong type names the field, the value and what
is valid.

Importable without torch, Ray or a Kubernetes client.
"""

from __future__ import annotations

import dataclasses
import re
import sys
import typing
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import yaml

from rlhf_api import admission
from rlhf_api.contract import (
    API_VERSION,
    KIND,
)
from rlhf_api.fields import (
    MAX_FREE_FORM_DEPTH,
    MAX_FREE_FORM_PROPERTIES,
    PATTERN_HINTS,
    SpecError,
    _describe,
    _hints,
    _unwrap_optional,
    camel,
)
from rlhf_api.job import JobSpec, RLTrainingJob

# --------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------


def _convert(tp: Any, value: Any, path: str, errs: list[str], meta: dict[str, Any]) -> Any:
    inner, optional = _unwrap_optional(tp)
    if value is None:
        if optional:
            return None
        errs.append(f"{path}: must not be null; expected {_describe(inner)}")
        return None
    origin = get_origin(inner)
    if dataclasses.is_dataclass(inner):
        if not isinstance(value, dict):
            errs.append(f"{path}: expected a mapping, got {value!r}")
            return None
        return _build(inner, value, path, errs)
    if origin is Literal:
        if value not in get_args(inner):
            errs.append(
                f"{path}: {value!r} is not valid; valid: {', '.join(str(a) for a in get_args(inner))}"
            )
        return value
    if origin is list:
        if not isinstance(value, list):
            errs.append(f"{path}: expected a list, got {value!r}")
            return []
        (item,) = get_args(inner)
        return [_convert(item, v, f"{path}[{i}]", errs, {}) for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            errs.append(f"{path}: expected a mapping, got {value!r}")
            return {}
        _, vt = get_args(inner)
        if vt is Any:
            return dict(value)
        return {k: _convert(vt, v, f"{path}.{k}", errs, {}) for k, v in value.items()}
    if inner is Any:
        return value
    ok = (
        (inner is bool and isinstance(value, bool))
        or (inner is int and isinstance(value, int) and not isinstance(value, bool))
        or (inner is float and isinstance(value, (int, float)) and not isinstance(value, bool))
        or (inner is str and isinstance(value, str))
    )
    if not ok:
        errs.append(f"{path}: {value!r} is not {_describe(inner)}")
        return value
    if inner is float:
        value = float(value)
    _check_bounds(value, path, errs, meta)
    return value


def _check_bounds(value: Any, path: str, errs: list[str], meta: dict[str, Any]) -> None:
    if "minimum" in meta and value < meta["minimum"]:
        errs.append(f"{path}: {value!r} is below the minimum {meta['minimum']}")
    if "exclusive_minimum" in meta and value <= meta["exclusive_minimum"]:
        errs.append(f"{path}: {value!r} must be greater than {meta['exclusive_minimum']}")
    if "maximum" in meta and value > meta["maximum"]:
        errs.append(f"{path}: {value!r} is above the maximum {meta['maximum']}")
    if "max_length" in meta and len(value) > meta["max_length"]:
        errs.append(f"{path}: {len(value)} characters is too long; valid: at most {meta['max_length']}")
    if "min_length" in meta and len(value) < meta["min_length"]:
        errs.append(f"{path}: {value!r} is too short; valid: at least {meta['min_length']} character(s)")
    if "pattern" in meta and isinstance(value, str) and not re.match(meta["pattern"], value):
        valid = meta.get("valid") or PATTERN_HINTS.get(meta["pattern"])
        if valid:
            errs.append(f"{path}: {value!r} is not valid; valid: {valid}")
        else:
            errs.append(f"{path}: {value!r} does not match {meta['pattern']}")


def free_form_errors(value: Any, path: str, max_depth: int = MAX_FREE_FORM_DEPTH) -> list[str]:
    """A free-form value nested deeper than `max_depth` (a scalar is depth 0, `{a: 1}` depth 1), or
    a mapping with more than `MAX_FREE_FORM_PROPERTIES` keys, anywhere in it; the error names the
    first such place. Walked with an explicit stack, so a value nested thousands deep is refused,
    not a RecursionError."""
    stack: list[tuple[Any, int, str]] = [(value, 0, path)]
    while stack:
        node, depth, where = stack.pop()
        if not isinstance(node, (dict, list)):
            continue
        if depth + 1 > max_depth:
            return [f"{path}: nested deeper than {max_depth} levels (at {where}); valid: at most {max_depth}"]
        if isinstance(node, dict) and len(node) > MAX_FREE_FORM_PROPERTIES:
            return [
                f"{where}: a mapping of {len(node)} keys; valid: at most {MAX_FREE_FORM_PROPERTIES} keys per mapping"
            ]
        items = node.items() if isinstance(node, dict) else enumerate(node)
        stack.extend(
            (v, depth + 1, f"{where}.{k}" if isinstance(node, dict) else f"{where}[{k}]") for k, v in items
        )
    return []


def _build(cls: Any, data: dict[str, Any], path: str, errs: list[str]) -> Any:
    hints = _hints(cls)
    fields = {camel(f.name): f for f in dataclasses.fields(cls)}
    before = len(errs)
    for key in data:
        if key not in fields:
            errs.append(f"{path}.{key}: unknown field; valid fields: {', '.join(fields)}")
    kwargs: dict[str, Any] = {}
    for key, f in fields.items():
        sub = f"{path}.{key}"
        if key in data:
            if f.metadata.get("free_form") and (deep := free_form_errors(data[key], sub)):
                errs.extend(deep)  # before anything walks it: it may be nested too deep to walk
                continue
            kwargs[f.name] = _convert(hints[f.name], data[key], sub, errs, dict(f.metadata))
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            errs.append(f"{sub}: required field is missing ({f.metadata.get('doc', '')})")
    try:
        obj = cls(**kwargs)
    except TypeError:
        return None  # missing required fields, already reported
    # A section's own check of what CEL cannot see (`AlgorithmSpec.check`: free-form customParams),
    # once its fields are individually valid. Every other rule is CEL (`admission`).
    if len(errs) == before and hasattr(obj, "check"):
        errs.extend(obj.check(path))
    return obj


def _typed_spec(spec: Any, path: str, errs: list[str]) -> JobSpec | None:
    """The typed JobSpec of a `spec` mapping (conversion only), its problems added to `errs`."""
    if not isinstance(spec, dict):
        errs.append(f"{path}: expected a mapping, got {spec!r}")
        return None
    return typing.cast("JobSpec | None", _build(JobSpec, spec, path, errs))


def _merge(errs: list[str], server: list[str]) -> list[str]:
    """`errs` then the rule violations of `server` on fields `errs` does not already name (the
    loader's conversion and the schema's own pass both refuse a wrongly typed field)."""
    named = {e.split(":", 1)[0].strip() for e in errs}
    return errs + [e for e in server if e.split(":", 1)[0].strip() not in named]


def parse_spec(spec: dict[str, Any]) -> JobSpec:
    """A JobSpec from the `spec` mapping of a manifest: converted into typed sections, and held
    to the CRD's schema and CEL rules (`admission.admit_spec`, the same expressions the API
    server evaluates). Raises SpecError with every problem found."""
    errs: list[str] = []
    job = _typed_spec(spec, "spec", errs)
    errs = _merge(errs, admission.admit_spec(spec) if isinstance(spec, dict) else [])
    if errs or job is None:
        raise SpecError(errs)
    return job


#: Deepest nesting of a whole job document: the structured spec needs about 12 levels, a free-form
#: field at its deepest place `MAX_FREE_FORM_DEPTH` more.
MAX_DOCUMENT_DEPTH = 32


def _too_deep(doc: dict[str, Any]) -> list[str]:
    """The document's spec nested deeper than `MAX_DOCUMENT_DEPTH` below `spec`, named by its path
    (the status's schema has no free-form field: the API server bounds its depth)."""
    return free_form_errors(doc.get("spec"), "spec", MAX_DOCUMENT_DEPTH)


def parse_job(
    doc: dict[str, Any], old: dict[str, Any] | None = None, *, admitted: bool = False
) -> RLTrainingJob:
    """Validate a whole RLTrainingJob object (as read from YAML or the API server).

    The typed spec is converted from the object, and the CRD's own schema and CEL rules are
    evaluated as the API server applies them (`admission`; `old`: the stored object, for an
    update). Every rule is CEL, written once beside its fields; the loader only converts types.

    `admitted`: `doc` was read from an API server that has already enforced exactly these schema
    and CEL rules (the operator decides that from the installed CRD's schema digest, see
    `rlhf_operator.crd`); their evaluation here (most of the cost, and the CEL interpreter's
    memory) is skipped; the conversion still runs. Everything that reads a manifest
    without an API server (`rlhf validate`, `rlhf run`) leaves it False."""
    errs: list[str] = []
    if not isinstance(doc, dict):
        raise SpecError([f"manifest: expected a mapping, got {type(doc).__name__}"])
    if deep := _too_deep(doc):  # before any recursive walk (defaulting, CEL) meets it
        raise SpecError(deep)
    # As the API server: a null where the schema allows none is dropped (then defaulted).
    doc = admission.prune_nulls(admission.job_schema_cached(), doc)
    if doc.get("apiVersion") != API_VERSION:
        errs.append(f"apiVersion: {doc.get('apiVersion')!r} is not valid; expected {API_VERSION!r}")
    if doc.get("kind") != KIND:
        errs.append(f"kind: {doc.get('kind')!r} is not valid; expected {KIND!r}")
    raw_meta = doc.get("metadata")
    meta: dict[str, Any] = raw_meta if isinstance(raw_meta, dict) else {}
    for key in doc:
        if key not in ("apiVersion", "kind", "metadata", "spec", "status"):
            errs.append(f"{key}: unknown top-level field; valid: apiVersion, kind, metadata, spec")
    spec = _typed_spec(doc.get("spec"), "spec", errs)
    # The CRD's own schema and rules (the job's name among them), evaluated as the API server
    # does, unless it already has.
    errs = _merge(errs, [] if admitted else admission.admit(doc, old)[1])
    if errs or spec is None:
        raise SpecError(errs)
    return RLTrainingJob(
        metadata_name=str(meta.get("name")), namespace=meta.get("namespace") or "default", spec=spec, raw=doc
    )


#: How `rlhf validate` and `rlhf run` name standard input (`-`) in what they print.
STDIN_NAME = "<stdin>"


def manifest_name(path: str | Path) -> str:
    """How messages name the manifest at `path`: its path, or `<stdin>` for `-`."""
    return STDIN_NAME if str(path) == "-" else str(path)


def manifest_dir(path: str | Path) -> Path:
    """The folder a manifest's relative paths resolve against: the manifest file's own folder; the
    current directory for one read from standard input (`-`), as for one read from the API server
    (the controller pod's current directory, `/workspace`)."""
    return Path.cwd() if str(path) == "-" else Path(path).resolve().parent


def resolve_path(path: str, folder: Path) -> str:
    """A manifest's path (`model.path`, `data.path`, ...) made absolute: `~` expanded, a relative
    one against `folder` (`manifest_dir`); an `org/name` hub id stays as it is unless a local
    folder of that name exists."""
    p = Path(path).expanduser()
    if p.is_absolute():
        return str(p)
    local = folder / p
    if local.exists() or path.startswith(".") or not _looks_like_hub_id(path):
        return str(local.resolve())
    return path


def _looks_like_hub_id(path: str) -> bool:
    parts = path.split("/")
    return len(parts) == 2 and all(parts) and not path.startswith(("/", "~", "."))


def read_manifest(path: str | Path) -> dict[str, Any]:
    """The one RLTrainingJob document of a YAML file (`-`: standard input), as a mapping. Raises SpecError."""
    p = manifest_name(path)
    try:
        text = sys.stdin.read() if str(path) == "-" else Path(path).read_text()
    except OSError as err:
        raise SpecError([f"{p}: cannot read the manifest: {err.strerror}"]) from err
    try:
        docs = [d for d in yaml.safe_load_all(text) if d is not None]
    except yaml.YAMLError as err:
        raise SpecError([f"{p}: not valid YAML: {err}"]) from err
    jobs = [d for d in docs if isinstance(d, dict) and d.get("kind") == KIND]
    if len(jobs) != 1:
        raise SpecError([f"{p}: expected exactly one {KIND} document, found {len(jobs)}"])
    return typing.cast(dict[str, Any], jobs[0])


def load_manifest(path: str | Path, old: str | Path | None = None) -> RLTrainingJob:
    """Read a YAML file holding one RLTrainingJob. Raises SpecError with every problem found.
    `old`: a manifest of the job as it exists, to check `path` as an update of it (immutable fields)."""
    return parse_job(read_manifest(path), read_manifest(old) if old is not None else None)
