"""Checkpoints of a run: written atomically, found again on restart.

Layout of `<checkpoint dir>/step-000010/`::

    actor.safetensors  actor_optim.safetensors  actor_state.json     policy, AdamW state, LR schedule
    critic.*                                                          the same for the critic (PPO)
    rng.safetensors                                                   the controller's torch RNG state
    trainer_state.json                                                step, policy version, data position,
                                                                      algorithm state (KL coefficient),
                                                                      Python/NumPy RNG states; written last

A checkpoint is built in `.tmp-step-000010-<random>/` and renamed into place, so a directory
named `step-*` is always complete; a run killed mid-write leaves only a temp directory, which
the next save removes. Workers draw their random numbers from seeds derived from (seed, step,
rank), so restoring the step restores their streams too.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

STATE_FILE = "trainer_state.json"
_NAME = re.compile(r"^step-(\d+)$")


def checkpoint_dirs(root: str | Path) -> list[tuple[int, Path]]:
    """Complete checkpoints under `root`, oldest first."""
    base = Path(root)
    if not base.is_dir():
        return []
    found = []
    for child in base.iterdir():
        m = _NAME.match(child.name)
        if m and (child / STATE_FILE).is_file():
            found.append((int(m.group(1)), child))
    return sorted(found)


def latest(root: str | Path) -> Path | None:
    dirs = checkpoint_dirs(root)
    return dirs[-1][1] if dirs else None


def save(
    root: str | Path,
    step: int,
    trainer_state: dict[str, Any],
    write_workers: Callable[[Path], None],
    keep: int,
) -> Path:
    """Write checkpoint `step` (the number of completed steps) atomically; keep the newest `keep`.

    `write_workers(tmp_dir)` makes the role workers write their files into the temp directory
    (a shared volume on a cluster); this function adds the controller's state and renames.
    """
    base = Path(root)
    base.mkdir(parents=True, exist_ok=True)
    for stale in base.glob(".tmp-step-*"):
        shutil.rmtree(stale, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-step-{step:06d}-", dir=base))
    try:
        write_workers(tmp)
        save_file({"torch_rng": torch.get_rng_state()}, tmp / "rng.safetensors")
        state = {
            **trainer_state,
            "step": step,
            "python_rng": _jsonable_random_state(random.getstate()),
            "numpy_rng": _numpy_state(),
        }
        (tmp / STATE_FILE).write_text(json.dumps(state, indent=1, default=_default))
        final = base / f"step-{step:06d}"
        if final.exists():
            shutil.rmtree(final)
        os.rename(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    for _, old in checkpoint_dirs(base)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def load_state(path: str | Path) -> dict[str, Any]:
    """The controller's state of checkpoint `path`, restoring the controller's RNG states."""
    p = Path(path)
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
