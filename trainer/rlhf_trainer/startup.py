"""The setup of a run: everything before the first step, and its teardown.

    spec = resolve_spec(job.spec, manifest_dir, steps)   # paths absolute, --steps
    r    = setup(job_name, spec, run_dir, resume, ...)   # the order that fails fastest:
        algorithm, trackers installed      # a bad name or a missing extra, before anything loads
        model and data (bootstrap), tokenizer, prompts, evaluation prompts
        the run directory, Ray, the stream (`build_stream`: which roles the job runs)
        role workers (`start_workers`), the rollout fleet (`start_fleet`), rollouts ahead
        the checkpoint volume shared with every trained role, resume (`maybe_resume`)
        the logs: JSONL, samples, trackers, /metrics, progress (`start_logging`)
    ...                                                  # the step loop (`controller.run`)
    teardown(r)                                          # what setup started, in reverse

`Run` is what setup hands the loop. The loop itself lives in `controller`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from rlhf_api import contract
from rlhf_api.job import JobSpec, unused_roles
from rlhf_api.loader import resolve_path
from rlhf_trainer import checkpoint, checkpoint_owner, placement, ray_node, user_code
from rlhf_trainer.dataflow import (
    DataStream,
    DynamicSamplingOperator,
    RewardOperator,
    RolloutOperator,
    UpdateOperator,
)
from rlhf_trainer.dataflow.context import TrainerContext
from rlhf_trainer.dataflow.phases import sync_weights
from rlhf_trainer.fleet.elastic import ElasticOptions, membership_source
from rlhf_trainer.fleet.membership import MembershipSource

if TYPE_CHECKING:
    from rlhf_trainer.metrics import JsonlLogger, MetricsServer, StepMetrics
    from rlhf_trainer.trackers import Trackers
    from rlhf_trainer.workers.group import WorkerGroup

log = logging.getLogger(__name__)

#: Called after each step's checkpoint phase: (steps done, total steps, the step's metrics, the step
#: of the last checkpoint saved or resumed from, None before any). The controller pod's is
#: `run_cli.StatusReporter`, which writes `status.progress`.
StatusCallback = Callable[[int, int, dict[str, float], int | None], None]


class RunError(RuntimeError):
    """A job that cannot start or continue; the message says what was wrong and what is valid."""


class Progress(Protocol):
    """The progress display: tqdm's bar on a terminal, `LineProgress` elsewhere (same calls)."""

    def set_postfix(self, refresh: bool = False, **values: str) -> None: ...

    def update(self, n: int = 1) -> None: ...

    def close(self) -> None: ...


@dataclass
class RunLogs:
    """Where a run's steps are written, opened together by `start_logging`."""

    steps: JsonlLogger
    """`metrics.jsonl`: one record per step."""
    samples: JsonlLogger
    """`samples.jsonl`: a few prompt/response/reward rows per step and per evaluation."""
    trackers: Trackers
    metrics: StepMetrics
    """The step's gauges, served on /metrics by `server`."""
    server: MetricsServer
    progress: Progress | None = None


@dataclass
class Run:
    """A running job: the context the operators see, plus what only the loop needs."""

    ctx: TrainerContext
    stream: DataStream
    start_step: int
    checkpoint_dir: Path
    logs: RunLogs | None = None
    """Opened by `start_logging`, the last step of `setup`: the loop reads them through `opened`."""
    on_status: StatusCallback | None = None
    checkpoint_step: int | None = None
    """The step of the last complete checkpoint this run saved or resumed from (None before any):
    set by `maybe_resume` and `controller.save_checkpoint`, reported as status.progress.checkpointStep."""
    history: list[dict[str, float]] = field(default_factory=list)
    owns_ray: bool = False
    groups: list[WorkerGroup] = field(default_factory=list)

    def opened(self) -> RunLogs:
        """The run's logs (setup opened them before the first step)."""
        if self.logs is None:
            raise RunError(f"job {self.ctx.job_name}: the run's logs are not open (setup did not finish)")
        return self.logs


