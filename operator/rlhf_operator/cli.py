"""`rlhf operator` and `rlhf crd`, plugged into the `rlhf` command by `rlhf_trainer.cli`.

Importing this module is cheap: kopf and the Kubernetes client are imported only when
`rlhf operator` runs.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from rlhf_api import contract


def _cmd_crd(args: argparse.Namespace) -> int:
    from rlhf_operator import chart_copies, crd

    if args.check is not None:
        files = [Path(f) for f in args.check] or list(crd.CRD_FILES)
        stale = crd.stale_files(files)
        if not args.check:  # everything generated: the chart's monitoring copies too
            stale += chart_copies.stale()
            files += [copy for _, copy in chart_copies.pairs()]
        for f in stale:
            print(f"{f}: stale; regenerate with `rlhf crd --write`", file=sys.stderr)
        if not stale:
            print(f"up to date: {', '.join(str(f) for f in files)}")
        return 1 if stale else 0
    if args.write:
        for f in [*crd.write_files(), *chart_copies.write()]:
            print(f"wrote {f}")
        return 0
    sys.stdout.write(crd.render_crd())
    return 0


def _cmd_operator(args: argparse.Namespace) -> int:
    import logging
    import os

    import kopf
    from prometheus_client import start_http_server

    import rlhf_operator.handlers  # noqa: F401  (registers the handlers with kopf)

    if args.all_namespaces and args.namespace:
        print("rlhf operator: give --namespace or --all-namespaces, not both", file=sys.stderr)
        return 2
    os.environ["RLHF_OPERATOR_CONTROLLER_METRICS_URL"] = args.controller_metrics_url
    from rlhf_operator import autoscaler, pod_identity, tenant_limits

    os.environ[tenant_limits.MAX_PODS_ENV] = str(args.max_pods_per_job)
    os.environ[tenant_limits.ALLOWED_HOST_PATHS_ENV] = args.allowed_host_paths
    try:
        tenant_limits.Limits.from_env(os.environ)
        pod_identity.setting(os.environ)
        autoscaler.custom_queries_allowed(os.environ)
    except ValueError as err:
        print(f"rlhf operator: {err}", file=sys.stderr)
        return 2
    kopf.configure(verbose=args.verbose, log_format=getattr(kopf.LogFormat, args.log_format.upper()))
    level = logging.DEBUG if args.verbose or args.debug_passes else logging.INFO
    logging.getLogger("rlhf_operator").setLevel(level)
    logging.getLogger("urllib3").setLevel(logging.WARNING)
    if args.metrics_port:
        start_http_server(args.metrics_port)
    kwargs: dict[str, Any] = {
        "clusterwide": args.all_namespaces or not args.namespace,
        "namespaces": args.namespace or (),
        "liveness_endpoint": args.liveness,
    }
    if args.peering:
        kwargs.update(peering_name=args.peering, standalone=False)
    else:
        kwargs.update(standalone=True)
    kopf.run(**kwargs)
    return 0


def add_subcommands(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("crd", help="print, write or check the RLTrainingJob CRD generated from the spec")
    g = p.add_mutually_exclusive_group()
    g.add_argument(
        "--write",
        action="store_true",
        help="write crds/ and the Helm chart's copy, and refresh the chart's copies of manifests/monitoring/",
    )
    g.add_argument(
        "--check",
        nargs="*",
        metavar="FILE",
        help="exit 1 when FILE (default: crds/ and the chart's copy) differs from the generated CRD",
    )
    p.set_defaults(func=_cmd_crd)

    p = sub.add_parser("operator", help="run the Kubernetes operator (kopf)")
    p.add_argument(
        "--namespace",
        "-n",
        action="append",
        default=[],
        metavar="NS",
        help="watch only this namespace (repeatable; glob patterns allowed)",
    )
    p.add_argument("--all-namespaces", "-A", action="store_true", help="watch every namespace (the default)")
    p.add_argument(
        "--peering",
        metavar="NAME",
        default=None,
        help="kopf peering object: replicas sharing it elect one active operator (needs the peering CRDs)",
    )
    p.add_argument(
        "--liveness",
        metavar="URL",
        default=None,
        help="serve liveness/readiness, e.g. http://0.0.0.0:8081/healthz",
    )
    p.add_argument(
        "--metrics-port", type=int, default=0, metavar="PORT", help="serve Prometheus /metrics (0: off)"
    )
    p.add_argument(
        "--controller-metrics-url",
        metavar="TEMPLATE",
        default=os.environ.get("RLHF_OPERATOR_CONTROLLER_METRICS_URL") or contract.CONTROLLER_METRICS_URL,
        help="where the autoscaler scrapes a job's controller when the job names no Prometheus; "
        "{job} and {namespace} are substituted (env RLHF_OPERATOR_CONTROLLER_METRICS_URL)",
    )
    p.add_argument(
        "--max-pods-per-job",
        metavar="N",
        default=os.environ.get("RLHF_OPERATOR_MAX_PODS_PER_JOB") or "1024",
        help="most pods one job may have; a larger job Fails (TooManyPods) before any pod is built "
        "(env RLHF_OPERATOR_MAX_PODS_PER_JOB; the CRD refuses more than 1024)",
    )
    p.add_argument(
        "--allowed-host-paths",
        metavar="PATHS",
        default=os.environ.get("RLHF_OPERATOR_ALLOWED_HOST_PATHS", ""),
        help="comma-separated node paths a job's hostPath volumes may name (each with what lies below "
        "it); empty (the default): no hostPath is allowed (env RLHF_OPERATOR_ALLOWED_HOST_PATHS)",
    )
    p.add_argument("--verbose", "-v", action="store_true", help="debug logging")
    p.add_argument(
        "--log-format",
        choices=["plain", "full", "json"],
        default=os.environ.get("RLHF_OPERATOR_LOG_FORMAT", "plain"),
        help="plain: messages only; full: with time, logger and level; json: one object a line "
        "(env RLHF_OPERATOR_LOG_FORMAT)",
    )
    p.add_argument(
        "--debug-passes",
        action="store_true",
        default=os.environ.get("RLHF_OPERATOR_DEBUG_PASSES", "") not in ("", "0"),
        help="log every reconcile pass: its duration, API calls and outcome, without kopf's own debug "
        "output (env RLHF_OPERATOR_DEBUG_PASSES=1)",
    )
    p.set_defaults(func=_cmd_operator)
