"""Real faults on the real node: one disaggregated GRPO job survives them in turn and succeeds.

The operator runs from the chart (its status-writers policy on) and the job's pods on the real
node, as in test_realnode_job.py (its fixtures, a job of its own here). In order:

1. **SIGKILL of an actor container** (its init process killed on the node, not a graceful delete):
   the pod fails with exit code 137, one counted gang restart, the new gang resumes from the
   newest complete checkpoint;
2. **SIGTERM** (every pod of the gang deleted gracefully, as a drain or a preemption does) at a
   step between two periodic checkpoints: the controller finishes the step in progress and
   checkpoints it within the grace period (`rlhf_trainer.preemption`), and the next attempt
   resumes at that very step: no step is lost;
3. **the node stops answering** (its kubelet SIGSTOPped and the job's pods frozen, as a hung
   machine): the node turns NotReady, the taint manager evicts the pods, they stay Terminating (no
   kubelet confirms), and the operator force-deletes them past its grace (`stuck_pods`), so the
   next attempt's pods are created while the node is still down; then the node comes back (the
   frozen containers killed, the kubelet resumed) and the job goes on from its checkpoint.

The job ends Succeeded with restarts 3, at its last step.
"""

# The fixtures of test_realnode_job.py are imported: tests name them as parameters (F811).
# ruff: noqa: F811

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from harness import Cluster, assets_dir, wait_for
from realnode import NODE_NAME
from test_operator_e2e import installed  # noqa: F401  (a fixture)
from test_realnode_job import (  # noqa: F401  (fixtures)
    Job,
    chart_operator,
    job_manifest,
    read_metrics,
    rn_namespace,
    workspace,
)

pytestmark = [pytest.mark.cluster, pytest.mark.realnode, pytest.mark.timeout(1500)]

JOB = "rn-faults"
STEPS = 150
CHECKPOINT_EVERY = 10


# --------------------------------------------------------------------------------------------------
# The node, from the host: containers, pod cgroups, the kubelet


class Node:
    """What a test does to the real node behind the kubelet's back."""

    def __init__(self, real_node: Any) -> None:
        self.node = real_node

    def crictl(self, *args: str) -> str:
        cmd = [str(assets_dir() / "crictl"), f"--runtime-endpoint=unix://{self.node.socket}", *args]
        return subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=60).stdout

    def container_pid(self, pod_uid: str, container: str = "trainer") -> int:
        """The host PID of the container's init process."""
        ids = self.crictl("ps", "-q", "--label", f"io.kubernetes.pod.uid={pod_uid}", "--name", container)
        (cid,) = ids.split()
        return int(json.loads(self.crictl("inspect", cid))["info"]["pid"])

    @staticmethod
    def pod_freezers(pod_uid: str) -> list[Path]:
        """The pod's cgroup in the v1 freezer hierarchy (cgroupfs driver: kubepods/<qos>/pod<uid>)."""
        base = Path("/sys/fs/cgroup/freezer/kubepods")
        return [p for p in base.glob(f"**/pod{pod_uid}") if (p / "freezer.state").exists()]

    def freeze(self, pod_uid: str) -> None:
        for cg in self.pod_freezers(pod_uid):
            (cg / "freezer.state").write_text("FROZEN")

    def kill_and_thaw(self, pod_uid: str) -> None:
        """SIGKILL every process of a frozen pod (a machine that rebooted), then thaw it."""
        for cg in self.pod_freezers(pod_uid):
            for procs in cg.glob("**/cgroup.procs"):
                for pid in procs.read_text().split():
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(int(pid), signal.SIGKILL)
            (cg / "freezer.state").write_text("THAWED")

    def kubelet(self, sig: signal.Signals) -> None:
        os.kill(int((self.node.workdir / "kubelet.pid").read_text()), sig)


@pytest.fixture(scope="module")
def node(real_node: Any) -> Iterator[Node]:
    n = Node(real_node)
    yield n
    n.kubelet(signal.SIGCONT)  # never leave the session's node stopped


