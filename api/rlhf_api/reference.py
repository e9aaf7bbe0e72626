"""docs/manifest-reference.md, generated from the spec's dataclasses (`rlhf validate --reference`).

Importable without torch, Ray or a Kubernetes client.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
from typing import Any, get_args, get_origin

from rlhf_api import algorithm_schema
from rlhf_api.fields import _describe, _hints, _unwrap_optional, camel, to_dict
from rlhf_api.job import JobSpec

# --------------------------------------------------------------------------------------------
# Manifest reference (docs/manifest-reference.md is generated from this)
# --------------------------------------------------------------------------------------------


def reference_markdown() -> str:
    """A Markdown table per section: field, type, default, description. `rlhf crd --reference` prints it."""
    lines = [
        "# RLTrainingJob manifest reference",
        "",
        "Generated from `api/rlhf_api/` by `rlhf validate --reference`; do not edit by hand.",
        "Keys are camelCase. Cluster-only fields are validated by `rlhf run` and otherwise ignored there.",
        "",
    ]

    # A section shared by several fields (resources, pod settings) is documented at its first
    # path, where the others point.
    documented: dict[Any, str] = {}

    def section(cls: Any, path: str) -> None:
        hints = _hints(cls)
        lines.extend(
            [
                f"## `{path}`",
                "",
                inspect.cleandoc(cls.__doc__ or ""),
                "",
                "| field | type | default | description |",
                "|---|---|---|---|",
            ]
        )
        nested: list[tuple[Any, str]] = []
        for f in dataclasses.fields(cls):
            tp, _ = _unwrap_optional(hints[f.name])
            key = camel(f.name)
            item = get_args(tp)[0] if get_origin(tp) is list else tp
            sub_path = f"{path}.{key}" + ("[]" if item is not tp else "")
            seen_at = documented.get(item) if dataclasses.is_dataclass(item) else None
            if f.default is not dataclasses.MISSING:
                default = "—" if f.default is None else f"`{json.dumps(f.default)}`"
            elif f.default_factory is not dataclasses.MISSING:
                value = to_dict(f.default_factory())
                default = "see below" if dataclasses.is_dataclass(tp) else f"`{json.dumps(value)}`"
            else:
                default = "**required**"
            doc = f.metadata["doc"] + (" *Immutable.*" if f.metadata.get("immutable") else "")
            if seen_at is not None:
                default = f"as `{seen_at}`" if default == "see below" else default
                doc += f" Fields: as `{seen_at}`."
            lines.append(f"| `{key}` | {_describe(hints[f.name])} | {default} | {doc} |")
            if dataclasses.is_dataclass(item) and seen_at is None:
                documented[item] = sub_path
                nested.append((item, sub_path))
        lines.append("")
        for sub, sub_path in nested:
            section(sub, sub_path)

    section(JobSpec, "spec")
    lines.append(algorithm_schema.reference_markdown())
    return "\n".join(lines).rstrip() + "\n"
