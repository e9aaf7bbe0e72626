"""Small jobs for the trainer's end-to-end tests (runtime, elastic): the tiny bootstrap model, the
session's prompt file, a job builder and the run log reader."""

from __future__ import annotations

import copy
import os
import tempfile
from pathlib import Path
from typing import Any

MODEL = Path("~/.cache/rlhf-operator/models/tiny-arithmetic").expanduser()
#: The session's own prompt file (written by the `tiny_model` fixture; shared caches may be
#: cleaned by others while a session runs).
PROMPTS = Path(tempfile.gettempdir()) / f"rlhf-trainer-tests-{os.getpid()}" / "tiny-arithmetic.jsonl"
PROMPT_ROWS = 1024


def job_from(base: dict[str, Any], name: str, sections: dict[str, Any]) -> Any:
    """`base` named `name`, with each given spec section merged in (one level deep), parsed."""
    from rlhf_api.loader import parse_job

    doc = copy.deepcopy(base)
    doc["metadata"]["name"] = name
    for key, value in sections.items():
        if isinstance(value, dict) and isinstance(doc["spec"].get(key), dict):
            doc["spec"][key] = {**doc["spec"][key], **value}
        else:
            doc["spec"][key] = value
    return parse_job(doc)


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """The run's metrics.jsonl, one dict per step."""
    from rlhf_trainer.metrics import read_jsonl

    return read_jsonl(run_dir / "metrics.jsonl")
