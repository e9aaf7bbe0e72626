"""`rlhf run`, `rlhf report` and `rlhf controller`: argument definitions and thin handlers.

Importing this module is cheap (argparse only): the controller, torch and Ray are imported
inside the handlers.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import Any

from rlhf_api import contract
from rlhf_trainer import gpu_preflight, ray_node

#: Where the operator mounts the job's manifest in the controller pod.
DEFAULT_SPEC_FILE = contract.SPEC_FILE


def add_subcommands(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "run",
        help="run an RLTrainingJob locally (Ray + torch on this machine)",
        description="Run the job's controller and role workers on a local Ray instance (or --ray-address). "
        "Resumes from the latest complete checkpoint unless --no-resume.",
    )
    p.add_argument("manifest", metavar="MANIFEST", help="YAML file holding one RLTrainingJob")
    p.add_argument("--steps", type=int, help="override spec.training.steps")
    p.add_argument("--run-dir", help="override spec.output.dir (logs, checkpoints, report)")
    p.add_argument("--no-resume", action="store_true", help="start from step 0 even if a checkpoint exists")
    p.add_argument("--ray-address", help="join this Ray cluster instead of starting a local one")
    p.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("report", help="rebuild a run's HTML report and plots from its metrics log")
    p.add_argument("run_dir", metavar="RUN_DIR", help="a run directory holding metrics.jsonl")
    p.set_defaults(func=cmd_report)

    p = sub.add_parser(
        "controller",
        help="in-cluster entrypoint: run the job from the mounted spec and report progress in its status",
    )
    p.add_argument(
        "--spec-file",
        default=contract.ENV_SPEC_FILE.get(),
        help=f"the mounted RLTrainingJob manifest (default ${contract.ENV_SPEC_FILE.name} or {DEFAULT_SPEC_FILE})",
    )
    p.add_argument("--run-dir", help="override spec.output.dir")
    p.add_argument("--ray-address", default=contract.ENV_RAY_ADDRESS.get(), help="the job's Ray head")
    p.set_defaults(func=cmd_controller)


def _logging(verbose: bool) -> None:
    logging.basicConfig(
        level=logging.INFO if verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s"
    )


def _load(path: str, folder: Path) -> Any:
    """The job at `path`, or None (printed why): invalid, or its GPUs cannot hold it (its models'
    relative paths against `folder`, where the run reads them)."""
    from rlhf_api.fields import SpecError
    from rlhf_api.loader import load_manifest

    try:
        job = load_manifest(path)
    except SpecError as err:
        print(f"{path}: invalid\n{err}", file=sys.stderr)
        return None
    return job if _fits(path, job.spec, folder) else None


def _fits(path: str, spec: Any, folder: Path) -> bool:
    """The resource planner's refusals stop the run before anything starts (as `rlhf validate`);
    its warnings are printed. A CPU job gets neither."""
    from rlhf_trainer.planner import plan_job, shapes_from

    plan = plan_job(spec, shape_of=shapes_from(folder))
    for line in plan.warnings:
        print(f"{path}: warning: {line}", file=sys.stderr)
    if plan.errors:
        lines = "\n".join(f"  - {e}" for e in plan.errors)
        print(f"{path}: does not fit its GPUs\n{lines}", file=sys.stderr)
    return not plan.errors


def cmd_run(args: argparse.Namespace) -> int:
    _logging(args.verbose)
    from rlhf_api.loader import manifest_dir

    folder = manifest_dir(args.manifest)
    job = _load(args.manifest, folder)
    if job is None:
        return 2
    if rc := gpu_preflight.exit_code_for_job(job.spec):  # GPU roles on this machine: its driver first
        return rc
    from rlhf_trainer.preemption import Preemption

    return _run(
        job,
        folder,
        args.steps,
        args.run_dir,
        not args.no_resume,
        args.ray_address,
        preemption=Preemption(),  # SIGTERM: checkpoint the step in progress, exit 143
    )


def _run(
    job: Any,
    manifest_dir: Path,
    steps: int | None,
    run_dir: str | None,
    resume: bool,
    ray_address: str | None,
    on_status: Any = None,
    membership: Any = None,
    preemption: Any = None,
) -> int:
    from rlhf_api.job import dropped_role_notes
    from rlhf_trainer import controller
    from rlhf_trainer.fleet.elastic import ElasticOptions
    from rlhf_trainer.preemption import EXIT_CODE, Preempted

    for line in dropped_role_notes(job.spec):
        print(f"note: {line}", file=sys.stderr)

    print(
        f"{job.metadata_name}: {job.spec.algorithm.name}, placement {job.spec.roles.placement}",
        file=sys.stderr,
    )
    try:
        summary = controller.run(
            job,
            manifest_dir=manifest_dir,
            steps=steps,
            run_dir=run_dir,
            resume=resume,
            ray_address=ray_address,
            on_status=on_status,
            elastic=ElasticOptions(membership=membership) if membership is not None else None,
            preemption=preemption,
        )
    except Preempted as stopped:
        print(f"{job.metadata_name}: {stopped}", file=sys.stderr)
        return EXIT_CODE
    except KeyboardInterrupt:
        print("interrupted; the next `rlhf run` resumes from the latest checkpoint", file=sys.stderr)
        return 130
    except Exception as err:  # one readable line; -v shows the traceback
        logging.getLogger(__name__).info("run failed", exc_info=True)
        print(f"error: {_first_line(err)}", file=sys.stderr)
        return 1
    print("\n".join(summary.lines()))
    return 0


def _first_line(err: BaseException) -> str:
    """The message of the exception a Ray worker raised (the cause), without Ray's wrapping."""
    cause = getattr(err, "cause", None) or err
    text = str(cause).strip() or type(cause).__name__
    return text if len(text) < 2000 else text[:2000] + " ..."


