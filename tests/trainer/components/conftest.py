"""Fixtures of the component tests: a tiny, untrained causal LM and its character tokenizer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch


@pytest.fixture(autouse=True, scope="session")
def _one_thread() -> None:
    # The models are tiny; on a shared 2-core machine more threads only spin against each other.
    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_lm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A randomly initialised 2-layer Llama and its char tokenizer saved with save_pretrained."""
    from rlhf_trainer.tiny_model import build_char_tokenizer, build_tiny_model

    path = tmp_path_factory.mktemp("tiny-lm")
    tok = build_char_tokenizer()
    model = build_tiny_model(tok, hidden_size=32, seed=0)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_lm(tiny_lm_dir: Path) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_lm_dir)
    model.eval()
    return model, AutoTokenizer.from_pretrained(tiny_lm_dir)
