"""The boundaries of `rlhf_api`: the package the operator and the trainer share imports neither of
them nor anything heavy, and they meet only there.

Checked twice: statically (every import statement of a package, those inside functions too, so
a lazy import cannot hide), and by importing every module of `rlhf_api` in a fresh interpreter
and looking at what got loaded.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
API = ROOT / "api" / "rlhf_api"
OPERATOR = ROOT / "operator" / "rlhf_operator"
TRAINER = ROOT / "trainer" / "rlhf_trainer"
#: What `rlhf_api` may never import: the two packages that use it, and the runtimes it must not
#: pull into the operator (torch, Ray, kopf, the Kubernetes client).
FORBIDDEN = {"torch", "ray", "kopf", "kubernetes", "transformers", "vllm", "rlhf_operator", "rlhf_trainer"}
#: Third-party modules it may import: PyYAML, cel-python, and prometheus_client's text parser
#: (lazily, for a scraped /metrics).
ALLOWED_THIRD_PARTY = {"yaml", "celpy", "prometheus_client"}


def imported_roots(package: Path) -> dict[str, set[str]]:
    """Top-level module names imported anywhere in `package`, by file."""
    found: dict[str, set[str]] = {}
    for path in package.rglob("*.py"):
        names: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
        found[str(path.relative_to(ROOT))] = names
    return found


def test_the_api_imports_neither_side_nor_a_runtime() -> None:
    bad = {f: sorted(n & FORBIDDEN) for f, n in imported_roots(API).items() if n & FORBIDDEN}
    assert not bad, f"rlhf_api must not import these: {bad}"


def test_the_api_imports_only_the_standard_library_yaml_and_cel() -> None:
    stdlib = set(sys.stdlib_module_names)
    extra = {
        f: sorted(n - stdlib - ALLOWED_THIRD_PARTY - {"rlhf_api", "__future__"})
        for f, n in imported_roots(API).items()
    }
    assert not {f: n for f, n in extra.items() if n}, extra


def test_importing_every_api_module_loads_no_runtime() -> None:
    modules = sorted(
        ".".join(p.relative_to(API.parent).with_suffix("").parts).removesuffix(".__init__")
        for p in API.rglob("*.py")
    )
    code = (
        "import importlib, sys\n"
        f"for m in {modules!r}: importlib.import_module(m)\n"
        f"loaded = sorted(set({sorted(FORBIDDEN)!r}) & {{m.split('.')[0] for m in sys.modules}})\n"
        "assert not loaded, loaded\n"
        "print(len(sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert len(modules) >= 14  # the package's files, so that the loop above is not empty


def test_the_operator_and_the_trainer_meet_only_in_the_api() -> None:
    op = {f: n for f, n in imported_roots(OPERATOR).items() if "rlhf_trainer" in n}
    tr = {f: n for f, n in imported_roots(TRAINER).items() if "rlhf_operator" in n}
    assert not op, f"the operator imports the trainer: {sorted(op)}"
    assert not tr, f"the trainer imports the operator: {sorted(tr)}"


def test_the_operator_runs_without_the_trainer_as_in_its_image() -> None:
    """The operator image installs `rlhf_api` and `rlhf_operator` only: with `rlhf_trainer` made
    unimportable, the handlers load and `python -m rlhf_operator operator --help` answers."""
    code = (
        "import runpy, sys\n"
        "sys.modules['rlhf_trainer'] = None\n"
        "import rlhf_operator.handlers, rlhf_operator.reconcile, rlhf_operator.crd\n"
        "assert 'torch' not in sys.modules and 'ray' not in sys.modules\n"
        "sys.argv = ['rlhf_operator', 'operator', '--help']\n"
        "runpy.run_module('rlhf_operator', run_name='__main__')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "--max-pods-per-job" in out.stdout
