"""Measures what the planner estimates, in a process of its own (tests/unit/test_planner.py):
a random Llama of the given shape (`rlhf_trainer.tiny_model.build_tiny_model`) is built, one micro-batch
goes forward and backward in fp32 and AdamW steps, twice. Printed as JSON: the bytes of the
parameters, gradients and optimizer state (tracked tensor by tensor), the resident set's growth
after the step (VmRSS) and its peak growth (VmHWM), each from a baseline taken after a warm-up
step on a 2-layer model, so that the libraries' own memory is not counted.

    python tests/unit/planner_probe.py HIDDEN LAYERS HEADS BATCH SEQ OUT_DIR
"""

from __future__ import annotations

import gc
import json
import sys


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def _steps(model, vocab: int, batch: int, seq: int, steps: int = 2):
    """`steps` optimizer steps: from the second on, the moments exist during forward and backward
    (the steady state the planner estimates)."""
    import torch

    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        ids = torch.randint(0, vocab, (batch, seq))
        logits = model(input_ids=ids, use_cache=False).logits  # (B, T, V)
        torch.log_softmax(logits.float(), -1).mean().backward()
        del logits
        opt.step()
    return opt


def main() -> None:
    import torch

    from rlhf_trainer.tiny_model import build_char_tokenizer, build_tiny_model

    hidden, layers, heads, batch, seq = (int(a) for a in sys.argv[1:6])
    torch.set_num_threads(1)
    torch.manual_seed(0)
    tok = build_char_tokenizer()
    warm = build_tiny_model(tok, hidden_size=16, num_layers=2, num_heads=2)
    _steps(warm, len(tok), 2, 8)
    del warm
    gc.collect()
    base = _status("VmRSS")
    model = build_tiny_model(tok, hidden_size=hidden, num_layers=layers, num_heads=heads, max_positions=seq)
    opt = _steps(model, len(tok), batch, seq)
    gc.collect()
    resident = _status("VmRSS") - base
    peak = _status("VmHWM") - base
    state = sum(p.numel() * p.element_size() for p in model.parameters())
    state += sum(p.grad.numel() * p.grad.element_size() for p in model.parameters())
    state += sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values() if t.dim() > 0)
    model.config.save_pretrained(sys.argv[6])
    print(
        json.dumps(
            {
                "state": state,
                "resident": resident,
                "peak": peak,
                "params": sum(p.numel() for p in model.parameters()),
            }
        )
    )


if __name__ == "__main__":
    main()
