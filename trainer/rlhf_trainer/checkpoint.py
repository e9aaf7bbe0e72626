"""Checkpoints on a shared volume: each role's rank 0 writes its part, the controller publishes.

Layout of the checkpoint directory (`spec.checkpoint.dir`, default `<output.dir>/checkpoints`;
on a cluster a volume mounted at the same path in the controller pod and every actor and critic
pod)::

    step-000020/                       a published checkpoint: 20 steps done
      actor/                           written by actor rank 0
        model.safetensors              the full (unsharded) policy, tied weights under every name
        optimizer.safetensors          AdamW moments
        state.json                     optimizer param groups, LR schedule
        config.json                    the policy's transformers config (and generation_config.json)
        tokenizer/                     the tokenizer (`rlhf export` needs nothing else)
        PART                           written last: the part's files and their sizes
      actor/                           sharded instead with several FSDP2 ranks (no LoRA):
        dcp/                           a torch.distributed.checkpoint of the model and AdamW state:
          __<rank>_0.distcp            each rank's shards, written by that rank
          .metadata                    written by rank 0 after every rank wrote
        state.json                     {"format": "dcp", "scheduler": ...}
        config.json, tokenizer/, PART  as above, by rank 0 (PART lists every rank's files)
      critic/                          the same for the critic (PPO), without config and tokenizer
      controller/                      written by the controller
        trainer_state.json             step, policy version, data position, algorithm state
                                       (KL coefficient), Python/NumPy RNG states
        rng.safetensors                the controller's torch RNG state
        controller_tensors.safetensors with asynchronous rollouts (`rollout.maxStaleness`): the
                                       batch generated ahead for the next step (its texts in
                                       trainer_state.json), so a resume trains the same samples
        PART
      COMPLETE                         written last of all, after the rename: step, parts, sizes
    .staging-step-000030-<token>/      a checkpoint being written (the same layout, no COMPLETE)

`save` makes a fresh staging directory inside the checkpoint directory, asks each trained
role to write its part there (gathered: every rank gathers the sharded state and rank 0 writes;
sharded: every rank writes its own shards, then rank 0 the part marker), checks that
it can see every part a rank 0 reported (same files, same sizes: a volume that is not really
shared fails here, naming the host), writes its own part, renames the staging directory to
`step-NNNNNN` and writes `COMPLETE` into it. Only a directory whose `COMPLETE` marker parses and
whose files all have the sizes it lists counts as a checkpoint, so a run killed at any point
(between two roles' writes, before the rename, between rename and marker, during a copy on a
file system whose renames are not atomic) leaves nothing that resume would pick up; the next
save removes the leftovers. The newest `keep` checkpoints are kept.

Workers draw their random numbers from seeds derived from (seed, step, rank), so restoring the
step restores their streams too.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import secrets
import shutil
import socket
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

#: Written last into each role's part directory.
PART_MARKER = "PART"
#: Written last into a published step directory; a step directory without it is not a checkpoint.
COMPLETE = "COMPLETE"
STAGING_PREFIX = ".staging-"
PROBE_PREFIX = ".probe-"
CONTROLLER = "controller"
STATE_FILE = "trainer_state.json"
FORMAT = 1
#: A sharded part's DCP checkpoint directory (`torch.distributed.checkpoint`), and the `format`
#: its `state.json` names.
SHARDS_DIR = "dcp"
SHARDED_FORMAT = "dcp"
_STEP = re.compile(r"^step-(\d+)$")

#: The writer of a role's part returns what its rank 0 wrote (the part marker's content).
PartInfo = dict[str, Any]


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written, found or read; the message says what was expected."""


def step_name(step: int) -> str:
    return f"step-{step:06d}"


# --------------------------------------------------------------------------------------------
# Parts: what one role's rank 0 writes
# --------------------------------------------------------------------------------------------


