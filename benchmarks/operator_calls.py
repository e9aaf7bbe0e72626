"""API calls and pass time of the operator's reconcile, without a cluster: the real `Executor` and
`reconcile.plan` against the in-memory API of the executor's unit tests, each call given a fixed
latency. It compares the pass as it was (the spec parsed, with every CEL rule of the CRD, twice
per pass; a LIST per pass; pods created one by one) with the pass now (the parse remembered per
distinct job, `parse_cache.parse`; the watch-fed pod cache; parallel creation), with the CRD's rules
evaluated in Python (another release's CRD installed) and left to the API server (this
operator's CRD installed: `parse_cache.InstalledRules`). Every column skips rebuilding the static
children of an unchanged job (before, every pass rebuilt them), so the "before" column is, if
anything, cheaper than the old pass was. The CEL programs are compiled by the first column's
run, so the later columns do not pay that (about 0.3 s of CPU, once per operator process).

    .venv/bin/python benchmarks/operator_calls.py                # 10-pod jobs, 5 ms per call
    .venv/bin/python benchmarks/operator_calls.py --latency-ms 20

A job goes from creation to Running the way the pod watch shows it: every pod created, then
bound, then Running, one pass per watch event (the worst case; the operator's debounce merges
bursts). What it measures is the operator's own side (calls made, time spent in them), not the
API server, scheduler or kubelet: `benchmarks/operator_scale.py` measures that, on a cluster.
"""

from __future__ import annotations

import argparse
import collections
import logging
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "unit" / "operator"))

from operator_helpers import at, job  # noqa: E402
from test_operator_executor import WatchedKube  # noqa: E402

from rlhf_operator import crd, parse_cache  # noqa: E402
from rlhf_operator.cache import PodCache  # noqa: E402
from rlhf_operator.executor import Executor  # noqa: E402


class SlowKube(WatchedKube):
    """The in-memory API, each call counted and taking `latency` seconds (thread-safe enough:
    the parallel creates touch distinct keys)."""

    def __init__(self, body: dict[str, Any], latency: float) -> None:
        super().__init__(body)
        self.latency = latency
        self.calls: collections.Counter[str] = collections.Counter()

    def _slow(self, verb: str) -> None:
        self.calls[verb] += 1
        time.sleep(self.latency)

    def get_job(self, namespace: str, name: str) -> dict[str, Any] | None:
        self._slow("get job")
        return super().get_job(namespace, name)

    def list_pods(self, namespace: str, job: str) -> list[dict[str, Any]]:
        self._slow("list pods")
        return super().list_pods(namespace, job)

    def list_pods_versioned(self, namespace: str, job: str) -> tuple[list[dict[str, Any]], str]:
        self._slow("list pods")
        return super().list_pods(namespace, job), "1"

    def get(self, obj: dict[str, Any]) -> dict[str, Any] | None:
        self._slow("get child")
        return super().get(obj)

    def create(self, obj: dict[str, Any]) -> bool:
        self._slow("create " + ("pod" if obj["kind"] == "Pod" else "child"))
        return super().create(obj)

    def patch_status(self, body: dict[str, Any], status: dict[str, Any]) -> dict[str, Any]:
        self._slow("patch status")
        return super().patch_status(body, status)

    def event(self, body: dict[str, Any], type_: str, reason: str, message: str, now: str) -> None:
        self._slow("post event")
        super().event(body, type_, reason, message, now)


def lifecycle(
    latency: float, cached: bool, workers: int, trusted: bool = False
) -> tuple[collections.Counter[str], float, float, float]:
    """One job from creation to Running, `cached` False as before (no pod cache, every parse
    done anew), `trusted`: this operator's CRD is installed (the API server's admission trusted):
    (calls by verb, first pass seconds, all passes seconds, CPU seconds)."""
    parse_cache.clear()  # each column parses the job itself
    fake = SlowKube(job(), latency)
    pods = PodCache() if cached else None
    digest = crd.expected_schema_digest() if trusted else "another release's"
    rules = parse_cache.InstalledRules(lambda: {crd.SCHEMA_DIGEST_ANNOTATION: digest})
    ex = Executor(fake, pod_cache=pods, create_workers=workers, installed_rules=rules)  # type: ignore[arg-type]
    seen: dict[str, Any] = {}
    t = 0

    def one_pass() -> float:
        nonlocal t
        t += 1
        if not cached:
            parse_cache.clear()  # as before: the spec parsed on every pass
        start = time.perf_counter()
        ex.reconcile("ns", "j", now=at(t))
        return time.perf_counter() - start

    cpu = time.process_time()
    first = one_pass()
    total = first
    names = sorted(n for (k, n) in fake.objects if k == "Pod")
    for state in ("bound", "Running"):
        for name in names:  # one watch event, and one pass, per pod
            pod = fake.objects[("Pod", name)]
            pod.setdefault("spec", {})["nodeName"] = "node"
            pod["status"] = {"phase": "Pending" if state == "bound" else "Running"}
            if pods is not None:
                fake.deliver(pods, seen)
            total += one_pass()
    assert fake.job is not None and fake.job["status"]["phase"] == "Running", fake.job["status"]
    return fake.calls, first, total, time.process_time() - cpu


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--latency-ms", type=float, default=5.0, help="time of each API call")
    parser.add_argument(
        "--workers", type=int, default=8, help="parallel pod creates (RLHF_OPERATOR_CREATE_WORKERS)"
    )
    args = parser.parse_args()
    latency = args.latency_ms / 1000
    logging.getLogger("rlhf_operator").setLevel(logging.ERROR)  # the "rules here" column's warning
    runs = {
        "before": lifecycle(latency, cached=False, workers=1),
        "now, rules here": lifecycle(latency, cached=True, workers=args.workers),
        "now, rules trusted": lifecycle(latency, cached=True, workers=args.workers, trusted=True),
    }
    calls = {name: run[0] for name, run in runs.items()}
    verbs = sorted(set().union(*calls.values()))
    print(f"one 6-pod job, creation -> Running, one pass per pod event, {args.latency_ms:g} ms per API call")
    print(f"{'':<36}" + "".join(f"{name:>20}" for name in runs))
    for verb in verbs:
        print(f"{verb:<36}" + "".join(f"{c[verb]:>20}" for c in calls.values()))
    print(f"{'API calls':<36}" + "".join(f"{sum(c.values()):>20}" for c in calls.values()))
    for label, i in (
        ("first pass (creates every child), ms", 1),
        ("every pass together, ms", 2),
        ("operator CPU, every pass, ms", 3),
    ):
        base = runs["before"][i]
        print(f"{label:<36}" + "".join(f"{r[i] * 1000:>11.0f} ({r[i] / base:.2f})" for r in runs.values()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