def cmd_report(args: argparse.Namespace) -> int:
    run_dir = Path(args.run_dir)
    if not (run_dir / "metrics.jsonl").is_file():
        print(f"error: {run_dir} holds no metrics.jsonl (is it a run directory?)", file=sys.stderr)
        return 1
    from rlhf_trainer.report import write_report

    print(write_report(run_dir))
    return 0


def cmd_controller(args: argparse.Namespace) -> int:
    """The controller pod: the same run, plus `status.progress` patches when inside Kubernetes."""
    _logging(True)
    job = _load(args.spec_file, Path.cwd())  # a pod's relative paths: its current directory, /workspace
    if job is None:
        return 2
    from rlhf_trainer.worker_cli import describe_pod

    logging.getLogger(__name__).info("%s: running job %s", describe_pod(), job.metadata_name)
    reporter = StatusReporter.from_environment(job.metadata_name, job.namespace)
    membership = follow_operator(job)
    ray_address = prepare_controller_pod(job, args.ray_address)
    # Relative spec paths resolve against the working directory (the pod's /workspace,
    # contract.POD_WORKSPACE_DIR), not against the read-only folder the spec is mounted in.
    from rlhf_trainer.preemption import Preemption

    # SIGTERM (a preemption, a drain, the gang's restart) checkpoints the step in progress.
    return _run(job, Path.cwd(), None, args.run_dir, True, ray_address, reporter, membership, Preemption())


def follow_operator(job: Any) -> Any:
    """In the controller pod of a disaggregated job: the operator owns the rollout fleet's size,
    so the fleet follows the job's `status.rollout` (`fleet.cluster_membership`) and this pod runs
    no autoscaler. Elsewhere None: `rlhf run`'s own policy."""
    if job.spec.roles.placement != "disaggregated":
        return None
    from rlhf_trainer.fleet.cluster_membership import ClusterMembership

    return ClusterMembership.from_environment(
        job.metadata_name, job.namespace, fallback_replicas=job.spec.roles.rollout.replicas
    )


def prepare_controller_pod(job: Any, ray_address: str | None, start: Any = None) -> str | None:
    """Inside the job's controller pod (the operator sets RLHF_ROLE=controller): serve /metrics on
    the port the operator's Service and readiness probe use (RLHF_METRICS_PORT), and start the Ray
    head the role pods join (`ray start --address=<controller>:6379`). Returns the address to join.
    Outside a pod it changes nothing."""
    import subprocess

    if contract.ENV_ROLE.get() != contract.CONTROLLER_ROLE:
        return ray_address
    if contract.ENV_METRICS_PORT.is_set():
        job.spec.output.metrics_port = contract.ENV_METRICS_PORT.get_int()
    if ray_address:
        return ray_address
    cmd = ["--head", f"--port={contract.RAY_PORT}"]
    pod_ip = contract.ENV_POD_IP.get()
    if pod_ip:
        # The head advertises the pod's IP (what role pods and the driver's actors reach it on),
        # not whatever address Ray would guess.
        cmd.append(f"--node-ip-address={pod_ip}")
    cmd = ray_node.command([*cmd, "--num-cpus=0", "--disable-usage-stats"])
    log = logging.getLogger(__name__)
    log.info("starting the job's Ray head: %s", " ".join(cmd))
    # Ray gives a node 30 s to register (fixed in Ray): on a node loaded by the whole gang
    # starting at once the head can miss it; try again rather than fail the gang.
    attempts = max(1, contract.ENV_RAY_START_ATTEMPTS.get_int())
    for attempt in range(1, attempts + 1):
        try:
            (start or subprocess.run)(cmd, check=True)
            break
        except subprocess.CalledProcessError as err:
            if attempt == attempts:
                raise
            log.warning(
                "the Ray head failed to start (exit %s; attempt %d of %d); trying again",
                err.returncode,
                attempt,
                attempts,
            )
            (start or subprocess.run)(["ray", "stop", "--force"], check=False)
    return "auto"