def write_part(staging: str | Path, part: str, write: Callable[[Path], None]) -> PartInfo:
    """Write one role's part of a checkpoint into `staging/<part>/` and return its marker.

    `write(directory)` writes the files; then every file is flushed to disk and the `PART`
    marker (file sizes, host) is written last. `staging` must already exist: it is created by
    the controller, so a pod that does not see it is not on the shared volume.
    """
    out = prepare_part(staging, part)
    write(out)
    return finish_part(out, part)


def staging_problem(staging: str | Path, part: str) -> str | None:
    """Why this pod cannot write into the controller's staging directory (None when it can)."""
    root = Path(staging)
    if root.is_dir():
        return None
    return (
        f"checkpoint staging directory {root} does not exist on host {socket.gethostname()}: the "
        "controller created it there, so spec.checkpoint.dir is not a volume mounted at the same "
        f"path in this {part} pod and the controller pod"
    )


def prepare_part(staging: str | Path, part: str) -> Path:
    """An empty `staging/<part>/` (a retried write of the same save starts over), for the role's
    rank 0; with sharded checkpoints every rank then writes its shards into it."""
    problem = staging_problem(staging, part)
    if problem:
        raise CheckpointError(problem)
    out = Path(staging) / part
    if out.exists():  # a retried write of the same save
        shutil.rmtree(out)
    out.mkdir()
    return out


def finish_part(out: Path, part: str) -> PartInfo:
    """Flush every file of the part directory `out` to disk, then write its `PART` marker (file
    sizes, host) last and return it. Called by rank 0 once every rank's files are written."""
    files = {}
    for path in sorted(p for p in out.rglob("*") if p.is_file()):
        _fsync_file(path)
        files[path.relative_to(out).as_posix()] = path.stat().st_size
    for sub in sorted({p.parent for p in out.rglob("*")}, key=lambda p: len(p.parts), reverse=True):
        _fsync_dir(sub)
    info: PartInfo = {"part": part, "files": files, "host": socket.gethostname(), "time": time.time()}
    _write_json(out / PART_MARKER, info)
    return info


def shards_problem(directory: Path, metadata: Any, hosts: list[str]) -> str | None:
    """Why rank 0 does not see every file of the DCP checkpoint `directory` its ranks wrote (None
    when it does): each file DCP's `metadata` names must be there, at least as long as the last
    byte it says it holds. `hosts`: each rank's host, for the error."""
    ends: dict[str, int] = {}
    for info in metadata.storage_data.values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    for name, end in sorted(ends.items()):
        path = directory / name
        size = path.stat().st_size if path.is_file() else None
        if size is None or size < end:
            seen = "is missing" if size is None else f"has {size} bytes, its ranks wrote {end}"
            return (
                f"{path} {seen} on host {socket.gethostname()} (rank 0); the ranks ran on hosts "
                f"{', '.join(hosts)}: spec.checkpoint.dir must be one volume mounted at the same path in every pod"
            )
    return None


def part_problem(step_dir: str | Path, part: str, reported: PartInfo | None = None) -> str | None:
    """Why `step_dir/<part>` is not a complete part (None when it is). With `reported` (what the
    writer's rank 0 returned), the files seen here must also be the ones it wrote."""
    directory = Path(step_dir) / part
    marker = _read_json(directory / PART_MARKER)
    if marker is None:
        return f"{directory} has no {PART_MARKER} marker"
    files = marker.get("files")
    if not isinstance(files, dict):
        return f"{directory / PART_MARKER} lists no files"
    if reported is not None and reported.get("files") != files:
        return f"{directory / PART_MARKER} is not the marker its writer reported"
    return _size_problem(directory, files)


def part_dir(step_dir: str | Path, part: str) -> Path:
    """`step_dir/<part>`, checked complete (a clear error naming this host otherwise)."""
    problem = part_problem(step_dir, part)
    if problem:
        raise CheckpointError(
            f"cannot read the {part} part of checkpoint {step_dir} on host {socket.gethostname()}: "
            f"{problem} (is spec.checkpoint.dir mounted at the same path in every pod?)"
        )
    return Path(step_dir) / part


# --------------------------------------------------------------------------------------------
# Save, publish, prune
# --------------------------------------------------------------------------------------------


