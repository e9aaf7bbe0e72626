"""The user's code a manifest names by import path (`package.module:attr`): which fields hold one
(`import_paths`), the one way the trainer turns a path into an object (`import_object`), the
PYTHONPATH its processes import with (`worker_pythonpath`), and `check_imports`, which
`rlhf validate` runs: each path resolved as the trainer resolves it (`resolve`), in a subprocess
cut at a timeout, so that a missing module, a missing attribute, an object of the wrong kind, an
import that raises or one that hangs is reported in a second, naming the field, rather than after
Ray starts.

Imports resolve as in the trainer's processes: from the current directory, then this process's
`sys.path` (its PYTHONPATH among it). A pod's current directory is `/workspace`; the manifest's
own folder is not on the path. Torch-free (a custom algorithm's module imports torch itself).

Run as `python -m rlhf_trainer.user_code`: the subprocess side, reading `{"path": PYTHONPATH,
"imports": [[field, value, kind], ...]}` as JSON on stdin and writing one JSON line per path as
each resolves.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import traceback
from dataclasses import dataclass
from typing import Any

#: Seconds `rlhf validate` waits for the user's imports (`--import-timeout`): enough for a module
#: that imports torch (a custom algorithm does) on a loaded machine; a hanging import is cut there.
IMPORT_TIMEOUT_S = 10.0

#: The project's own package: a path into it (`rlhf_trainer.rewards.builtin:final_answer`) is
#: resolved in this process (its modules are installed wherever the trainer is and never hang).
BUILTIN_PACKAGE = "rlhf_trainer"


class ImportPathError(ValueError):
    """An import path whose module cannot be imported or has no such attribute."""


def import_object(path: str) -> Any:
    """`package.module:attr` (attr may be dotted: `pkg.mod:Outer.inner`) -> the object. Raises
    ImportPathError (a malformed path, a module that cannot be imported, a missing attribute); any
    other exception the module raises while it is imported propagates."""
    if ":" not in path:
        raise ImportPathError(f"import path {path!r} must look like package.module:name")
    module_name, attr = path.split(":", 1)
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as err:
        raise ImportPathError(f"cannot import module {module_name!r}: {err}") from err
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ImportPathError(f"module {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    return obj


def worker_pythonpath() -> str:
    """The PYTHONPATH of the trainer's worker processes (Ray's `runtime_env`) and of
    `check_imports`: the current directory, then this process's `sys.path`."""
    return os.pathsep.join(p for p in [os.getcwd(), *sys.path] if p)


@dataclass(frozen=True)
class ImportPath:
    """One field of a manifest naming user code."""

    field: str
    """Where it is, e.g. `spec.reward.functions[1].path`."""
    value: str
    kind: str
    """How the trainer uses it: `reward`, `algorithm`, `environment`, `pipeline` or `component` (a
    built-in algorithm's estimator, loss, ... by path) (`resolve`)."""

    @property
    def builtin(self) -> bool:
        module = self.value.split(":", 1)[0]
        return module == BUILTIN_PACKAGE or module.startswith(BUILTIN_PACKAGE + ".")


def import_paths(spec: Any) -> list[ImportPath]:
    """Every import path of a `JobSpec`. A built-in algorithm is a name, not a path."""
    found = [
        ImportPath(f"spec.reward.functions[{i}].path", f.path, "reward")
        for i, f in enumerate(spec.reward.functions)
    ]
    if ":" in spec.algorithm.name:
        found.append(ImportPath("spec.algorithm.name", spec.algorithm.name, "algorithm"))
    found += _component_paths(spec.algorithm.name, spec.algorithm.params)
    if spec.rollout.multi_turn is not None:
        found.append(
            ImportPath(
                "spec.rollout.multiTurn.environment", spec.rollout.multi_turn.environment, "environment"
            )
        )
    if spec.pipeline:
        found.append(ImportPath("spec.pipeline", spec.pipeline, "pipeline"))
    return found


def _component_paths(algorithm: str, params: dict[str, Any]) -> list[ImportPath]:
    """A built-in algorithm's params that name a user's component by import path (an open
    `Choices` param given `package.module:attr`: `advantageEstimator: my_pkg.adv:estimate`).
    A custom algorithm's params are its own to interpret."""
    import dataclasses

    from rlhf_api.algorithm_params import BUILTIN_PARAMS, Choices, camel

    cls = BUILTIN_PARAMS.get(algorithm)
    if cls is None:
        return []
    found = []
    for f in dataclasses.fields(cls):
        choices, value = f.metadata.get("choices"), params.get(camel(f.name))
        if isinstance(choices, Choices) and choices.open and isinstance(value, str) and ":" in value:
            found.append(ImportPath(f"spec.algorithm.params.{camel(f.name)}", value, "component"))
    return found


