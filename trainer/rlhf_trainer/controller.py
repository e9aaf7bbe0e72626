"""The single controller of a training job: `rlhf run` locally, the controller pod on a cluster.

    ctx    = setup(job)                           # models, data, Ray, role workers, resume
    stream = build_stream(ctx)                    # the manifest's algorithm, or spec.pipeline
    for step in range(start, steps):
        metrics = stream.step()                   # rollout -> reward -> filter -> reference/critic
                                                  #   -> advantage -> update   (dataflow.phases)
        settle_rollout(ctx, metrics)              # async rollouts: the next step's, generated meanwhile
        elastic_rollout(ctx, metrics)             # step boundary: follow the fleet's owner, add/drain
        sync_weights(ctx)                         # weight sync
        evaluate_if_due(run, step + 1, metrics)   # evaluation (every eval.every steps, and the last)
        log_step(run, step, metrics)              # log: JSONL, samples, /metrics, trackers, bar, status
        save_checkpoint_if_due(run, step + 1)     # checkpoint (every N steps and at the end)
    export_final(run)                             # the policy as a Hugging Face model directory
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

from rlhf_trainer import checkpoint, contract, placement, ray_node
from rlhf_trainer.dataflow import (
    DataStream,
    DynamicSamplingOperator,
    RewardOperator,
    RolloutOperator,
    UpdateOperator,
)
from rlhf_trainer.dataflow.batch import StepBatch
from rlhf_trainer.dataflow.context import TrainerContext, timed
from rlhf_trainer.dataflow.phases import evaluate, reshard_if_needed, sample_rows, sync_weights
from rlhf_trainer.spec import JobSpec, RLTrainingJob, unused_roles
from rlhf_trainer.sync.fleet import ElasticOptions, membership_source
from rlhf_trainer.sync.membership import MembershipSource

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
    samples: Any = None
    """`samples.jsonl`: a few prompt/response/reward rows per step and per evaluation."""
    trackers: Any = None
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
) -> Summary:
    """Run `job` to its last step (resuming from the latest checkpoint) and return the summary.
    `elastic`: the disaggregated rollout fleet's membership source and hooks (clock, signal, sync
    checks; see `sync.fleet.ElasticOptions`)."""
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
            # checkpoint
            save_checkpoint_if_due(r, step + 1)
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
    """Disaggregated placement: the resharding protocol at the step boundary (`sync.fleet`)."""
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


def log_step(
    r: Run, step: int, metrics: dict[str, Any], evaluated: dict[str, StepBatch] | None = None
) -> None:
    """Write the step's metrics to the JSONL log, the /metrics endpoint, the trackers, the bar and
    the job status; a few of its samples (and of the evaluation's) to the sample log."""
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
    k = ctx.spec.output.samples_per_step
    rows = sample_rows(last, k, step, "train")
    rows += [
        row
        for mode, batch in (evaluated or {}).items()
        for row in sample_rows(batch, k, step, f"eval/{mode}")
    ]
    for row in rows:
        r.samples.log(row)
    r.metrics.record(step, metrics)
    r.trackers.log(step, metrics)
    if r.progress is not None:
        r.progress.set_postfix(reward=f"{metrics.get('reward/mean', float('nan')):.3f}", refresh=False)
        r.progress.update(1)
    if r.on_status is not None:
        r.on_status(step + 1, ctx.spec.training.steps, metrics)


def save_checkpoint_if_due(r: Run, done: int) -> None:
    if due(done, r.ctx.spec.checkpoint.every, r.ctx.spec.training.steps):
        save_checkpoint(r, done)


def trained_roles(ctx: TrainerContext) -> dict[str, Any]:
    """The roles whose state a checkpoint holds (each writes its own part), by name."""
    return {name: g for name, g in (("actor", ctx.actor), ("critic", ctx.critic)) if g is not None}


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
    return checkpoint.save(
        r.checkpoint_dir, done, state, write_workers, ctx.spec.checkpoint.keep, controller_tensors=tensors
    )


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
    if r.progress is not None:
        r.progress.close()  # the export's progress lines go below the finished bar
        r.progress = None
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
    from rlhf_trainer.metrics import read_jsonl

    r.logger.close()
    r.samples.close()
    r.trackers.close()
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
    eval_spec = spec.eval
    if eval_spec is not None:
        eval_spec = dataclasses.replace(eval_spec, path=resolve(eval_spec.path) or eval_spec.path)
    reward = spec.reward
    if reward.model is not None:
        reward = dataclasses.replace(
            reward,
            model=dataclasses.replace(reward.model, path=resolve(reward.model.path) or reward.model.path),
        )
    training = spec.training if steps is None else dataclasses.replace(spec.training, steps=steps)
    return dataclasses.replace(spec, model=model, data=data, reward=reward, training=training, eval=eval_spec)


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
    from rlhf_trainer.trackers import check_installed

    algorithm = build_algorithm(spec.algorithm.name, spec.algorithm.all_params, job=spec)
    check_installed(spec.output.trackers)
    check_environment(spec)
    prepare_model_and_data(spec)
    tokenizer = load_tokenizer(spec)
    dataset = load_prompts(spec, tokenizer)
    eval_prompts = load_eval_prompts(spec, tokenizer)
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
        eval_prompts=eval_prompts,
    )
    stream = build_stream(ctx)
    r = Run(
        ctx=ctx, stream=stream, start_step=0, checkpoint_dir=checkpoint_root(spec, out_dir), owns_ray=owns_ray
    )
    try:
        options = elastic or ElasticOptions()
        # Who sizes the rollout fleet: the local autoscaling policy, or (controller pod) the operator.
        membership = membership_source(spec, job_name, options)
        r.groups = start_workers(ctx, stream, membership)
        start_fleet(ctx, options, membership)
        start_rollout_ahead(ctx)
        check_checkpoint_volume(r)
        r.start_step = maybe_resume(r, spec.checkpoint.resume if resume is None else resume)
        start_logging(r, on_status)
    except BaseException:
        teardown(r)
        raise
    return r


