"""The single controller of a training job: `rlhf run` locally, the controller pod on a cluster.

    ctx    = setup(job)                           # models, data, Ray, role workers, resume
    stream = build_stream(ctx)                    # the manifest's algorithm, or spec.pipeline
    for step in range(start, steps):
        metrics = stream.step()                   # rollout -> reward -> filter -> reference/critic
                                                  #   -> advantage -> update   (dataflow.phases)
        elastic_rollout(ctx, metrics)             # step boundary: autoscale, add/drain, rebuild group
        sync_weights(ctx)                         # weight sync
        log_step(run, step, metrics)              # log: JSONL, /metrics, progress bar, status
        save_checkpoint_if_due(run, step + 1)     # checkpoint (every N steps and at the end)
    finish(run)                                   # summary, report

Everything a phase does lives in `dataflow.phases`; the role workers in `workers`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlhf_trainer import checkpoint
from rlhf_trainer.dataflow import DataStream, FilterOperator, RewardOperator, RolloutOperator, UpdateOperator
from rlhf_trainer.dataflow.context import TrainerContext, timed
from rlhf_trainer.dataflow.elastic import ElasticOptions, reshard_if_needed
from rlhf_trainer.dataflow.phases import sync_weights
from rlhf_trainer.spec import JobSpec, RLTrainingJob

log = logging.getLogger(__name__)

StatusCallback = Callable[[int, int, dict[str, float]], None]


class RunError(RuntimeError):
    """A job that cannot start or continue; the message says what was wrong and what is valid."""


@dataclass
class Run:
    """A running job: the context the operators see, plus what only the loop needs."""

    ctx: TrainerContext
    stream: DataStream
    start_step: int
    checkpoint_dir: Path
    logger: Any = None
    metrics: Any = None
    server: Any = None
    progress: Any = None
    on_status: StatusCallback | None = None
    history: list[dict[str, float]] = field(default_factory=list)
    owns_ray: bool = False
    groups: list[Any] = field(default_factory=list)


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
) -> Summary:
    """Run `job` to its last step (resuming from the latest checkpoint) and return the summary.
    `elastic`: hooks of the disaggregated rollout fleet (clock, signal, sync checks; see
    `dataflow.elastic.ElasticOptions`)."""
    started = time.perf_counter()
    spec = resolve_spec(job.spec, Path(manifest_dir), steps)
    r = setup(job.metadata_name, spec, run_dir, resume, ray_address, on_status, elastic)
    if r.start_step >= spec.training.steps:
        print(f"all {spec.training.steps} steps are done already (--no-resume starts over)", file=sys.stderr)
    try:
        for step in range(r.start_step, spec.training.steps):
            r.ctx.step = step
            # rollout -> reward -> filter -> reference/critic -> advantage -> update
            metrics = r.stream.step()
            # elastic rollout (step boundary): autoscaling decision, add/drain replicas, rebuild group
            elastic_rollout(r.ctx, metrics)
            # weight sync
            with timed(metrics, "weight_sync"):
                metrics.update(sync_weights(r.ctx))
            # log
            log_step(r, step, metrics)
            # checkpoint
            save_checkpoint_if_due(r, step + 1)
        return finish(r, time.perf_counter() - started)
    finally:
        teardown(r)


def elastic_rollout(ctx: TrainerContext, metrics: dict[str, Any]) -> None:
    """Disaggregated placement: the resharding protocol at the step boundary (`dataflow.elastic`)."""
    if ctx.fleet is None:
        return
    with timed(metrics, "reshard"):
        reshard_if_needed(ctx, metrics)


def log_step(r: Run, step: int, metrics: dict[str, Any]) -> None:
    """Write the step's metrics to the JSONL log, the /metrics endpoint, the bar and the job status."""
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
    r.logger.log({**metrics, "reward/scores": scores}, step=step)
    r.metrics.record(step, metrics)
    if r.progress is not None:
        r.progress.set_postfix(reward=f"{metrics.get('reward/mean', float('nan')):.3f}", refresh=False)
        r.progress.update(1)
    if r.on_status is not None:
        r.on_status(step + 1, ctx.spec.training.steps, metrics)


