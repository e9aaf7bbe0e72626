"""Prints the requirements of the given extras of rlhf-operator, one per line, from pyproject.toml.

Used by the Dockerfile to install an image's dependencies in their own layer, keyed only on
pyproject.toml, so that a change of the project's source rebuilds only the small layer holding
the project itself:

    python3 image_requirements.py pyproject.toml trainer operator
    python3 image_requirements.py pyproject.toml --constraints constraints/trainer-gpu.txt trainer operator gpu

With `--constraints FILE` and FILE present, the first line is `-c FILE`: pip then installs exactly
the versions FILE pins (`name==version` per line), so two builds of one commit get the same
packages. An absent FILE is skipped (the pins are not written yet), with a note on stderr.
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
    import argparse
    from pathlib import Path

    ap = argparse.ArgumentParser(prog="image_requirements.py")
    ap.add_argument("pyproject")
    ap.add_argument("--constraints", metavar="FILE", help="pin file to apply when it exists")
    ap.add_argument("extras", nargs="*")
    a = ap.parse_intermixed_args(argv)
    with open(a.pyproject, "rb") as f:
        doc = tomllib.load(f)
    lines = requirements(doc, a.extras)
    if a.constraints:
        if Path(a.constraints).is_file():
            lines.insert(0, f"-c {a.constraints}")
        else:
            print(f"image_requirements.py: no {a.constraints}: versions are not pinned", file=sys.stderr)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