def check_environment(spec: JobSpec) -> None:
    """A multi-turn job's environment is built once here, before any worker starts, so a bad
    import path or kwargs fails naming `spec.rollout.multiTurn` (the workers build their own)."""
    if spec.rollout.multi_turn is None:
        return
    from rlhf_trainer.environments import build_environment

    try:
        build_environment(spec.rollout.multi_turn.environment, spec.rollout.multi_turn.kwargs)
    except (ValueError, TypeError) as err:
        raise RunError(str(err)) from err


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


def load_eval_prompts(spec: JobSpec, tokenizer: Any) -> list[Any]:
    """The evaluation's prompts (`spec.eval.path`, read like `spec.data` but in file order; too
    long ones skipped), the first `eval.maxPrompts` of them; none without `spec.eval`."""
    from rlhf_trainer.data import DataError, PromptDataset

    if spec.eval is None:
        return []
    data = dataclasses.replace(
        spec.data, path=spec.eval.path, format=spec.eval.format, shuffle=False, overlong_prompts="skip"
    )
    try:
        items = PromptDataset(data, tokenizer, seed=spec.training.seed).items
    except DataError as err:
        raise RunError(f"spec.eval.path: {err}") from err
    return items[: spec.eval.max_prompts] if spec.eval.max_prompts else items


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
        # Only values shared by every pod: a pod's own (RLHF_POD_IP, RLHF_ROLE, ...) reach its
        # workers from its raylet's environment, and the driver's would override them.
        contract.ENV_TORCH_THREADS.name: contract.ENV_TORCH_THREADS.get_str(),
        # Workers load models quietly: one progress bar per worker and step is noise on the console.
        contract.ENV_TRANSFORMERS_VERBOSITY.name: contract.ENV_TRANSFORMERS_VERBOSITY.get_str(),
        "HF_HUB_DISABLE_PROGRESS_BARS": "1",
        "TQDM_DISABLE": "1",
    }
    address = address or contract.ENV_RAY_ADDRESS.get()
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
        # The role workers at the driver's priority, not Ray's default +15 (see ray_node).
        _system_config=ray_node.system_config(),
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
    stream = (
        DataStream()
        .add_operator(RolloutOperator(ctx))  # rollout: prompts -> samplesPerPrompt responses each
        .add_operator(
            RewardOperator(ctx)
        )  # reward: functions + reward model (failed ones dropped, per onError)
    )
    if ctx.spec.algorithm.dynamic_sampling.enabled:  # DAPO: groups with reward variance, oversampled
        stream.add_operator(DynamicSamplingOperator(ctx))
    return stream.add_operator(UpdateOperator(ctx))  # reference/critic -> advantage -> actor/critic update