def save_checkpoint_if_due(r: Run, done: int) -> None:
    every = r.ctx.spec.checkpoint.every
    last = done == r.ctx.spec.training.steps
    if last or (every and done % every == 0):
        save_checkpoint(r, done)


def save_checkpoint(r: Run, done: int) -> Path:
    ctx = r.ctx

    def write_workers(tmp: Path) -> None:
        ctx.actor.call("save", str(tmp))
        if ctx.critic is not None:
            ctx.critic.call("save", str(tmp))

    state = {
        "job": ctx.job_name,
        "policy_version": ctx.policy_version,
        "data": ctx.dataset.state_dict(),
        "algorithm": ctx.algorithm.state_dict(),
    }
    return checkpoint.save(r.checkpoint_dir, done, state, write_workers, ctx.spec.checkpoint.keep)


def finish(r: Run, wall: float) -> Summary:
    """Close the bar, write the report, and summarise the whole run (earlier sessions included)."""
    from rlhf_trainer.metrics import read_jsonl

    r.logger.close()
    records = read_jsonl(r.ctx.run_dir / "metrics.jsonl")
    rewards = [float(x["reward/mean"]) for x in records if isinstance(x.get("reward/mean"), (int, float))]
    rewards = [x for x in rewards if not math.isnan(x)]
    if r.progress is not None:
        r.progress.close()
        r.progress = None
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


# --------------------------------------------------------------------------------------------
# Setup
# --------------------------------------------------------------------------------------------


def resolve_spec(spec: JobSpec, manifest_dir: Path, steps: int | None) -> JobSpec:
    """Paths made absolute (`~` expanded, relative ones against the manifest's folder); `--steps`."""

    def resolve(path: str | None) -> str | None:
        if path is None:
            return None
        p = Path(path).expanduser()
        if p.is_absolute():
            return str(p)
        local = manifest_dir / p
        # `org/name` hub ids stay as they are unless a local folder of that name exists.
        if local.exists() or path.startswith(".") or not _looks_like_hub_id(path):
            return str(local.resolve())
        return path

    model = dataclasses.replace(
        spec.model,
        path=resolve(spec.model.path) or spec.model.path,
        tokenizer=resolve(spec.model.tokenizer),
        critic_path=resolve(spec.model.critic_path),
    )
    data = dataclasses.replace(spec.data, path=resolve(spec.data.path) or spec.data.path)
    reward = spec.reward
    if reward.model is not None:
        reward = dataclasses.replace(
            reward,
            model=dataclasses.replace(reward.model, path=resolve(reward.model.path) or reward.model.path),
        )
    training = spec.training if steps is None else dataclasses.replace(spec.training, steps=steps)
    return dataclasses.replace(spec, model=model, data=data, reward=reward, training=training)


def _looks_like_hub_id(path: str) -> bool:
    parts = path.split("/")
    return len(parts) == 2 and all(parts) and not path.startswith(("/", "~", "."))


def setup(
    job_name: str,
    spec: JobSpec,
    run_dir: str | Path | None,
    resume: bool | None,
    ray_address: str | None,
    on_status: StatusCallback | None,
    elastic: ElasticOptions | None = None,
) -> Run:
    """Everything before the first step, in the order that fails fastest on a bad manifest."""
    from rlhf_trainer.algorithms import build_algorithm

    algorithm = build_algorithm(spec.algorithm.name, spec.algorithm.params)
    prepare_model_and_data(spec)
    tokenizer = load_tokenizer(spec)
    dataset = load_prompts(spec, tokenizer)
    out_dir = Path(run_dir or spec.output.dir.format(name=job_name)).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "spec.json").write_text(json.dumps(dataclasses.asdict(spec), indent=1, default=str))

    owns_ray = start_ray(ray_address)
    ctx = TrainerContext(
        spec=spec,
        job_name=job_name,
        run_dir=out_dir,
        tokenizer=tokenizer,
        dataset=dataset,
        algorithm=algorithm,
        actor=None,
        reward=None,
    )
    stream = build_stream(ctx)
    r = Run(
        ctx=ctx, stream=stream, start_step=0, checkpoint_dir=checkpoint_root(spec, out_dir), owns_ray=owns_ray
    )
    try:
        r.groups = start_workers(ctx, stream)
        start_fleet(ctx, elastic or ElasticOptions())
        r.start_step = maybe_resume(r, spec.checkpoint.resume if resume is None else resume)
        start_logging(r, on_status)
    except BaseException:
        teardown(r)
        raise
    return r


