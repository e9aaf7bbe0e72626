"""Prints the requirements of the given extras of rlhf-operator, one per line, from pyproject.toml.

Used by the Dockerfile to install an image's dependencies in their own layer, keyed only on
pyproject.toml, so that a change of the project's source rebuilds only the small layer holding
the project itself:

    python3 image_requirements.py pyproject.toml trainer operator
"""

from __future__ import annotations

import re
import sys

import tomllib


def requirements(pyproject: dict, extras: list[str]) -> list[str]:
    project = pyproject["project"]
    name = project["name"]
    optional = project.get("optional-dependencies", {})
    unknown = [e for e in extras if e not in optional]
    if unknown:
        raise SystemExit(f"unknown extras {unknown}; valid: {sorted(optional)}")
    out: list[str] = list(project.get("dependencies", []))
    seen: set[str] = set()
    todo = list(extras)
    while todo:
        extra = todo.pop()
        if extra in seen:
            continue
        seen.add(extra)
        for req in optional[extra]:
            # A self-reference such as "rlhf-operator[trainer,operator]" pulls in other extras.
            m = re.fullmatch(rf"{re.escape(name)}\[([^\]]+)\]", req.replace(" ", ""))
            if m:
                todo += m.group(1).split(",")
            elif req not in out:
                out.append(req)
    return out


def main(argv: list[str]) -> int:
    if len(argv) < 1:
        print("usage: image_requirements.py PYPROJECT [EXTRA...]", file=sys.stderr)
        return 2
    with open(argv[0], "rb") as f:
        doc = tomllib.load(f)
    print("\n".join(requirements(doc, argv[1:])))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
