"""The single controller of a training job: `rlhf run` locally, the controller pod on a cluster.

    run = setup(job_name, spec, ...)              # `startup`: models, data, Ray, the stream (the
                                                  #   manifest's algorithm or spec.pipeline), role
                                                  #   workers, fleet, resume, logs
    evaluate_before_training(run)                 # eval.beforeTraining: the initial policy, once
    for step in range(run.start_step, steps):
        metrics = run.stream.step()               # rollout -> reward -> filter -> reference/critic
                                                  #   -> advantage -> update   (dataflow.phases)
        settle_rollout(run.ctx, metrics)          # async rollouts: the next step's, generated meanwhile
        elastic_rollout(run.ctx, metrics)         # step boundary: follow the fleet's owner, add/drain
        sync_weights(run.ctx)                     # weight sync
        evaluate_if_due(run, step + 1, metrics)   # evaluation (every eval.every steps, and the last)
        log_step(run, step, metrics)              # log: JSONL, samples, /metrics, trackers, bar
        save_checkpoint_if_due(run, step + 1)     # checkpoint (every N steps and at the end)
        report_progress(run, step + 1, metrics)   # status: the job's status.progress (on a cluster)
    export_final(run)                             # the policy as a Hugging Face model directory
    finish(run)                                   # summary, report
    teardown(run)                                 # `startup`: what setup started

Everything a phase does lives in `dataflow.phases`; the role workers in `workers`; everything
before the first step in `startup`.
"""

from __future__ import annotations

import logging
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlhf_api.job import RLTrainingJob
from rlhf_trainer import checkpoint
from rlhf_trainer.dataflow.batch import StepBatch
from rlhf_trainer.dataflow.context import TrainerContext, timed
from rlhf_trainer.dataflow.phases import evaluate, reshard_if_needed, sample_rows, sync_weights
from rlhf_trainer.fleet.elastic import ElasticOptions
from rlhf_trainer.preemption import Preempted, Preemption
from rlhf_trainer.startup import Run, RunError, StatusCallback, resolve_spec, setup, teardown, trained_roles

log = logging.getLogger(__name__)


@dataclass
class Summary:
    steps: int
    first_reward: float
    last_reward: float
    wall_seconds: float
    run_dir: Path
    report: Path | None = None
    first_window: float = float("nan")
    """Mean reward over the first `WINDOW` steps run (single steps are noisy)."""
    last_window: float = float("nan")
    model: Path | None = None
    """The exported policy (a Hugging Face model directory), when there is one."""

    WINDOW = 10

    def lines(self) -> list[str]:
        w = min(self.WINDOW, self.steps)
        out = [
            f"steps              {self.steps}",
            f"first mean reward  {self.first_reward:.3f}   (first {w} steps: {self.first_window:.3f})",
            f"last mean reward   {self.last_reward:.3f}   (last {w} steps: {self.last_window:.3f})",
            f"wall time          {self.wall_seconds:.1f}s",
            f"run directory      {self.run_dir}",
        ]
        if self.report:
            out.append(f"report             {self.report}")
        if self.model:
            out.append(f"model              {self.model}")
        return out


# --------------------------------------------------------------------------------------------
# The loop
# --------------------------------------------------------------------------------------------


def run(
    job: RLTrainingJob,
    *,
    manifest_dir: str | Path = ".",
    steps: int | None = None,
    run_dir: str | Path | None = None,
    resume: bool | None = None,
    ray_address: str | None = None,
    on_status: StatusCallback | None = None,
    elastic: ElasticOptions | None = None,
    preemption: Preemption | None = None,
) -> Summary:
    """Run `job` to its last step (resuming from the latest checkpoint) and return the summary.
    `elastic`: the disaggregated rollout fleet's membership source and hooks (clock, signal, sync
    checks; see `fleet.elastic.ElasticOptions`). `preemption`: installed once Ray is up; on SIGTERM
    the step in progress is checkpointed and `Preempted` raised (`preemption`)."""
    started = time.perf_counter()
    spec = resolve_spec(job.spec, Path(manifest_dir), steps)
    r = setup(job.metadata_name, spec, run_dir, resume, ray_address, on_status, elastic)
    if preemption is not None:
        preemption.install()  # after ray.init, whose driver sets its own SIGTERM handler
    if r.start_step >= spec.training.steps:
        print(f"all {spec.training.steps} steps are done already (--no-resume starts over)", file=sys.stderr)
    try:
        evaluate_before_training(r)
        for step in range(r.start_step, spec.training.steps):
            r.ctx.step = step
            # rollout -> reward -> filter -> reference/critic -> advantage -> update
            metrics = r.stream.step()
            # asynchronous rollouts: wait for the next step's rollout (the fleet is needed below)
            settle_rollout(r.ctx, metrics)
            # elastic rollout (step boundary): the fleet's target (local policy or operator), add/drain, rebuild
            elastic_rollout(r.ctx, metrics)
            # weight sync
            with timed(metrics, "weight_sync"):
                metrics.update(sync_weights(r.ctx))
            # evaluation (every eval.every steps and after the last), of the synced policy
            evaluated = evaluate_if_due(r, step + 1, metrics)
            # log
            log_step(r, step, metrics, evaluated)
            # checkpoint (also the step in progress when SIGTERM arrived during it)
            save_checkpoint_if_due(r, step + 1)
            stopping = preemption is not None and preemption.requested and step + 1 < spec.training.steps
            saved = checkpoint_on_preemption(r, step + 1) if stopping else None
            # status (after the checkpoint, so that the write names it)
            report_progress(r, step + 1, metrics)
            if saved is not None and preemption is not None:
                raise Preempted(step + 1, saved, preemption.elapsed())
        model = export_final(r)
        summary = finish(r, time.perf_counter() - started)
        summary.model = model
        return summary
    finally:
        teardown(r)