@pytest.fixture(scope="module")
def job(
    cluster: Cluster, chart_operator: str, images: dict[str, str], rn_namespace: str, workspace: Path
) -> Job:
    doc = job_manifest(JOB, images["trainer-cpu"], workspace)
    doc["spec"]["training"]["steps"] = STEPS
    doc["spec"]["checkpoint"] = {"every": CHECKPOINT_EVERY, "keep": 3}
    doc["spec"]["failurePolicy"] = {"maxRestarts": 4, "backoffSeconds": 1}
    cluster.kubectl("apply", "-n", rn_namespace, "-f", "-", input=yaml.safe_dump(doc))
    return Job(cluster, rn_namespace, JOB)


def complete_steps(workspace: Path) -> list[int]:
    return sorted(
        int(p.parent.name.split("-")[1]) for p in (workspace / "run" / "checkpoints").glob("step-*/COMPLETE")
    )


def steps_done(workspace: Path) -> int:
    """Steps done, from the run's metrics log on the volume: the pace the faults are timed by.
    `status.progress.step` lags it by up to the status writer's 10 s throttle, which on a quiet
    machine is dozens of steps (and comparing the two sources raced: issue 24's CI failure)."""
    return len(read_metrics(workspace))


def restarts(job: Job) -> int:
    return int(job.status().get("restarts") or 0)


def resumed_step(job: Job, timeout: float = 360) -> int:
    """The step the running controller resumed at (its log's `resuming from ... (step N)`)."""
    job.wait(lambda: "resuming from" in job.controller_log(), "the new controller resuming", timeout=timeout)
    m = re.search(r"resuming from (\S+) \(step (\d+)\)", job.controller_log())
    assert m, job.controller_log()[-2000:]
    assert Path(m.group(1)).name == f"step-{int(m.group(2)):06d}"
    return int(m.group(2))


def attempt_pods(job: Job, attempt: int) -> dict[str, dict[str, Any]]:
    return {
        n: p
        for n, p in job.pods().items()
        if p["metadata"]["labels"].get("rlhf.dev/restart-attempt") == str(attempt)
    }


# --------------------------------------------------------------------------------------------------
# The faults, in order


def test_sigkill_of_an_actor_container_restarts_the_gang_from_the_checkpoint(
    job: Job, node: Node, workspace: Path
) -> None:
    t0 = time.monotonic()
    job.wait(
        lambda: steps_done(workspace) >= CHECKPOINT_EVERY + 2,
        f"past the checkpoint of step {CHECKPOINT_EVERY}",
        timeout=480,
    )
    job.wait(lambda: complete_steps(workspace), "a complete checkpoint on the volume")
    actor = job.pods()[f"{JOB}-actor-1"]
    pid = node.container_pid(actor["metadata"]["uid"])
    os.kill(pid, signal.SIGKILL)
    newest_at_kill = complete_steps(workspace)[-1]

    def exit_code() -> int | None:
        """The killed container's exit code, as the kubelet reports it (None: not yet, or gone)."""
        try:
            got = job.cluster.request("GET", f"/api/v1/namespaces/{job.ns}/pods/{JOB}-actor-1")
        except Exception:
            return None
        if got["metadata"]["uid"] != actor["metadata"]["uid"]:
            return None
        for cs in got["status"].get("containerStatuses") or []:
            if (term := (cs.get("state") or {}).get("terminated")) is not None:
                return int(term["exitCode"])
        return None

    seen = wait_for(exit_code, timeout=60, interval=0.2, what="the killed container reported")
    assert seen == 128 + signal.SIGKILL
    job.wait(lambda: restarts(job) == 1, "one gang restart", timeout=120)
    resumed = resumed_step(job)
    assert resumed >= newest_at_kill
    job.wait(lambda: steps_done(workspace) > resumed, "steps after the resume")
    print(
        f"SIGKILL -> resumed at step {resumed} (newest checkpoint at the kill: {newest_at_kill}); {time.monotonic() - t0:.0f} s"
    )


