"""The 2-GPU tests put each spawned rank on its own GPU (issue 19, item 4). A rank process imports
the test module before it runs; if that import asked CUDA anything (`torch.cuda.is_available()` in
a `skipif`), CUDA was initialised before the rank set CUDA_VISIBLE_DEVICES, every rank saw GPU 0
and NCCL refused the duplicate GPUs. Now the module asks CUDA nothing at import, and every rank
picks its GPU by index (`torch.cuda.set_device(rank)`), which works after CUDA's initialisation.
Checked on CPU: CUDA queries during the import are counted, and the rank entry points are read."""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path
from typing import Any

import pytest
import torch

GPU = Path(__file__).resolve().parents[1] / "gpu"


def _spy(calls: list[str], name: str) -> Any:
    def record(*args: Any, **kwargs: Any) -> Any:
        calls.append(name)
        return 0 if name == "device_count" else False

    return record


def _import(path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Any, list[str]]:
    calls: list[str] = []
    for name in ("is_available", "device_count", "init", "current_device", "set_device"):
        monkeypatch.setattr(torch.cuda, name, _spy(calls, name))
    spec = importlib.util.spec_from_file_location(f"_probe_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module, calls


@pytest.mark.parametrize("name", ["test_gpu_paths.py", "figures.py"])
def test_importing_a_gpu_module_asks_cuda_nothing(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    _, calls = _import(GPU / name, monkeypatch)
    assert calls == [], f"{name} queries CUDA at import: {calls}"


def test_a_rank_sets_its_device_by_index(monkeypatch: pytest.MonkeyPatch) -> None:
    module, calls = _import(GPU / "test_gpu_paths.py", monkeypatch)
    chosen: list[int] = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda i: chosen.append(i))
    assert module._rank_device(1) == "cuda:1" and chosen == [1]


def _functions(path: Path) -> dict[str, ast.FunctionDef]:
    tree = ast.parse(path.read_text())
    return {n.name: n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}


@pytest.mark.parametrize(
    ("path", "rank_fns"),
    [("test_gpu_paths.py", ["_fsdp_rank", "_sync_member"]), ("figures.py", ["_sync_rank"])],
)
def test_spawned_ranks_choose_their_gpu_by_index_not_by_environment(path: str, rank_fns: list[str]) -> None:
    fns = _functions(GPU / path)
    for name in rank_fns:
        src = ast.unparse(fns[name])
        assert "CUDA_VISIBLE_DEVICES" not in src, (
            f"{name} sets CUDA_VISIBLE_DEVICES after CUDA may be initialised"
        )
        assert "_rank_device(rank)" in src or "torch.cuda.set_device(rank)" in src, (
            f"{name} picks no GPU by index"
        )
