"""`rlhf run`, `rlhf report` and `rlhf controller`: argument definitions and thin handlers.

Importing this module is cheap (argparse only): the controller, torch and Ray are imported
inside the handlers.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from typing import Any

#: Where the operator mounts the job's manifest in the controller pod.
DEFAULT_SPEC_FILE = "/etc/rlhf/job.yaml"


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
        default=os.environ.get("RLHF_SPEC_FILE", DEFAULT_SPEC_FILE),
        help=f"the mounted RLTrainingJob manifest (default $RLHF_SPEC_FILE or {DEFAULT_SPEC_FILE})",
    )
    p.add_argument("--run-dir", help="override spec.output.dir")
    p.add_argument("--ray-address", default=os.environ.get("RAY_ADDRESS"), help="the job's Ray head")
    p.set_defaults(func=cmd_controller)


def _logging(verbose: bool) -> None:
    logging.basicConfig(
        level=logging.INFO if verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s"
    )


def _load(path: str) -> Any:
    from rlhf_trainer.spec import SpecError, load_manifest

    try:
        return load_manifest(path)
    except SpecError as err:
        print(f"{path}: invalid\n{err}", file=sys.stderr)
        return None


def cmd_run(args: argparse.Namespace) -> int:
    _logging(args.verbose)
    job = _load(args.manifest)
    if job is None:
        return 2
    return _run(
        job,
        Path(args.manifest).resolve().parent,
        args.steps,
        args.run_dir,
        not args.no_resume,
        args.ray_address,
    )


def _run(
    job: Any,
    manifest_dir: Path,
    steps: int | None,
    run_dir: str | None,
    resume: bool,
    ray_address: str | None,
    on_status: Any = None,
) -> int:
    from rlhf_trainer import controller

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
        )
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
    job = _load(args.spec_file)
    if job is None:
        return 2
    reporter = StatusReporter.from_environment(job.metadata_name, job.namespace)
    ray_address = prepare_controller_pod(job, args.ray_address)
    return _run(job, Path(args.spec_file).parent, None, args.run_dir, True, ray_address, reporter)


def prepare_controller_pod(job: Any, ray_address: str | None, start: Any = None) -> str | None:
    """Inside the job's controller pod (the operator sets RLHF_ROLE=controller): serve /metrics on
    the port the operator's Service and readiness probe use (RLHF_METRICS_PORT), and start the Ray
    head the role pods join (`ray start --address=<controller>:6379`). Returns the address to join.
    Outside a pod it changes nothing."""
    import subprocess

    from rlhf_operator.children import RAY_PORT

    if os.environ.get("RLHF_ROLE") != "controller":
        return ray_address
    if os.environ.get("RLHF_METRICS_PORT"):
        job.spec.output.metrics_port = int(os.environ["RLHF_METRICS_PORT"])
    if ray_address:
        return ray_address
    cmd = ["ray", "start", "--head", f"--port={RAY_PORT}", "--num-cpus=0", "--disable-usage-stats"]
    logging.getLogger(__name__).info("starting the job's Ray head: %s", " ".join(cmd))
    (start or subprocess.run)(cmd, check=True)
    return "auto"


class StatusReporter:
    """Patches `status.progress` of the job through the Kubernetes API (in-cluster credentials of
    the per-job ServiceAccount). Outside a pod it is never created; a failed patch is logged, never fatal."""

    def __init__(self, api: Any, name: str, namespace: str):
        self.api = api
        self.name = name
        self.namespace = namespace

    @classmethod
    def from_environment(cls, name: str, namespace: str) -> StatusReporter | None:
        if not os.environ.get("KUBERNETES_SERVICE_HOST"):
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

    def progress(self, done: int, total: int, metrics: dict[str, float]) -> dict[str, Any]:
        """The `status.progress` object for `done` of `total` steps."""
        import math

        keep = ("reward/mean", "actor/kl", "timing/step", "perf/samples_per_second", "actor/policy_version")
        progress: dict[str, Any] = {
            "step": done,
            "totalSteps": total,
            "metrics": {k.replace("/", "_"): f"{metrics[k]:.6g}" for k in keep if k in metrics},
        }
        reward = metrics.get("reward/mean")
        # A number for the printer column; NaN (every sample's reward failed) cannot travel in JSON.
        if isinstance(reward, (int, float)) and math.isfinite(reward):
            progress["reward"] = float(reward)
        return {"status": {"progress": progress}}

    def __call__(self, done: int, total: int, metrics: dict[str, float]) -> None:
        from rlhf_operator.labels import GROUP, PLURAL, VERSION

        try:
            self.api.patch_namespaced_custom_object_status(
                GROUP, VERSION, self.namespace, PLURAL, self.name, self.progress(done, total, metrics)
            )
        except Exception as err:  # reporting must never stop training
            logging.getLogger(__name__).warning("could not patch status.progress of %s: %s", self.name, err)