def _component(path: str) -> Any:
    obj = import_object(path)  # what `Registry.get` returns for an import path
    if not callable(obj):
        raise TypeError(f"{path!r} is a {type(obj).__name__}, not a function or class")
    return obj


def _algorithm(path: str) -> Any:
    obj = import_object(path)
    # An Algorithm subclass's module has imported the algorithm library; when it is not loaded,
    # the object cannot be one (and nothing imports torch to find that out).
    base = sys.modules.get("rlhf_trainer.algorithms.base")
    if not (isinstance(obj, type) and base is not None and issubclass(obj, base.Algorithm)):
        raise TypeError(f"{path!r} is {obj!r}, not a subclass of rlhf_trainer.algorithms.Algorithm")
    return obj


def _pipeline(path: str) -> Any:
    obj = import_object(path)
    if not callable(obj):
        raise TypeError(f"{path!r} is a {type(obj).__name__}, not a function build(ctx) -> DataStream")
    return obj


def resolve(kind: str, path: str) -> Any:
    """The object the trainer builds `kind` from (each kind's own resolver; nothing is constructed)."""
    if kind == "reward":
        from rlhf_trainer.rewards import reward_object

        return reward_object(path)
    if kind == "environment":
        from rlhf_trainer.environments import environment_class

        return environment_class(path)
    if kind == "algorithm":
        return _algorithm(path)
    if kind == "pipeline":
        return _pipeline(path)
    if kind == "component":
        return _component(path)
    raise ValueError(f"unknown kind of import path {kind!r}")


def _cause(err: BaseException) -> str:
    """The exception's last line, as a traceback ends (`ModuleNotFoundError: No module named 'x'`)."""
    return traceback.format_exception_only(type(err), err)[-1].strip()


def _error(p: ImportPath, cause: str) -> str:
    return f"{p.field}: {p.value!r} cannot be used: {cause}"


def check_imports(paths: list[ImportPath], timeout: float = IMPORT_TIMEOUT_S) -> list[str]:
    """One error per path the trainer would refuse, naming the field, the value and the cause.
    Built-in paths resolve here; the user's in one subprocess (`worker_pythonpath`, the current
    directory), killed after `timeout` seconds: the path it was importing then is reported as
    hanging, the ones after it as not checked."""
    found: dict[ImportPath, str] = {}
    user = []
    for p in paths:
        if not p.builtin:
            user.append(p)
            continue
        try:
            resolve(p.kind, p.value)
        except Exception as err:
            found[p] = _error(p, _cause(err))
    if user:
        found.update(_check_in_subprocess(user, timeout))
    return [found[p] for p in paths if p in found]  # in the manifest's order


def _check_in_subprocess(user: list[ImportPath], timeout: float) -> dict[ImportPath, str]:
    errors: dict[ImportPath, str] = {}
    proc = subprocess.Popen(
        [sys.executable, "-m", "rlhf_trainer.user_code"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    # The workers' PYTHONPATH, put first on the child's sys.path as PYTHONPATH would be.
    request = json.dumps({"path": worker_pythonpath(), "imports": [[p.field, p.value, p.kind] for p in user]})
    timed_out = False
    try:
        out, err_text = proc.communicate(request, timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        proc.kill()
        out, err_text = proc.communicate()
    done: dict[int, str | None] = {}
    for line in out.splitlines():
        try:
            item = json.loads(line)
            done[int(item["i"])] = item["error"]
        except (ValueError, KeyError, TypeError):
            continue
    first_missing = True
    for i, p in enumerate(user):
        if i in done:
            if done[i] is not None:
                errors[p] = _error(p, str(done[i]))
        elif timed_out and first_missing:
            errors[p] = _error(
                p, f"importing it did not finish in {timeout:g} s (cut; --import-timeout sets the wait)"
            )
            first_missing = False
        elif timed_out:
            errors[p] = f"{p.field}: {p.value!r} not checked (an import before it did not finish)"
        else:
            last = (err_text.strip().splitlines() or [f"exit status {proc.returncode}"])[-1]
            errors[p] = _error(p, f"the importing process ended early: {last}")
    return errors


def _serve() -> None:
    """The subprocess: resolve each path of the request, one JSON line per path as it finishes.
    What the user's modules print goes to stderr, so it cannot garble the answers."""
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    request = json.load(sys.stdin)
    first = request["path"].split(os.pathsep)
    sys.path[:] = first + [p for p in sys.path if p not in first]
    for i, (field, value, kind) in enumerate(request["imports"]):
        try:
            resolve(kind, value)
            error = None
        except BaseException as err:  # SystemExit and the like in a user's module are causes too
            error = _cause(err)
        answers.write(json.dumps({"i": i, "field": field, "error": error}) + "\n")
        answers.flush()
    os._exit(0)  # not waiting for threads a user's module started


if __name__ == "__main__":
    _serve()