def save(
    root: str | Path,
    step: int,
    trainer_state: dict[str, Any],
    write_workers: Callable[[Path], Mapping[str, PartInfo]],
    keep: int,
    controller_tensors: Mapping[str, torch.Tensor] | None = None,
) -> Path:
    """Write checkpoint `step` (the number of completed steps); keep the newest `keep`.

    `write_workers(staging)` makes each trained role's rank 0 write its part into `staging` (the
    shared volume) with `write_part` and returns `{role: what its rank 0 returned}`; this
    function checks them, adds the controller's part and publishes the step directory.
    `controller_tensors`: tensors the controller keeps with its state (the batch generated
    ahead by asynchronous rollouts), read back with `load_controller_tensors`.
    """
    base = Path(root)
    base.mkdir(parents=True, exist_ok=True)
    remove_debris(base)
    staging = base / f"{STAGING_PREFIX}{step_name(step)}-{secrets.token_hex(4)}"
    staging.mkdir()
    try:
        reported = dict(write_workers(staging))
        for part, info in reported.items():
            problem = part_problem(staging, part, info)
            if problem:
                raise CheckpointError(
                    f"{part} rank 0 on host {info.get('host', '?')} wrote its part of {step_name(step)}, but "
                    f"the controller on host {socket.gethostname()} does not see it: {problem}. "
                    "spec.checkpoint.dir must be one volume mounted at the same path in every pod"
                )
        reported[CONTROLLER] = write_part(
            staging, CONTROLLER, lambda d: write_controller_state(d, step, trainer_state, controller_tensors)
        )
        final = publish(base, staging, step, reported)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    prune(base, keep)
    return final


def publish(base: Path, staging: Path, step: int, parts: Mapping[str, PartInfo]) -> Path:
    """Rename the staging directory to `step-NNNNNN`, then write `COMPLETE` into it."""
    final = base / step_name(step)
    if final.exists():  # the same step saved again (a run started over): the newer save wins
        remove(final)
    os.rename(staging, final)
    _fsync_dir(base)
    marker = {
        "format": FORMAT,
        "step": step,
        "parts": {name: info["files"] for name, info in parts.items()},
        "time": time.time(),
    }
    _write_json(final / COMPLETE, marker)
    return final


def prune(base: Path, keep: int) -> None:
    """Delete all but the newest `keep` complete checkpoints."""
    for _, old in checkpoint_dirs(base)[: -max(keep, 1)]:
        remove(old)


def remove_debris(base: Path) -> None:
    """Remove what interrupted saves left: staging directories and unpublished step directories.
    Only the controller writes checkpoints, so when it starts a save nothing else is in flight."""
    for child in base.iterdir():
        leftover = child.name.startswith((STAGING_PREFIX, PROBE_PREFIX, ".tmp-step-")) or (
            _STEP.match(child.name) is not None
            and complete_problem(child) is not None
            and not (child / STATE_FILE).is_file()  # the layout before parts: not ours to delete
        )
        if leftover and child.is_dir():
            shutil.rmtree(child, ignore_errors=True)


def remove(step_dir: Path) -> None:
    """Delete a checkpoint, its marker first: a half-deleted directory is never taken for one."""
    with contextlib.suppress(FileNotFoundError):
        (step_dir / COMPLETE).unlink()
    shutil.rmtree(step_dir, ignore_errors=True)


# --------------------------------------------------------------------------------------------
# Finding checkpoints
# --------------------------------------------------------------------------------------------


def complete_problem(step_dir: str | Path) -> str | None:
    """Why `step_dir` is not a complete checkpoint (None when it is)."""
    directory = Path(step_dir)
    marker = _read_json(directory / COMPLETE)
    if marker is None:
        return f"{directory} has no {COMPLETE} marker (a checkpoint whose save did not finish)"
    parts = marker.get("parts")
    if not isinstance(parts, dict) or CONTROLLER not in parts:
        return f"{directory / COMPLETE} lists no {CONTROLLER} part"
    for name, files in parts.items():
        problem = _size_problem(directory / name, files) if isinstance(files, dict) else "no file list"
        if problem:
            return f"part {name}: {problem}"
    return None