def settle_rollout(ctx: TrainerContext, metrics: dict[str, Any]) -> None:
    """Asynchronous rollouts: wait for the rollout generated during the step (the boundary and
    the weight sync need the replicas idle); the wait counts as the step's rollout time."""
    if ctx.ahead is not None:
        metrics["timing/rollout"] = metrics.get("timing/rollout", 0.0) + ctx.ahead.settle()


def elastic_rollout(ctx: TrainerContext, metrics: dict[str, Any]) -> None:
    """Disaggregated placement: the resharding protocol at the step boundary (`fleet.elastic`)."""
    if ctx.fleet is None:
        return
    with timed(metrics, "reshard"):
        reshard_if_needed(ctx, metrics)


def due(done: int, every: int, total: int) -> bool:
    """Whether something done every `every` steps (0: only at the end) is due after `done` of `total`."""
    return done == total or (every > 0 and done % every == 0)


def evaluate_if_due(r: Run, done: int, metrics: dict[str, Any]) -> dict[str, StepBatch]:
    """Evaluation (`spec.eval`) after `done` steps when due: its metrics join the step's
    (`eval/*`, `timing/eval`); returns each mode's scored samples for the sample log."""
    spec = r.ctx.spec.eval
    if spec is None or not due(done, spec.every, r.ctx.spec.training.steps):
        return {}
    with timed(metrics, "eval"):
        values, batches = evaluate(r.ctx, r.ctx.eval_prompts)
    metrics.update(values)
    metrics["eval/step"] = float(done)
    return batches


def evaluate_before_training(r: Run) -> None:
    """`eval.beforeTraining`: the initial policy's evaluation, a record of its own in the metrics
    log at step 0 (`eval/step` 0, marked `metrics.BEFORE_TRAINING`), its samples in the sample log
    at step 0. Only a run that starts at step 0 evaluates: one resumed past it keeps the record
    its first session wrote (resume cuts the logs back to the checkpoint's step, never below 1)."""
    from rlhf_trainer.metrics import BEFORE_TRAINING

    spec = r.ctx.spec.eval
    if spec is None or not spec.before_training or r.start_step > 0:
        return
    r.ctx.step = 0
    metrics: dict[str, Any] = {}
    with timed(metrics, "eval"):
        values, batches = evaluate(r.ctx, r.ctx.eval_prompts)
    metrics.update(values)
    metrics["eval/step"] = 0.0
    logs = r.opened()
    logs.steps.log({**metrics, BEFORE_TRAINING: True}, step=0)
    k = r.ctx.spec.output.samples_per_step
    for mode, batch in batches.items():
        for row in sample_rows(batch, k, 0, f"eval/{mode}"):
            logs.samples.log(row)
    logs.metrics.record(0, metrics)
    logs.trackers.log(0, metrics)


def log_step(
    r: Run, step: int, metrics: dict[str, Any], evaluated: dict[str, StepBatch] | None = None
) -> None:
    """Write the step's metrics to the JSONL log, the /metrics endpoint, the trackers and the bar;
    a few of its samples (and of the evaluation's) to the sample log."""
    ctx = r.ctx
    from rlhf_trainer.metrics import step_rates

    metrics.update(step_rates(metrics))
    metrics["timing/step"] = sum(
        v for k, v in metrics.items() if k.startswith("timing/") and k != "timing/step"
    )
    metrics["rollout/wait_seconds"] = metrics.get("timing/rollout", 0.0)
    metrics["data/prompts_consumed"] = float(ctx.dataset.consumed)
    metrics["total_steps"] = float(ctx.spec.training.steps)
    if ctx.fleet is not None:
        metrics.update(ctx.fleet.step_metrics())
    last = r.stream.last_batch
    scores = last.tensors["scores"].tolist() if last is not None and "scores" in last else []
    r.history.append({"step": step, **metrics})
    logs = r.opened()
    logs.steps.log({**metrics, "reward/scores": scores}, step=step)
    k = ctx.spec.output.samples_per_step
    rows = sample_rows(last, k, step, "train")
    rows += [
        row
        for mode, batch in (evaluated or {}).items()
        for row in sample_rows(batch, k, step, f"eval/{mode}")
    ]
    for row in rows:
        logs.samples.log(row)
    logs.metrics.record(step, metrics)
    logs.trackers.log(step, metrics)
    if logs.progress is not None:
        logs.progress.set_postfix(reward=f"{metrics.get('reward/mean', float('nan')):.3f}", refresh=False)
        logs.progress.update(1)


