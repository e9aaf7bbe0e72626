"""`modeling.build_optimizer`: torch's fused AdamW where it takes every parameter, the same update
as torch's loop and foreach implementations to float rounding, and a logged fallback elsewhere."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from torch import nn

from rlhf_trainer.workers import modeling

STEPS = 5


def _model(device: str = "cpu") -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(50, 16), nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 50)).to(device)


def _train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int, seed: int = 1) -> None:
    """`steps` updates on fixed data, with the project's warm-up schedule moving the lr."""
    scheduler = modeling.build_scheduler(optimizer, "cosine", warmup_steps=2, total_steps=8)
    device = next(model.parameters()).device
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randint(0, 50, (8, 6), generator=gen).to(device)
        loss = nn.functional.cross_entropy(model(x).flatten(0, 1), x.roll(1, 1).flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        scheduler.step()


def _adamw(model: nn.Module, **impl: bool) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, **impl)


def _assert_same_weights(a: nn.Module, b: nn.Module, what: str) -> None:
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.allclose(pa, pb, rtol=1e-5, atol=1e-6), (
            f"{what}: {name} differs by {float((pa - pb).abs().max()):.3g}"
        )


def _fused_equals_the_loop_and_foreach(device: str) -> None:
    fused = _model(device)
    opt = modeling.build_optimizer(fused, 1e-2, 0.1)
    assert opt.defaults["fused"] is True, modeling.why_not_fused_adamw(list(fused.parameters()))
    _train(fused, opt, STEPS)
    start = _model(device)
    moved = max(float((p - q).detach().abs().max()) for p, q in zip(fused.parameters(), start.parameters()))
    assert moved > 1e-3, "the updates moved nothing: the comparison would show nothing"
    for impl in ({"foreach": False}, {"foreach": True}):
        other = _model(device)
        _train(other, _adamw(other, **impl), STEPS)
        _assert_same_weights(fused, other, f"fused vs {impl}")


def test_the_fused_adamw_gives_the_loop_and_foreach_updates_on_cpu():
    _fused_equals_the_loop_and_foreach("cpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (CUDA) for the fused CUDA kernel")
def test_the_fused_adamw_gives_the_loop_and_foreach_updates_on_cuda():
    _fused_equals_the_loop_and_foreach("cuda")


def test_a_fused_optimizer_resumes_from_the_loops_state_and_stays_fused():
    """A checkpoint written before the optimizer was fused (the loop's state, through the
    project's save/load functions) resumes into the fused optimizer, which stays fused (loading
    alone would put back the loop) and continues as the loop would."""
    loop, fused = _model(), _model()
    loop_opt = _adamw(loop, foreach=False)
    _train(loop, loop_opt, 2)
    saved = copy.deepcopy(modeling.full_optimizer_state(loop, loop_opt))
    fused.load_state_dict(loop.state_dict())
    fused_opt = modeling.build_optimizer(fused, 1e-2, 0.1)
    modeling.build_scheduler(fused_opt, "cosine", 2, 8)  # as the worker does, before it loads
    modeling.load_full_optimizer_state(fused, fused_opt, saved)
    assert [g["fused"] for g in fused_opt.param_groups] == [True]
    _train(loop, loop_opt, 3, seed=2)
    _train(fused, fused_opt, 3, seed=2)
    _assert_same_weights(fused, loop, "resumed fused vs loop")


def test_parameters_the_fused_kernel_does_not_take_fall_back_with_a_reason(caplog: pytest.LogCaptureFixture):
    on_meta = nn.Linear(3, 3, device="meta")
    why = modeling.why_not_fused_adamw(list(on_meta.parameters()))
    assert why is not None and "meta" in why
    assert "complex64" in str(modeling.why_not_fused_adamw([torch.zeros(2, dtype=torch.complex64)]))
    with caplog.at_level(logging.INFO, logger=modeling.__name__):
        opt = modeling.build_optimizer(on_meta, 1e-3, 0.0)
    assert opt.defaults["fused"] is None
    assert "not the fused one" in caplog.text and "meta" in caplog.text
    assert modeling.why_not_fused_adamw(list(_model().parameters())) is None