def checkpoint_dirs(root: str | Path) -> list[tuple[int, Path]]:
    """Complete checkpoints under `root`, oldest first."""
    base = Path(root)
    if not base.is_dir():
        return []
    found = []
    for child in base.iterdir():
        m = _STEP.match(child.name)
        if m and child.is_dir() and complete_problem(child) is None:
            found.append((int(m.group(1)), child))
    return sorted(found)


def latest(root: str | Path) -> Path | None:
    """The newest complete checkpoint under `root`; partial ones are ignored."""
    dirs = checkpoint_dirs(root)
    return dirs[-1][1] if dirs else None


def parts(step_dir: str | Path) -> list[str]:
    """The parts a complete checkpoint holds (`actor`, `controller`, ...)."""
    marker = _read_json(Path(step_dir) / COMPLETE) or {}
    return sorted(marker.get("parts", {}))


def resolve(path: str | Path) -> Path:
    """A complete checkpoint from what a user names: a `step-NNNNNN` directory, a checkpoint
    directory (its newest complete checkpoint) or a run directory (its `checkpoints/`, or the
    `checkpoint.dir` its `spec.json` names)."""
    p = Path(path).expanduser()
    expected = (
        f"expected a complete checkpoint: a {step_name(20)} directory holding {COMPLETE} (written last "
        "by `rlhf run`), a checkpoint directory holding such step directories, or a run directory "
        "holding checkpoints/"
    )
    if not p.exists():
        raise CheckpointError(f"{p} does not exist; {expected}")
    if not p.is_dir():
        raise CheckpointError(f"{p} is a file, not a directory; {expected}")
    if _STEP.match(p.name):
        problem = complete_problem(p)
        if problem:
            raise CheckpointError(f"{p} is not a complete checkpoint: {problem}; {expected}")
        return p
    candidates = [p, p / "checkpoints", *_spec_checkpoint_dir(p)]
    for candidate in candidates:
        found = latest(candidate)
        if found is not None:
            return found
    partial = sorted(
        c.name
        for d in candidates
        if d.is_dir()
        for c in d.iterdir()
        if _STEP.match(c.name) or c.name.startswith(STAGING_PREFIX)
    )
    seen = f" (only unfinished saves: {', '.join(partial)})" if partial else ""
    raise CheckpointError(f"{p} holds no complete checkpoint{seen}; {expected}")


def _spec_checkpoint_dir(run_dir: Path) -> list[Path]:
    """A run directory's `spec.checkpoint.dir` (from the `spec.json` the run wrote), if absolute."""
    spec = _read_json(run_dir / "spec.json")
    configured = ((spec or {}).get("checkpoint") or {}).get("dir") if isinstance(spec, dict) else None
    path = Path(configured).expanduser() if isinstance(configured, str) else None
    return [path] if path is not None and path.is_absolute() else []


# --------------------------------------------------------------------------------------------
# The controller's part
# --------------------------------------------------------------------------------------------


#: The controller's tensors besides its RNG state (`save(controller_tensors=...)`).
CONTROLLER_TENSORS = "controller_tensors.safetensors"


def write_controller_state(
    directory: Path,
    step: int,
    trainer_state: dict[str, Any],
    tensors: Mapping[str, torch.Tensor] | None = None,
) -> None:
    save_file({"torch_rng": torch.get_rng_state()}, directory / "rng.safetensors")
    if tensors:
        save_file(dict(tensors), directory / CONTROLLER_TENSORS)
    state = {
        **trainer_state,
        "step": step,
        "python_rng": _jsonable_random_state(random.getstate()),
        "numpy_rng": _numpy_state(),
    }
    (directory / STATE_FILE).write_text(json.dumps(state, indent=1, default=_default))