def resolve_spec(spec: JobSpec, manifest_dir: Path, steps: int | None) -> JobSpec:
    """Paths made absolute (`~` expanded, relative ones against the manifest's folder); `--steps`."""

    def resolve(path: str | None) -> str | None:
        return None if path is None else resolve_path(path, manifest_dir)

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

    def resolve_model(m: Any) -> Any:
        return dataclasses.replace(m, path=resolve(m.path) or m.path)

    reward = dataclasses.replace(
        reward,
        model=resolve_model(reward.model) if reward.model is not None else None,
        models=[resolve_model(m) for m in reward.models],
    )
    training = spec.training if steps is None else dataclasses.replace(spec.training, steps=steps)
    return dataclasses.replace(spec, model=model, data=data, reward=reward, training=training, eval=eval_spec)


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
    resume = spec.checkpoint.resume if resume is None else resume
    out_dir = Path(run_dir or spec.output.dir.format(name=job_name)).resolve()
    refused = checkpoint_owner.refusal(
        checkpoint_root(spec, out_dir), checkpoint_owner.job_uid(), job_name, resume
    )
    if refused:  # before the model loads: a recreated job never resumes its predecessor's state
        raise RunError(refused)
    prepare_model_and_data(spec)
    tokenizer = load_tokenizer(spec)
    dataset = load_prompts(spec, tokenizer)
    eval_prompts = load_eval_prompts(spec, tokenizer)
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
        r.start_step = maybe_resume(r, resume)
        checkpoint_owner.claim(r.checkpoint_dir, checkpoint_owner.job_uid(), job_name)
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
    env = {
        "PYTHONPATH": user_code.worker_pythonpath(),  # the user's modules, as `rlhf validate` imports them
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
) -> list[WorkerGroup]:
    """Start every role the stream's algorithms need; the slow part (model loading) in parallel.
    Rollout replicas: as many as `membership` starts with, replica i placed in its slot i."""
    from rlhf_trainer.workers import ActorWorker, CriticWorker, ReferenceWorker, RewardWorker, RolloutWorker
    from rlhf_trainer.workers.group import WorkerGroup

    spec = ctx.spec
    roles = spec.roles
    algorithms = stream.algorithms() or [ctx.algorithm]
    colocated = roles.placement == "colocated"
    cluster = placement.on_cluster()
    groups: list[WorkerGroup] = []
    placed: list[placement.RolePlacement] = []

    def group(cls: type, role: str, replicas: int | None = None, **kw: Any) -> WorkerGroup:
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
    from rlhf_trainer.fleet.elastic import RolloutFleet

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
    # Admission refuses maxStaleness > 0 without a fleet (the job's CEL rule on rollout.maxStaleness).
    assert ctx.fleet is not None, "maxStaleness > 0 without a rollout fleet passed admission"
    from rlhf_trainer.dataflow.rollout_ahead import RolloutAhead

    ctx.ahead = RolloutAhead(ctx)


def trained_roles(ctx: TrainerContext) -> dict[str, WorkerGroup]:
    """The roles whose state a checkpoint holds (each writes its own part), by name."""
    return {name: g for name, g in (("actor", ctx.actor), ("critic", ctx.critic)) if g is not None}


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
    r.checkpoint_step = step
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
    """Open the run's logs: the step and sample logs, the trackers, the /metrics endpoint (its
    port written to the run directory) and the progress display. What opened before a failure
    is closed again."""
    from rlhf_trainer.metrics import JsonlLogger, MetricsServer, StepMetrics
    from rlhf_trainer.trackers import open_trackers

    spec = r.ctx.spec
    with contextlib.ExitStack() as opened:
        steps = opened.enter_context(JsonlLogger(r.ctx.run_dir / "metrics.jsonl"))
        samples = opened.enter_context(JsonlLogger(r.ctx.run_dir / "samples.jsonl"))
        config = json.loads(json.dumps(dataclasses.asdict(spec), default=str))
        # The checkpoint resumed, if any (`maybe_resume`): the trackers reopen their runs.
        trackers = open_trackers(spec, r.ctx.run_dir, r.ctx.job_name, config, resume_step=r.checkpoint_step)
        opened.callback(trackers.close)
        metrics = StepMetrics(job=r.ctx.job_name)
        in_pod = contract.ENV_KUBERNETES_SERVICE_HOST.is_set()
        server = MetricsServer(
            spec.output.metrics_port, host="0.0.0.0" if in_pod else "127.0.0.1", metrics=metrics
        )
        opened.callback(server.stop)
        (r.ctx.run_dir / "metrics_port").write_text(f"{server.port}\n")
        if r.ctx.fleet is not None:
            r.ctx.fleet.attach_metrics(metrics.registry)
        r.logs = RunLogs(steps, samples, trackers, metrics, server, progress_display(r))
        opened.pop_all()
    r.on_status = on_status


def progress_display(r: Run) -> Progress | None:
    """A bar on a terminal; on a pod's log or a CI log, lines (`LineProgress`); none when off."""
    spec = r.ctx.spec
    if spec.output.progress and sys.stderr.isatty():
        from tqdm import tqdm

        bar: Progress = tqdm(
            total=spec.training.steps, initial=r.start_step, desc=r.ctx.job_name, unit="step"
        )
        return bar
    if spec.output.progress:  # a pod's log, a CI log: lines, not a redrawn bar
        return LineProgress(spec.training.steps, r.start_step, r.ctx.job_name)
    return None


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
    """Stop what setup started (whatever part of it ran), in reverse; closing twice is harmless."""
    if r.logs is not None:
        if r.logs.progress is not None:
            r.logs.progress.close()
        r.logs.server.stop()
        for log_file in (r.logs.steps, r.logs.samples, r.logs.trackers):
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