class StatusReporter:
    """Patches `status.progress` of the job through the Kubernetes API (in-cluster credentials of
    the per-job ServiceAccount). Outside a pod it is never created; a failed patch is logged, never fatal.

    Called after every step, it writes at most once per `min_interval` seconds (a step of a
    small job takes well under a second, and every write is an API-server write and a reconcile
    pass of the operator), except the last step's and an evaluating step's, which are always
    written. Each write has a (connect, read) timeout: a hung API connection costs the training
    loop at most that, never the run."""

    #: Seconds between two writes of `status.progress` (the last and evaluating steps excepted).
    MIN_INTERVAL_SECONDS = 10.0

    def __init__(
        self,
        api: Any,
        name: str,
        namespace: str,
        min_interval: float = MIN_INTERVAL_SECONDS,
        clock: Any = None,
        request_timeout: tuple[float, float] | None = None,
        wall_clock: Any = None,
    ):
        import datetime as dt
        import time

        from rlhf_trainer.fleet.cluster_membership import API_REQUEST_TIMEOUT

        self.api = api
        self.name = name
        self.namespace = namespace
        self.min_interval = min_interval
        self.clock = clock or time.monotonic
        #: The time each write is stamped with (`progress.updated`).
        self.wall_clock = wall_clock or (lambda: dt.datetime.now(dt.timezone.utc))
        self.request_timeout = request_timeout or API_REQUEST_TIMEOUT
        self._last_write: float | None = None

    @classmethod
    def from_environment(cls, name: str, namespace: str) -> StatusReporter | None:
        if not contract.ENV_KUBERNETES_SERVICE_HOST.is_set():
            return None
        try:
            from kubernetes import client, config
        except ImportError:
            logging.getLogger(__name__).warning(
                "kubernetes client not installed: status.progress is not reported"
            )
            return None
        config.load_incluster_config()
        return cls(client.CustomObjectsApi(), name, namespace)

    def progress(
        self, done: int, total: int, metrics: dict[str, float], checkpoint_step: int | None = None
    ) -> dict[str, Any]:
        """The `status.progress` object for `done` of `total` steps, stamped now (`updated`), with
        the step of the last checkpoint (none before any: the key is left out)."""
        import math

        from rlhf_api.status import rfc3339

        keep = (
            "reward/mean",
            "actor/kl",
            "timing/step",
            "perf/samples_per_second",
            "actor/policy_version",
            "eval/reward_mean",
        )
        c = contract
        progress: dict[str, Any] = {
            c.PROGRESS_STEP: done,
            c.PROGRESS_TOTAL_STEPS: total,
            c.PROGRESS_UPDATED: rfc3339(self.wall_clock()),
            c.PROGRESS_METRICS: {c.progress_metric_key(k): f"{metrics[k]:.6g}" for k in keep if k in metrics},
        }
        if checkpoint_step is not None:
            progress[c.PROGRESS_CHECKPOINT_STEP] = int(checkpoint_step)
        reward = metrics.get("reward/mean")
        # A number for the printer column; NaN (every sample's reward failed) cannot travel in JSON.
        if isinstance(reward, (int, float)) and math.isfinite(reward):
            progress[c.PROGRESS_REWARD] = float(reward)
        evaluated = metrics.get("eval/reward_mean")
        if isinstance(evaluated, (int, float)) and math.isfinite(evaluated):
            progress[c.PROGRESS_EVAL_REWARD] = float(evaluated)
            progress[c.PROGRESS_EVAL_STEP] = int(metrics.get("eval/step", done))
        return {"status": {c.STATUS_PROGRESS: progress}}

    def due(self, done: int, total: int, metrics: dict[str, float]) -> bool:
        """Whether this step's progress is written (see the class's docstring)."""
        if self._last_write is None or done >= total or "eval/reward_mean" in metrics:
            return True
        return self.clock() - self._last_write >= self.min_interval

    def __call__(
        self, done: int, total: int, metrics: dict[str, float], checkpoint_step: int | None = None
    ) -> None:
        c = contract
        if not self.due(done, total, metrics):
            return
        self._last_write = self.clock()  # a failed write waits its interval too (no hammering)
        try:
            self.api.patch_namespaced_custom_object_status(
                c.GROUP,
                c.VERSION,
                self.namespace,
                c.PLURAL,
                self.name,
                self.progress(done, total, metrics, checkpoint_step),
                _request_timeout=self.request_timeout,
            )
        except Exception as err:  # reporting must never stop training
            logging.getLogger(__name__).warning("could not patch status.progress of %s: %s", self.name, err)