def load_state(path: str | Path) -> dict[str, Any]:
    """The controller's state of checkpoint `path`, restoring the controller's RNG states."""
    p = part_dir(path, CONTROLLER)
    state: dict[str, Any] = json.loads((p / STATE_FILE).read_text())
    torch.set_rng_state(load_file(p / "rng.safetensors")["torch_rng"])
    py = state.get("python_rng")
    if py:
        random.setstate((py[0], tuple(py[1]), py[2]))
    np_state = state.get("numpy_rng")
    if np_state:
        import numpy as np

        np.random.set_state((np_state[0], np.array(np_state[1], dtype=np.uint32), *np_state[2:]))
    return state


def load_controller_tensors(path: str | Path) -> dict[str, torch.Tensor]:
    """The tensors `save` kept with the controller's state of checkpoint `path` ({} when none)."""
    file = part_dir(path, CONTROLLER) / CONTROLLER_TENSORS
    return dict(load_file(file)) if file.is_file() else {}


# --------------------------------------------------------------------------------------------
# Is the checkpoint directory shared? (asked once at startup, not at the first save)
# --------------------------------------------------------------------------------------------


def check_shared(root: str | Path, roles: Mapping[str, Callable[[str], Any]]) -> None:
    """Fail fast when a role's pods do not see the controller's checkpoint directory.

    The controller writes a probe file; `roles[role](probe_dir)` makes every rank of the role
    call `answer_probe` (each rank checks the controller's file, rank 0 writes its own); then
    the controller checks that it sees each role's file. Removes the probe afterwards."""
    base = Path(root)
    base.mkdir(parents=True, exist_ok=True)
    probe = base / f"{PROBE_PREFIX}{secrets.token_hex(4)}"
    probe.mkdir()
    try:
        _write_json(probe / CONTROLLER, {"host": socket.gethostname()})
        for role, ask in roles.items():
            ask(str(probe))
            answer = _read_json(probe / role)
            if answer is None:
                raise CheckpointError(
                    f"spec.checkpoint.dir: {role} rank 0 wrote {probe / role}, but the controller on host "
                    f"{socket.gethostname()} does not see it: mount one volume at {base} in every pod"
                )
    finally:
        shutil.rmtree(probe, ignore_errors=True)


def answer_probe(probe_dir: str | Path, role: str, rank: int) -> None:
    """Worker side of `check_shared`."""
    probe = Path(probe_dir)
    controller = _read_json(probe / CONTROLLER)
    if controller is None:
        raise CheckpointError(
            f"spec.checkpoint.dir: {role} rank {rank} on host {socket.gethostname()} does not see "
            f"{probe / CONTROLLER}, written by the controller: mount one volume at {probe.parent} in the "
            f"controller pod and in every {role} pod"
        )
    if rank == 0:
        _write_json(probe / role, {"host": socket.gethostname()})


# --------------------------------------------------------------------------------------------
# Files
# --------------------------------------------------------------------------------------------


def _size_problem(directory: Path, files: dict[str, Any]) -> str | None:
    for name, size in files.items():
        path = directory / name
        try:
            actual = path.stat().st_size
        except OSError:
            return f"{path} is missing"
        if actual != size:
            return f"{path} has {actual} bytes, its marker says {size}"
    return None


def _write_json(path: Path, value: Any) -> None:
    """Write `path` whole or not at all (temp file, fsync, rename), then sync its directory."""
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}")
    with tmp.open("w") as f:
        json.dump(value, f, indent=1, default=_default)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):  # some file systems cannot sync a directory
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _jsonable_random_state(state: tuple[Any, ...]) -> list[Any]:
    return [state[0], list(state[1]), state[2]]


def _numpy_state() -> list[Any] | None:
    try:
        import numpy as np
    except ImportError:  # pragma: no cover
        return None
    name, keys, pos, has_gauss, gauss = np.random.get_state(legacy=True)  # type: ignore[misc]
    keys = np.asarray(keys)
    return [name, keys.tolist(), int(pos), int(has_gauss), float(gauss)]


def _default(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.item() if value.numel() == 1 else value.tolist()
    if isinstance(value, (set, tuple)):
        return list(value)
    if hasattr(value, "item"):
        return value.item()
    return str(value)