def start_workers(
    ctx: TrainerContext, stream: DataStream, membership: MembershipSource | None = None
) -> list[Any]:
    """Start every role the stream's algorithms need; the slow part (model loading) in parallel.
    Rollout replicas: as many as `membership` starts with, replica i placed in its slot i."""
    from rlhf_trainer.workers import ActorWorker, CriticWorker, ReferenceWorker, RewardWorker, RolloutWorker
    from rlhf_trainer.workers.group import WorkerGroup

    spec = ctx.spec
    roles = spec.roles
    algorithms = stream.algorithms() or [ctx.algorithm]
    colocated = roles.placement == "colocated"
    cluster = placement.on_cluster()
    groups: list[Any] = []
    placed: list[placement.RolePlacement] = []

    def group(cls: type, role: str, replicas: int | None = None, **kw: Any) -> Any:
        # Each rank asks Ray for what the role's `resources` name, never for what this driver sees.
        p = placement.role_placement(spec, role, cluster=cluster, replicas=replicas)
        placed.append(p)
        g = WorkerGroup(cls, spec, p.ranks, start=False, **p.ray_options(), device=p.device, **kw)
        groups.append(g)
        return g

    # The roles the job runs (`unused_roles`: the operator creates no pods for the others).
    unused = unused_roles(spec)
    ctx.actor = group(ActorWorker, "actor", distributed=True, colocated=colocated)
    if any(a.needs_critic for a in algorithms) and "critic" not in unused:
        ctx.critic = group(CriticWorker, "critic", distributed=True)
    if any(a.needs_reference for a in algorithms) and "reference" not in unused:
        ctx.reference = group(ReferenceWorker, "reference")
    ctx.reward = group(RewardWorker, "reward")
    if not colocated:
        replicas = membership.initial().replicas if membership else roles.rollout.replicas
        slot = membership.placement if membership else None
        ctx.rollout = group(RolloutWorker, "rollout", max(1, replicas), rank_resources=slot)
    if not cluster:  # on a cluster the pods join Ray as they start; locally it has what it has
        import ray

        placement.check_local_gpus(placed, float(ray.cluster_resources().get("GPU", 0)))
    WorkerGroup.start_all(groups)
    return groups


def start_fleet(
    ctx: TrainerContext, options: ElasticOptions, membership: MembershipSource | None = None
) -> None:
    """Disaggregated placement: the elastic fleet over the rollout workers (weight-sync group,
    prompt queue, membership source)."""
    if ctx.rollout is None:
        return
    from rlhf_trainer.sync.fleet import RolloutFleet

    backend = placement.sync_backend(
        options.sync_backend, ctx.actor.device or "cpu", ctx.rollout.device or "cpu"
    )
    options = dataclasses.replace(options, sync_backend=backend)
    ctx.fleet = RolloutFleet.start(
        ctx.actor.workers,
        ctx.rollout,
        list(ctx.rollout.workers),
        membership or membership_source(ctx.spec, ctx.job_name, options),
        options,
        max_replicas=ctx.spec.roles.rollout.max_replicas,
    )


def start_rollout_ahead(ctx: TrainerContext) -> None:
    """Asynchronous rollouts (`rollout.maxStaleness` > 0): the fleet generates the next step
    while the actor trains (`dataflow.rollout_ahead`). Disaggregated placement only."""
    if ctx.spec.rollout.max_staleness == 0:
        return
    if ctx.fleet is None:
        raise RunError(
            f"spec.rollout.maxStaleness: {ctx.spec.rollout.max_staleness} needs a rollout fleet "
            "(spec.roles.placement: disaggregated); valid with colocated placement: 0"
        )
    from rlhf_trainer.dataflow.rollout_ahead import RolloutAhead

    ctx.ahead = RolloutAhead(ctx)


def maybe_resume(r: Run, resume: bool) -> int:
    """Restore the latest complete checkpoint; returns the first step to run."""
    found = checkpoint.latest(r.checkpoint_dir) if resume else None
    if found is None:
        truncate_logs(r.ctx.run_dir, 0)  # a fresh start: no records of an older run
        return 0
    ctx = r.ctx
    roles = trained_roles(ctx)
    missing = [role for role in roles if role not in checkpoint.parts(found)]
    if missing:
        raise RunError(
            f"checkpoint {found} holds no {' or '.join(missing)} part (it holds "
            f"{', '.join(checkpoint.parts(found))}): resume it with the job that wrote it, or --no-resume"
        )
    for group in roles.values():
        group.call("load", str(found))
    state = checkpoint.load_state(found)
    ctx.dataset.load_state_dict(state["data"])
    ctx.algorithm.load_state_dict(state["algorithm"])
    ctx.policy_version = int(state.get("policy_version", 0))
    sync_weights(ctx)
    if state.get("rollout_ahead"):  # the batch generated ahead for the step we resume at
        from rlhf_trainer.dataflow.rollout_ahead import RolloutAhead

        if ctx.ahead is None:  # maxStaleness is 0 now: the batch is taken (and, too old, regenerated)
            ctx.ahead = RolloutAhead(ctx)
        ctx.ahead.restore(state["rollout_ahead"], checkpoint.load_controller_tensors(found))
    step = int(state["step"])
    truncate_logs(ctx.run_dir, step)
    log.info("resumed from %s at step %d", found, step)
    print(f"resuming from {found} (step {step})", file=sys.stderr)
    return step