def prepare_model_and_data(spec: JobSpec) -> None:
    """Build a bootstrap model (and its prompt file) when asked; a clear error for missing paths."""
    from rlhf_trainer.bootstrap import ensure_model, ensure_prompts

    ensure_model(spec.model)
    data = Path(spec.data.path)
    if spec.model.bootstrap and not data.exists():
        ensure_prompts(spec.model.bootstrap, data, n=4096, seed=spec.training.seed)
    if not Path(spec.model.path).is_dir():
        raise RunError(f"spec.model.path: {spec.model.path!r} is not a directory holding a model")
    if not (Path(spec.model.path) / "config.json").is_file():
        raise RunError(f"spec.model.path: {spec.model.path!r} holds no config.json; it is not a saved model")


def load_tokenizer(spec: JobSpec) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(spec.model.tokenizer or spec.model.path)


def load_prompts(spec: JobSpec, tokenizer: Any) -> Any:
    from rlhf_trainer.data import PromptDataset

    return PromptDataset(spec.data, tokenizer, seed=spec.training.seed)


def checkpoint_root(spec: JobSpec, run_dir: Path) -> Path:
    return (
        Path(spec.checkpoint.dir).expanduser().resolve() if spec.checkpoint.dir else run_dir / "checkpoints"
    )


def start_ray(address: str | None = None) -> bool:
    """Join `address` (or RAY_ADDRESS), or start a local Ray instance; True when we started it."""
    import ray

    if ray.is_initialized():
        return False
    path = os.pathsep.join(p for p in [os.getcwd(), *sys.path] if p)
    env = {
        "PYTHONPATH": path,
        "RLHF_TORCH_THREADS": os.environ.get("RLHF_TORCH_THREADS", "1"),
        # Workers load models quietly: one progress bar per worker and step is noise on the console.
        "TRANSFORMERS_VERBOSITY": os.environ.get("TRANSFORMERS_VERBOSITY", "error"),
        "HF_HUB_DISABLE_PROGRESS_BARS": "1",
        "TQDM_DISABLE": "1",
    }
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, runtime_env={"env_vars": env}, log_to_driver=True)
        return False
    # Logical CPUs, not cores: workers ask for fractions, so the whole job fits on a laptop.
    ray.init(
        num_cpus=max(8, os.cpu_count() or 1),
        include_dashboard=False,
        runtime_env={"env_vars": env},
        log_to_driver=True,
        configure_logging=False,
    )
    return True


def build_stream(ctx: TrainerContext) -> DataStream:
    """The manifest's standard stream, or the user's `spec.pipeline` (`pkg.mod:build(ctx)`)."""
    if ctx.spec.pipeline:
        from rlhf_trainer.algorithms.registry import Registry

        build = Registry[Callable[[TrainerContext], DataStream]]("pipeline").get(ctx.spec.pipeline)
        stream = build(ctx)
        if not isinstance(stream, DataStream):
            raise RunError(
                f"spec.pipeline: {ctx.spec.pipeline} returned {type(stream).__name__}, not a DataStream"
            )
        return stream
    return standard_stream(ctx)


def standard_stream(ctx: TrainerContext) -> DataStream:
    """The stream a manifest's `algorithm` section describes."""
    return (
        DataStream()
        .add_operator(RolloutOperator(ctx))  # rollout: prompts -> samplesPerPrompt responses each
        .add_operator(RewardOperator(ctx))  # reward: functions + reward model (failures per onError)
        .add_operator(FilterOperator(predicate=lambda b: b["reward_valid"], name="reward_failed"))
        .add_operator(UpdateOperator(ctx))  # reference/critic -> advantage -> actor/critic update
    )


