"""Stage `layouts`: what must not change a result on a GPU.

* packed vs padded: `modeling.token_log_probs` over rows of different lengths with
  `layout="packed"` (the rows' real tokens as one sequence, when the model's attention masks
  packed sequences by their position ids: `modeling.forward_layout` probes it) against
  `layout="padded"`, at every valid response position, in fp32 and under bf16 autocast;
* activation checkpointing on vs off: the same loss and gradients (fp32), and the peak memory of
  each (a figure).
"""

from __future__ import annotations

import copy
import sys
from typing import Any

from common import Stage, main, require

FP32_TOL, BF16_TOL = 1e-4, 5e-2


def ragged_batch(vocab: int, rows: int = 24, p: int = 12, t: int = 16, seed: int = 0) -> dict[str, Any]:
    """Left-padded prompts and right-padded responses of varied lengths."""
    import torch

    g = torch.Generator().manual_seed(seed)
    p_len = torch.randint(2, p + 1, (rows,), generator=g)
    t_len = torch.randint(1, t + 1, (rows,), generator=g)
    prompt_mask = (torch.arange(p)[None] >= (p - p_len)[:, None]).long()  # (B, P) left padding
    response_mask = (torch.arange(t)[None] < t_len[:, None]).float()  # (B, T) right padding
    return {
        "prompt_ids": torch.randint(3, vocab, (rows, p), generator=g) * prompt_mask,
        "prompt_mask": prompt_mask,
        "response_ids": torch.randint(3, vocab, (rows, t), generator=g) * response_mask.long(),
        "response_mask": response_mask,
    }


def packed_vs_padded(stage: Stage, model: Any, batch: dict[str, Any]) -> None:
    import torch

    from rlhf_trainer.workers import modeling

    device = torch.device(stage.device)
    layout = modeling.forward_layout(model, device)
    stage.figure("forward_layout", layout)
    valid = batch["response_mask"] > 0
    for dtype, tol in (("float32", FP32_TOL), ("bfloat16", BF16_TOL)):
        with torch.no_grad(), modeling.mixed_precision(model, dtype, device):
            padded, _ = modeling.token_log_probs(model, batch, layout="padded")
            other, _ = modeling.token_log_probs(model, batch, layout=layout)
        diff = float((padded - other).abs()[valid].max())
        stage.figure(f"{layout}_vs_padded_max_abs_diff_{dtype}", diff)
        stage.check(
            f"{layout} vs padded log-probs ({dtype})", diff <= tol, f"max |diff| {diff:.3g}, tolerance {tol}"
        )


def checkpointing_on_off(stage: Stage, model: Any, batch: dict[str, Any]) -> None:
    import torch

    from rlhf_trainer.workers import modeling

    cuda = stage.device.startswith("cuda")
    results = {}
    for on in (False, True):
        m = copy.deepcopy(model)
        if on:
            modeling.enable_activation_checkpointing(m)
        m.train()
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        logp, _ = modeling.token_log_probs(m, batch)
        loss = -(logp * batch["response_mask"]).sum() / batch["response_mask"].sum()
        loss.backward()
        grads = {n: p.grad.detach().clone() for n, p in m.named_parameters() if p.grad is not None}
        peak = torch.cuda.max_memory_allocated() / 2**20 if cuda else float("nan")
        results[on] = (float(loss.detach()), grads, peak)
        stage.figure(f"peak_mib_checkpointing_{'on' if on else 'off'}", peak, "MiB")
    (l_off, g_off, _), (l_on, g_on, _) = results[False], results[True]
    gdiff = max(float((g_off[n] - g_on[n]).abs().max()) for n in g_off)
    stage.figure("checkpointing_grad_max_abs_diff", gdiff)
    stage.check("checkpointing on vs off: same loss", abs(l_on - l_off) <= 1e-5, f"{l_off:.6f} vs {l_on:.6f}")
    stage.check("checkpointing on vs off: same gradients", gdiff <= 1e-5, f"max |diff| {gdiff:.3g}")
    stage.check("same parameters get gradients", set(g_off) == set(g_on))


def body(stage: Stage) -> None:
    require("transformers", "the project's models are transformers models")
    from loop import tiny_job

    from rlhf_trainer.workers import modeling

    spec = tiny_job(stage.shared)
    model = modeling.load_policy(spec.model.path, "float32").to(stage.device)
    batch = {k: v.to(stage.device) for k, v in ragged_batch(model.config.vocab_size).items()}
    packed_vs_padded(stage, model, batch)
    checkpointing_on_off(stage, model, batch)


if __name__ == "__main__":
    sys.exit(main("layouts", body))