def report_progress(r: Run, done: int, metrics: dict[str, Any]) -> None:
    """Hand the step to the status callback (the controller pod's `status.progress`), with the
    step of the last checkpoint (`Run.checkpoint_step`)."""
    if r.on_status is not None:
        r.on_status(done, r.ctx.spec.training.steps, metrics, r.checkpoint_step)


def save_checkpoint_if_due(r: Run, done: int) -> None:
    if due(done, r.ctx.spec.checkpoint.every, r.ctx.spec.training.steps):
        save_checkpoint(r, done)


def checkpoint_on_preemption(r: Run, done: int) -> Path:
    """SIGTERM arrived during the step just done: its checkpoint (unless the periodic one was
    just written); the loop then reports it and raises `Preempted`."""
    spec = r.ctx.spec
    if due(done, spec.checkpoint.every, spec.training.steps):
        return r.checkpoint_dir / checkpoint.step_name(done)
    return save_checkpoint(r, done)


def save_checkpoint(r: Run, done: int) -> Path:
    """Each trained role's rank 0 writes its part into a staging directory on the shared
    checkpoint volume; `checkpoint.save` adds the controller's part and publishes the step."""
    ctx = r.ctx

    def write_workers(staging: Path) -> dict[str, checkpoint.PartInfo]:
        return {role: g.call("save", str(staging))[0] for role, g in trained_roles(ctx).items()}

    state = {
        "job": ctx.job_name,
        "policy_version": ctx.policy_version,
        "data": ctx.dataset.state_dict(),
        "algorithm": ctx.algorithm.state_dict(),
    }
    tensors: dict[str, Any] = {}
    if ctx.ahead is not None:  # the next step's batch, generated ahead: part of an exact resume
        state["rollout_ahead"], tensors = ctx.ahead.state()
    path = checkpoint.save(
        r.checkpoint_dir, done, state, write_workers, ctx.spec.checkpoint.keep, controller_tensors=tensors
    )
    r.checkpoint_step = done
    return path


def export_final(r: Run) -> Path | None:
    """Export the final checkpoint's policy to `<run dir>/final` (`export.FINAL_DIR`). The
    controller reads only the shared checkpoint volume, tensor by tensor; nothing the workers
    hold in memory or on their own pods."""
    from rlhf_trainer.export import FINAL_DIR, export_policy

    out = r.ctx.run_dir / FINAL_DIR
    if r.start_step >= r.ctx.spec.training.steps and out.is_dir():
        return out  # nothing trained in this session, and the export of the last one is there
    found = checkpoint.latest(r.checkpoint_dir)
    if found is None:
        return None
    logs = r.opened()
    if logs.progress is not None:
        logs.progress.close()  # the export's progress lines go below the finished bar
        logs.progress = None
    try:
        lora = r.ctx.spec.model.lora
        export_policy(found, out, replace=True, adapter=lora is not None and lora.export_adapter)
    except Exception as err:
        raise RunError(
            f"training finished, but exporting the policy of {found} to {out} failed: {err} "
            f"(the checkpoint is complete: `rlhf export {found} OUT` retries)"
        ) from err
    return out


def finish(r: Run, wall: float) -> Summary:
    """Close the bar, write the report, and summarise the whole run (earlier sessions included)."""
    from rlhf_trainer.metrics import read_jsonl, step_records

    logs = r.opened()
    logs.steps.close()
    logs.samples.close()
    logs.trackers.close()
    records = step_records(read_jsonl(r.ctx.run_dir / "metrics.jsonl"))
    rewards = [float(x["reward/mean"]) for x in records if isinstance(x.get("reward/mean"), (int, float))]
    rewards = [x for x in rewards if not math.isnan(x)]
    if logs.progress is not None:
        logs.progress.close()
        logs.progress = None
    report_path = None
    if r.ctx.spec.output.report:
        report_path = write_report(r.ctx.run_dir)
    w = Summary.WINDOW
    return Summary(
        steps=len(records),
        first_reward=rewards[0] if rewards else float("nan"),
        last_reward=rewards[-1] if rewards else float("nan"),
        first_window=sum(rewards[:w]) / len(rewards[:w]) if rewards else float("nan"),
        last_window=sum(rewards[-w:]) / len(rewards[-w:]) if rewards else float("nan"),
        wall_seconds=wall,
        run_dir=r.ctx.run_dir,
        report=report_path,
    )


def write_report(run_dir: Path) -> Path | None:
    try:
        from rlhf_trainer.report import write_report as _write

        out = _write(run_dir)
    except Exception as err:  # a broken plot must not fail a finished training run
        log.warning("could not write the report of %s: %s", run_dir, err)
        return None
    return Path(out) if out else None