def start_workers(ctx: TrainerContext, stream: DataStream) -> list[Any]:
    """Start every role the stream's algorithms need; the slow part (model loading) in parallel."""
    from rlhf_trainer.workers import ActorWorker, CriticWorker, ReferenceWorker, RewardWorker, RolloutWorker
    from rlhf_trainer.workers.group import WorkerGroup

    spec = ctx.spec
    roles = spec.roles
    algorithms = stream.algorithms() or [ctx.algorithm]
    colocated = roles.placement == "colocated"
    gpus = 1 if _cuda_available() else 0
    groups: list[Any] = []

    def group(cls: type, replicas: int, **kw: Any) -> Any:
        g = WorkerGroup(cls, spec, max(1, replicas), start=False, **kw)
        groups.append(g)
        return g

    ctx.actor = group(ActorWorker, roles.actor.replicas, distributed=True, colocated=colocated, num_gpus=gpus)
    if any(a.needs_critic for a in algorithms):
        ctx.critic = group(CriticWorker, roles.critic.replicas, distributed=True, num_gpus=gpus)
    if any(a.needs_reference for a in algorithms):
        ctx.reference = group(ReferenceWorker, roles.reference.replicas)
    ctx.reward = group(RewardWorker, roles.reward.replicas)
    if not colocated:
        ctx.rollout = group(RolloutWorker, roles.rollout.replicas)
    WorkerGroup.start_all(groups)
    return groups


def start_fleet(ctx: TrainerContext, options: ElasticOptions) -> None:
    """Disaggregated placement: the elastic fleet over the rollout workers (weight-sync group,
    prompt queue, autoscaler)."""
    if ctx.rollout is None:
        return
    from rlhf_trainer.dataflow.elastic import RolloutFleet

    ctx.fleet = RolloutFleet.start(ctx, options)


def _cuda_available() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def maybe_resume(r: Run, resume: bool) -> int:
    """Restore the latest complete checkpoint; returns the first step to run."""
    found = checkpoint.latest(r.checkpoint_dir) if resume else None
    if found is None:
        truncate_log(r.ctx.run_dir / "metrics.jsonl", 0)  # a fresh start: no records of an older run
        return 0
    ctx = r.ctx
    ctx.actor.call("load", str(found))
    if ctx.critic is not None:
        ctx.critic.call("load", str(found))
    state = checkpoint.load_state(found)
    ctx.dataset.load_state_dict(state["data"])
    ctx.algorithm.load_state_dict(state["algorithm"])
    ctx.policy_version = int(state.get("policy_version", 0))
    sync_weights(ctx)
    step = int(state["step"])
    truncate_log(ctx.run_dir / "metrics.jsonl", step)
    log.info("resumed from %s at step %d", found, step)
    print(f"resuming from {found} (step {step})", file=sys.stderr)
    return step


def truncate_log(path: Path, first_step: int) -> None:
    """Drop log records of steps at or after `first_step` (written after the checkpoint we resume)."""
    if not path.is_file():
        return
    from rlhf_trainer.metrics import read_jsonl

    kept = [r for r in read_jsonl(path) if r.get("step", 0) < first_step]  # a torn last line is dropped
    path.write_text("".join(json.dumps(r) + "\n" for r in kept))


def start_logging(r: Run, on_status: StatusCallback | None) -> None:
    from rlhf_trainer.metrics import JsonlLogger, MetricsServer, StepMetrics

    spec = r.ctx.spec
    r.logger = JsonlLogger(r.ctx.run_dir / "metrics.jsonl")
    r.metrics = StepMetrics(job=r.ctx.job_name)
    in_pod = bool(os.environ.get("KUBERNETES_SERVICE_HOST"))
    r.server = MetricsServer(
        spec.output.metrics_port, host="0.0.0.0" if in_pod else "127.0.0.1", metrics=r.metrics
    )
    (r.ctx.run_dir / "metrics_port").write_text(f"{r.server.port}\n")
    if r.ctx.fleet is not None:
        r.ctx.fleet.attach_metrics(r.metrics.registry)
    if spec.output.progress:
        from tqdm import tqdm

        r.progress = tqdm(
            total=spec.training.steps,
            initial=r.start_step,
            desc=r.ctx.job_name,
            unit="step",
            disable=not sys.stderr.isatty(),
        )
    r.on_status = on_status


def teardown(r: Run) -> None:
    if r.progress is not None:
        r.progress.close()
    if r.server is not None:
        r.server.stop()
    if r.logger is not None:
        r.logger.close()
    if r.ctx.fleet is not None:
        r.ctx.fleet.shutdown()
    for g in r.groups:
        g.shutdown()
    if r.owns_ray:
        import ray

        ray.shutdown()
