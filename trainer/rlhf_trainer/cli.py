"""The `rlhf` command line.

Every subcommand imports its implementation lazily so that `rlhf --help`, `rlhf validate`
and `rlhf crd` work without torch, Ray or a cluster client installed.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

EPILOG = """\
examples:
  rlhf run manifests/examples/quickstart.yaml      run a job locally on CPU (Ray, torch)
  rlhf validate manifests/examples/grpo-h100.yaml  check a manifest against the spec
  rlhf crd > crds/rlhf.dev_rltrainingjobs.yaml     regenerate the CRD from the spec
  rlhf operator                                    run the Kubernetes operator
  rlhf report runs/quickstart                      rebuild a run's HTML report
  rlhf export runs/quickstart/checkpoints out/     a checkpoint's policy as a Hugging Face model
"""


def _cmd_validate(args: argparse.Namespace) -> int:
    from rlhf_api.algorithm_params import spelling_notes
    from rlhf_api.fields import SpecError
    from rlhf_api.job import dropped_role_notes
    from rlhf_api.loader import load_manifest, manifest_dir, manifest_name
    from rlhf_api.reference import reference_markdown
    from rlhf_api.storage import cluster_storage_findings
    from rlhf_trainer.user_code import check_imports, import_paths

    if args.reference:
        sys.stdout.write(reference_markdown())
        return 0
    if not args.manifests:
        print("rlhf validate: give at least one MANIFEST (or --reference)", file=sys.stderr)
        return 2
    if [*args.manifests, args.nodes, args.old].count("-") > 1:
        print(
            "rlhf validate: only one of MANIFEST, --nodes and --old can be - (standard input)",
            file=sys.stderr,
        )
        return 2
    status = 0
    for path in args.manifests:
        name = manifest_name(path)
        try:
            job = load_manifest(path, old=args.old)
        except SpecError as err:
            print(f"{name}: invalid\n{err}", file=sys.stderr)
            status = 1
            continue
        if args.cluster:
            found = cluster_storage_findings(job.spec, job.metadata_name)
            for line in found.warnings:
                print(f"{name}: warning: {line}", file=sys.stderr)
            if found.errors:
                lines = "\n".join(f"  - {e}" for e in found.errors)
                print(f"{name}: invalid on a cluster\n{lines}", file=sys.stderr)
                status = 1
                continue
        if not args.no_import and (bad := check_imports(import_paths(job.spec), args.import_timeout)):
            lines = "\n".join(f"  - {e}" for e in bad)
            print(f"{name}: its code cannot be imported\n{lines}", file=sys.stderr)
            status = 1
            continue
        if not _report_plan(name, manifest_dir(path), job.spec, args):
            status = 1
            continue
        print(f"{name}: valid ({job.metadata_name}, algorithm {job.spec.algorithm.name})")
        for line in dropped_role_notes(job.spec) + spelling_notes(job.spec.algorithm.params):
            print(f"{name}: note: {line}", file=sys.stderr)
    return status


def _report_plan(name: str, folder: Path, spec: object, args: argparse.Namespace) -> bool:
    """Print the resource planner's findings for one job; False when it cannot start. The models'
    relative paths resolve against `folder` (`rlhf_api.loader.manifest_dir`), as `rlhf run` reads them."""
    import json

    from rlhf_trainer.planner import plan_job, shapes_from

    nodes = None
    if args.nodes:
        text = sys.stdin.read() if args.nodes == "-" else Path(args.nodes).read_text()
        doc = json.loads(text)
        nodes = doc.get("items", []) if isinstance(doc, dict) else doc
    plan = plan_job(spec, nodes=nodes, shape_of=shapes_from(folder))
    for line in plan.notes if args.plan or args.cluster else []:  # what was not checked
        print(f"{name}: note: {line}", file=sys.stderr)
    for line in plan.warnings:
        print(f"{name}: warning: {line}", file=sys.stderr)
    if args.plan and plan.estimates:
        print(f"{name}: memory per GPU\n{plan.table()}")
    if plan.errors:
        lines = "\n".join(f"  - {e}" for e in plan.errors)
        print(f"{name}: does not fit its GPUs\n{lines}", file=sys.stderr)
    return not plan.errors


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rlhf",
        description="rlhf-operator: RL post-training of LLMs on Kubernetes, and locally on CPU with the same manifest.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    from rlhf_trainer import __version__

    parser.add_argument("--version", action="version", version=f"rlhf-operator {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser("validate", help="check RLTrainingJob manifests against the spec")
    p.add_argument(
        "manifests",
        nargs="*",
        metavar="MANIFEST",
        help="YAML files holding an RLTrainingJob (`-`: standard input, named <stdin>, e.g. `kubectl get rltj NAME "
        "-o yaml | rlhf validate -`). Relative paths in a manifest resolve against its folder, those of one read "
        "from standard input against the current directory (as `rlhf run` and the controller pod read them)",
    )
    p.add_argument(
        "--reference",
        action="store_true",
        help="print the Markdown reference of every manifest field and exit",
    )
    p.add_argument(
        "--old",
        metavar="MANIFEST",
        help="check each MANIFEST as an update of this one (the job as it exists): immutable fields may not "
        "change, appear or disappear, as the API server enforces",
    )
    p.add_argument(
        "--cluster",
        action="store_true",
        help="also check what a cluster needs: the run and checkpoint directories on volumes the pods "
        "writing them share (errors), the model and prompts where the pods reading them see them (warnings)",
    )
    p.add_argument(
        "--plan",
        action="store_true",
        help="print the resource planner's memory estimate per GPU of each role and what it could not check "
        "(it always refuses what cannot start; --cluster prints what it could not check too)",
    )
    p.add_argument(
        "--nodes",
        metavar="FILE",
        help="the cluster's nodes (`kubectl get nodes -o json`, - for stdin): the planner takes each pool's GPU "
        "from its nodes' labels nvidia.com/gpu.product and nvidia.com/gpu.memory",
    )
    from rlhf_trainer.user_code import IMPORT_TIMEOUT_S

    p.add_argument(
        "--no-import",
        action="store_true",
        help="do not import the user's code the manifest names (reward functions, a custom algorithm, a "
        "multi-turn environment, a pipeline): for a machine without it. By default each such import path is "
        "imported as the trainer imports it (from the current directory, then PYTHONPATH), in a subprocess; a "
        "missing module or attribute, an object of the wrong kind or an import that raises is an error naming "
        "the field (the project's own rlhf_trainer paths are checked without a subprocess)",
    )
    p.add_argument(
        "--import-timeout",
        type=float,
        default=IMPORT_TIMEOUT_S,
        metavar="SECONDS",
        help=f"how long the user's imports may take before the one running is reported as hanging "
        f"(default {IMPORT_TIMEOUT_S:g})",
    )
    p.set_defaults(func=_cmd_validate)

    _register_optional(sub)
    return parser


def _register_optional(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Subcommands whose argument definitions live beside their implementation."""
    import importlib

    from rlhf_trainer import worker_cli

    worker_cli.add_subcommands(sub)
    for module in ("rlhf_trainer.run_cli", "rlhf_trainer.export", "rlhf_operator.cli"):
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as err:
            if err.name != module:
                raise
            continue
        mod.add_subcommands(sub)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
