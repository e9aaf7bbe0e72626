"""Stage `grpo`: the quickstart's GRPO job on one GPU without Ray, bf16 compute over fp32 master
weights. The reward must rise (mean of the last 5 steps above the first 5 by 0.1 or more, as
tests/gpu/figures.py asks of the Ray run); then the actor is saved, a fresh actor loads the
checkpoint, and both train the same next batch: the weights after that step must agree.
"""

from __future__ import annotations

import os
import sys
import time

from common import Stage, main, require, synchronize

STEPS = int(os.environ.get("DEVICE_CHECK_GRPO_STEPS", 40))
RISE = 0.1


def body(stage: Stage) -> None:
    require("transformers", "the project's models are transformers models")
    # Deterministic kernels (cuBLAS workspace, no atomics-order noise in the embedding backward):
    # the restored actor's next step is compared with the live one's.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    import torch

    torch.use_deterministic_algorithms(True, warn_only=True)
    from loop import Loop, tiny_job

    from rlhf_trainer.workers import ActorWorker, modeling

    spec = tiny_job(stage.shared)
    loop = Loop(spec, stage.scratch / "run", stage.device)
    stage.check(
        "fp32 master weights",
        {p.dtype for p in loop.actor.model.parameters()} == {torch.float32},
        str(sorted({str(p.dtype) for p in loop.actor.model.parameters()})),
    )
    rewards = []
    t0 = time.perf_counter()
    for step in range(STEPS):
        m = loop.step(step)
        rewards.append(m["reward/mean"])
        if step % 10 == 0 or step == STEPS - 1:
            print(
                f"step {step}: reward {m['reward/mean']:.3f} loss {m.get('actor/loss', float('nan')):.4f}",
                flush=True,
            )
    synchronize(stage.device)
    seconds = time.perf_counter() - t0
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    stage.figure("grpo_steps", STEPS)
    stage.figure("grpo_step_seconds", seconds / STEPS, "s")
    stage.figure("grpo_reward_first5", first)
    stage.figure("grpo_reward_last5", last)
    stage.check(
        "reward rises", last >= first + RISE, f"first 5 steps {first:.3f}, last 5 {last:.3f}, need +{RISE}"
    )
    with loop.actor.compute():
        ids = torch.tensor([[5, 6, 7, 8]], device=loop.actor.device)
        logits_dtype = loop.actor.model(input_ids=ids).logits.dtype
    stage.figure("compute_dtype", str(logits_dtype))
    if stage.device.startswith("cuda"):
        stage.check("bf16 compute", logits_dtype == torch.bfloat16, str(logits_dtype))

    # save -> load -> the same next step
    step_dir = stage.scratch / "ckpt" / f"step-{STEPS}"
    step_dir.mkdir(parents=True)
    loop.actor.save(str(step_dir))
    restored = ActorWorker(spec, colocated=True, device=stage.device)
    restored.setup()
    restored.load(str(step_dir))
    same = modeling.full_state_dict(restored.model)
    live = {k: v.detach().clone() for k, v in modeling.full_state_dict(loop.actor.model).items()}
    stage.check("loaded weights equal the saved ones", all(torch.equal(same[k], live[k]) for k in live))
    batch = loop.rollout(STEPS)
    m_live = loop.update(loop.actor, batch, STEPS)
    m_restored = loop.update(restored, batch, STEPS)
    a, b = modeling.full_state_dict(loop.actor.model), modeling.full_state_dict(restored.model)
    diff = max(float((a[k].float() - b[k].float()).abs().max()) for k in a)
    moved = max(float((a[k].float() - live[k].float()).abs().max()) for k in a)
    stage.figure("resume_next_step_max_abs_diff", diff)
    stage.figure("resume_next_step_loss", [m_live["actor/loss"], m_restored["actor/loss"]])
    stage.check("the next step moved the weights", moved > 0, f"max |dw| {moved:.3g}")
    stage.check(
        "restored actor's next step equals the live one's",
        diff <= 1e-6,
        f"max |w_live - w_restored| {diff:.3g}",
    )


if __name__ == "__main__":
    sys.exit(main("grpo", body))
