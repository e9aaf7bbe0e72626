"""Checks of the `vllm` rollout engine, run INSIDE the vLLM test env (scripts/vllm_env.sh) by
tests/vllm_engine/test_vllm_engine.py, which asserts on the JSON this prints on its last line.

    python vllm_checks.py greedy   MODEL_DIR SCRATCH tied|untied
    python vllm_checks.py logprobs MODEL_DIR SCRATCH TEMPERATURE

One engine per process (vLLM's in-process engine is started once per process).

`greedy`: the quickstart's tiny model (tied embeddings) or an untied copy of it: the
hf and vllm engines decode the same prompts greedily before and after a weight update (new
weights made on the spot), then after a second, partial update (the output layer only) and
after restoring the original weights. Reports every engine's tokens per phase.

`logprobs`: after a weight update, vLLM samples at TEMPERATURE; the trainer's
`modeling.token_log_probs` scores the same tokens with a transformers model holding the same
weights (fp32). Reports the largest difference over response tokens.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path
from typing import Any

import torch


def prompts(tokenizer: Any, n: int = 24, seed: int = 0) -> list[list[int]]:
    """Arithmetic prompts of the quickstart's kind and a few longer ones (uneven lengths)."""
    rng = random.Random(seed)
    texts = [f"{rng.randint(0, 9)}+{rng.randint(0, 9)}=" for _ in range(n)]
    texts += ["12+30=", "what is 7+8? 7+8=", "1+1=2, 2+2=4, 3+3="]
    return [tokenizer(t).input_ids for t in texts]


def perturbed(model: Any, scale: float, seed: int, only: str | None = None) -> dict[str, torch.Tensor]:
    """The model's full state dict (tied names included) after adding noise of `scale` x each
    parameter's std (to the parameters whose name contains `only`, if given) to the model."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if only is None or only in name:
                p.add_(torch.randn(p.shape, generator=g) * scale * (p.std() + 1e-3))
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def untied_copy(src: Path, dst: Path) -> Path:
    """`src` with its output layer untied from the embeddings (a copy of them)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    model.config.tie_word_embeddings = False
    untied = type(model)(model.config)
    state = model.state_dict()
    state["lm_head.weight"] = state["model.embed_tokens.weight"].clone()
    untied.load_state_dict(state)
    untied.generation_config = model.generation_config
    untied.save_pretrained(dst)
    AutoTokenizer.from_pretrained(src).save_pretrained(dst)
    return dst


def greedy(model_dir: Path, scratch: Path, label: str) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    from rlhf_trainer.rollout.hf import HFRolloutEngine
    from rlhf_trainer.rollout.vllm import VLLMRolloutEngine

    path = model_dir if label == "tied" else untied_copy(model_dir, scratch / "untied")
    kw = {"max_new_tokens": 8, "temperature": 1.0, "seed": 0}
    hf = HFRolloutEngine.from_pretrained(str(path), **kw)
    vl = VLLMRolloutEngine.from_pretrained(str(path), max_model_len=64, **kw)
    ps = prompts(hf.tokenizer)
    original = {k: v.clone() for k, v in hf.state_dict().items()}
    trainer_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    phases: dict[str, dict[str, list[list[int]]]] = {}

    def decode(phase: str, hf: Any = hf, vl: Any = vl, ps: Any = ps, phases: Any = phases) -> None:
        phases[phase] = {
            name: [
                row[: int(m.sum())] for row, m in zip(b.response_ids.tolist(), b.response_mask, strict=True)
            ]
            for name, b in (("hf", hf.generate(ps, greedy=True)), ("vllm", vl.generate(ps, greedy=True)))
        }

    decode("before")
    new = perturbed(trainer_model, 0.5, seed=1)
    assert hf.load_weights(new.items()) == vl.load_weights(new.items()) == len(new)
    decode("updated")
    head = "lm_head" if label == "untied" else "embed_tokens"
    part = perturbed(trainer_model, 0.5, seed=2, only=head)
    partial = [(k, v) for k, v in part.items() if head in k]
    hf.load_weights(partial)
    vl.load_weights(partial)
    decode("partial")
    hf.load_weights(original.items())
    vl.load_weights(original.items())
    decode("restored")
    return {"phases": phases, "partial_names": [k for k, _ in partial]}


def logprobs(model_dir: Path, scratch: Path, temperature_arg: str) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    from rlhf_trainer.rollout.vllm import VLLMRolloutEngine
    from rlhf_trainer.workers.modeling import token_log_probs

    trainer_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    new = perturbed(trainer_model, 0.3, seed=3)
    trainer_model.eval()
    temperature = float(temperature_arg)
    vl = VLLMRolloutEngine.from_pretrained(
        str(model_dir), max_new_tokens=8, temperature=temperature, seed=0, max_model_len=64
    )
    vl.load_weights(new.items())
    batch = vl.generate(prompts(vl.tokenizer), n=4)
    with torch.no_grad():
        ref, _ = token_log_probs(trainer_model, batch.to_dict(), temperature=temperature)
    mask = batch.response_mask > 0
    diff = (ref - batch.log_probs).abs()[mask]
    return {
        "tokens": int(mask.sum()),
        "max_abs_diff": float(diff.max()),
        "mean_log_prob": float(batch.log_probs[mask].mean()),
        "distinct_responses": len({tuple(r) for r in batch.response_ids.tolist()}),
    }


def main() -> int:
    what, model_dir, scratch, arg = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]), sys.argv[4]
    result = {"greedy": greedy, "logprobs": logprobs}[what](model_dir, scratch, arg)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