def check_checkpoint_volume(r: Run) -> None:
    """Fail at startup, not at the first save, when a trained role's pods do not share the
    checkpoint directory with the controller (`checkpoint.check_shared`)."""
    roles = trained_roles(r.ctx)

    def asker(group: Any) -> Callable[[str], Any]:
        return lambda probe: group.call("answer_checkpoint_probe", probe)

    checkpoint.check_shared(r.checkpoint_dir, {role: asker(g) for role, g in roles.items()})


#: The run directory's per-step logs (records with a `step`), cut back together on resume.
STEP_LOGS = ("metrics.jsonl", "samples.jsonl")


def truncate_logs(run_dir: Path, first_step: int) -> None:
    for name in STEP_LOGS:
        truncate_log(run_dir / name, first_step)


def truncate_log(path: Path, first_step: int) -> None:
    """Drop log records of steps at or after `first_step` (written after the checkpoint we resume)."""
    if not path.is_file():
        return
    from rlhf_trainer.metrics import read_jsonl

    kept = [r for r in read_jsonl(path) if r.get("step", 0) < first_step]  # a torn last line is dropped
    path.write_text("".join(json.dumps(r) + "\n" for r in kept))


def start_logging(r: Run, on_status: StatusCallback | None) -> None:
    from rlhf_trainer.metrics import JsonlLogger, MetricsServer, StepMetrics
    from rlhf_trainer.trackers import open_trackers

    spec = r.ctx.spec
    r.logger = JsonlLogger(r.ctx.run_dir / "metrics.jsonl")
    r.samples = JsonlLogger(r.ctx.run_dir / "samples.jsonl")
    config = json.loads(json.dumps(dataclasses.asdict(spec), default=str))
    r.trackers = open_trackers(spec, r.ctx.run_dir, r.ctx.job_name, config)
    r.metrics = StepMetrics(job=r.ctx.job_name)
    in_pod = contract.ENV_KUBERNETES_SERVICE_HOST.is_set()
    r.server = MetricsServer(
        spec.output.metrics_port, host="0.0.0.0" if in_pod else "127.0.0.1", metrics=r.metrics
    )
    (r.ctx.run_dir / "metrics_port").write_text(f"{r.server.port}\n")
    if r.ctx.fleet is not None:
        r.ctx.fleet.attach_metrics(r.metrics.registry)
    if spec.output.progress and sys.stderr.isatty():
        from tqdm import tqdm

        r.progress = tqdm(total=spec.training.steps, initial=r.start_step, desc=r.ctx.job_name, unit="step")
    elif spec.output.progress:  # a pod's log, a CI log: lines, not a redrawn bar
        r.progress = LineProgress(spec.training.steps, r.start_step, r.ctx.job_name)
    r.on_status = on_status


class LineProgress:
    """Progress as log lines where stderr is no terminal (`kubectl logs` of the controller pod):
    the first step, then one line at most every `interval` seconds, and the last step. The same
    calls as tqdm's bar."""

    def __init__(self, total: int, initial: int, desc: str, interval: float = 10.0):
        self.total, self.done, self.desc, self.interval = total, initial, desc, interval
        self.first = initial
        self.postfix = ""
        self.t0 = self.last = time.monotonic()

    def set_postfix(self, refresh: bool = False, **values: str) -> None:
        self.postfix = "  ".join(f"{k} {v}" for k, v in values.items())

    def update(self, n: int = 1) -> None:
        self.done += n
        now = time.monotonic()
        if self.done - self.first == 1 or self.done >= self.total or now - self.last >= self.interval:
            rate = (now - self.t0) / max(1, self.done - self.first)
            print(
                f"{self.desc}: step {self.done}/{self.total}  {self.postfix}  ({rate:.2f} s/step)",
                file=sys.stderr,
                flush=True,
            )
            self.last = now

    def close(self) -> None:
        pass


def teardown(r: Run) -> None:
    if r.progress is not None:
        r.progress.close()
    if r.server is not None:
        r.server.stop()
    for log_file in (r.logger, r.samples, r.trackers):
        if log_file is not None:
            log_file.close()
    if r.ctx.ahead is not None:
        r.ctx.ahead.shutdown()
    if r.ctx.fleet is not None:
        r.ctx.fleet.shutdown()
    for g in r.groups:
        g.shutdown()
    if r.owns_ray:
        import ray

        ray.shutdown()
