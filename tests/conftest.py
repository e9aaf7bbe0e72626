"""Suite-wide pytest setup: GPU tests are skipped, with the reason, where no GPU is present."""

from __future__ import annotations

import pytest


def _has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if any("gpu" in item.keywords for item in items) and not _has_cuda():
        skip = pytest.mark.skip(reason="needs a GPU (no CUDA device on this machine)")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)