def test_sigterm_checkpoints_the_step_in_progress_and_loses_none(job: Job, workspace: Path) -> None:
    t0 = time.monotonic()

    # Between two periodic checkpoints, so that only a checkpoint on SIGTERM can keep these steps.
    def between() -> bool:
        done = steps_done(workspace)
        return 3 <= done % CHECKPOINT_EVERY <= 6 and done > complete_steps(workspace)[-1]

    job.wait(between, "a step between two periodic checkpoints", timeout=240)
    before = job.pods()
    job.kubectl("delete", "pods", "-l", f"rlhf.dev/job-name={JOB}", "--wait=false")
    done_at_sigterm = steps_done(workspace)
    job.wait(lambda: restarts(job) == 2, "the second gang restart", timeout=120)
    # Every old pod gone within its 30 s grace: the checkpoint was written before the SIGKILL.
    old_uids = {p["metadata"]["uid"] for p in before.values()}
    job.wait(
        lambda: not old_uids & {p["metadata"]["uid"] for p in job.pods().values()},
        "the old pods gone",
        timeout=90,
    )
    saved = complete_steps(workspace)[-1]
    assert saved >= done_at_sigterm and saved % CHECKPOINT_EVERY != 0, (saved, done_at_sigterm)
    resumed = resumed_step(job)
    assert resumed == saved
    job.wait(lambda: steps_done(workspace) > resumed, "steps after the resume")
    print(
        f"SIGTERM at step {done_at_sigterm}: checkpoint step {saved}, resumed there; {time.monotonic() - t0:.0f} s"
    )


def test_a_node_that_stops_answering_does_not_block_the_gang_restart(
    job: Job, node: Node, cluster: Cluster, workspace: Path
) -> None:
    t0 = time.monotonic()
    job.wait(
        lambda: steps_done(workspace) >= (complete_steps(workspace) or [0])[-1] + 2,
        "training after the last resume",
    )
    old = attempt_pods(job, 2)
    assert len(old) == 6, sorted(old)
    node.kubelet(signal.SIGSTOP)
    try:
        for p in old.values():
            node.freeze(p["metadata"]["uid"])

        def not_ready() -> bool:
            n = cluster.request("GET", f"/api/v1/nodes/{NODE_NAME}")
            return any(c["type"] == "Ready" and c["status"] != "True" for c in n["status"]["conditions"])

        wait_for(not_ready, timeout=120, interval=1, what=f"node {NODE_NAME} NotReady")
        t_not_ready = time.monotonic() - t0
        # Evicted after the pods' 60 s toleration, force-deleted 30 s past their deadline, the next
        # attempt's pods created: all while the node is still down.
        job.wait(lambda: restarts(job) == 3, "the third gang restart", timeout=180)
        job.wait(
            lambda: len(attempt_pods(job, 3)) == 6 and not attempt_pods(job, 2),
            "attempt 3's pods created, attempt 2's gone",
            timeout=180,
        )
        events = job.kubectl("get", "events", "--field-selector", "reason=PodForceDeleted", "-o", "json")
        messages = [e["message"] for e in json.loads(events)["items"]]
        assert messages and all(NODE_NAME in m for m in messages), messages
        t_recreated = time.monotonic() - t0
    finally:
        for p in old.values():
            node.kill_and_thaw(p["metadata"]["uid"])
        node.kubelet(signal.SIGCONT)
    newest = complete_steps(workspace)[-1]
    resumed = resumed_step(job, timeout=480)
    assert resumed >= newest
    print(
        f"node down: NotReady after {t_not_ready:.0f} s, the next gang's pods created after "
        f"{t_recreated:.0f} s (node still down), resumed at step {resumed}; {time.monotonic() - t0:.0f} s"
    )


def test_the_job_succeeds_with_three_restarts(job: Job) -> None:
    job.wait(lambda: job.status().get("phase") == "Succeeded", "Succeeded", timeout=600)
    status = job.status()
    assert status["restarts"] == 3
    assert status["progress"]["step"] == STEPS
