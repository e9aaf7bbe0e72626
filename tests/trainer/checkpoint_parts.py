"""Checkpoints written without Ray, by the role workers themselves (plain objects in this process
or in a subprocess standing in for a pod): a tiny untrained model, a job spec around it, and a
worker whose weights differ from the model on disk (so a test can tell where weights came from).

Run as a script it is one role's pod: `python checkpoint_parts.py ROLE MODEL_DIR STAGING SEED`
builds that role's worker, nudges its weights with SEED, writes its part into STAGING (the
shared checkpoint volume) and prints the part marker and the weights' digest as one JSON line.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path
from typing import Any

import torch


def save_tiny_model(path: Path, *, tied: bool = True, hidden_size: int = 32) -> Path:
    """A randomly initialised 2-layer Llama and its char tokenizer, saved with save_pretrained."""
    from rlhf_trainer.tiny_model import build_char_tokenizer, build_tiny_model

    tok = build_char_tokenizer()
    model = build_tiny_model(tok, hidden_size=hidden_size, seed=0)
    if not tied:
        from transformers import LlamaForCausalLM

        config = model.config
        config.tie_word_embeddings = False
        torch.manual_seed(0)
        model = LlamaForCausalLM(config)
        model.generation_config.pad_token_id = tok.pad_token_id
        model.generation_config.eos_token_id = tok.eos_token_id
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def job_spec(model_dir: Path, **training: Any) -> Any:
    from rlhf_api.loader import parse_job

    doc = {
        "apiVersion": "rlhf.dev/v1alpha1",
        "kind": "RLTrainingJob",
        "metadata": {"name": "ckpt"},
        "spec": {
            "model": {"path": str(model_dir)},
            "data": {"path": str(model_dir / "prompts.jsonl")},
            "reward": {"functions": [{"path": "rlhf_trainer.rewards.builtin:arithmetic_exact"}]},
            "algorithm": {"name": "ppo"},
            "training": {"steps": 4, **training},
        },
    }
    return parse_job(doc).spec


def make_worker(role: str, model_dir: Path, seed: int = 1) -> Any:
    """A set-up worker of `role` (one rank) whose parameters are nudged away from `model_dir`'s."""
    from rlhf_trainer.workers import ActorWorker, CriticWorker

    cls = {"actor": ActorWorker, "critic": CriticWorker}[role]
    worker = cls(job_spec(model_dir))
    worker.setup()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in worker.model.parameters():  # a tied parameter is nudged once, under both names
            p.add_(torch.randn(p.shape, generator=g) * 0.01)
    return worker


def digest(worker: Any) -> str:
    """A hash of the worker's state dict (every name, tied ones included)."""
    h = hashlib.sha256()
    for name, value in sorted(worker.model.state_dict().items()):
        h.update(name.encode())
        h.update(value.detach().float().contiguous().numpy().tobytes())
    return h.hexdigest()


def main(role: str, model_dir: str, staging: str, seed: str) -> None:
    torch.set_num_threads(1)
    worker = make_worker(role, Path(model_dir), int(seed))
    info = worker.save(staging)
    print(json.dumps({"info": info, "digest": digest(worker), "cwd": str(Path.cwd())}))


if __name__ == "__main__":
    main(*sys.argv[1:])
