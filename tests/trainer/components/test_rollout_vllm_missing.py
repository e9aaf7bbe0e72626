"""The `vllm` engine where vLLM is not installed (the project's venv): a clear error naming what
to install, never a silent fallback to another engine. The engine itself is tested for real in
tests/vllm_engine (the vLLM test env)."""

from __future__ import annotations

import importlib.util

import pytest

from rlhf_api.sections import RolloutSpec
from rlhf_trainer.rollout import build_engine


def test_vllm_engine_without_vllm_names_the_env_script(tmp_path) -> None:
    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vllm is installed in this environment")
    spec = RolloutSpec(engine="vllm", max_new_tokens=4)
    with pytest.raises(RuntimeError, match=r"needs the vllm package.*scripts/vllm_env\.sh"):
        build_engine(spec, str(tmp_path), dtype="float32", device="cpu")
