"""A role's ranks on two pods find each other at the pods' own IPs (the pod contract's RLHF_POD_IP),
which each rank inherits from its pod's raylet, not from the driver in the controller pod."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).with_name("two_pods.py")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_two_pod_role_forms_its_group_across_the_pods_ips() -> None:
    proc = subprocess.Popen(
        [sys.executable, str(SCRIPT)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # so that a hung run's Ray processes go with it
    )
    try:
        out, _ = proc.communicate(timeout=480)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"two_pods.py did not finish in 480 s:\n{out[-4000:]}")
    assert proc.returncode == 0, out[-4000:]
    ranks = json.loads(next(line for line in out.splitlines() if line.startswith("[")))
    by_rank = {r["rank"]: r for r in ranks}
    pods = {r["pod"] for r in ranks}
    # Each rank runs on its own pod, sees that pod's role and IP (not the controller pod's).
    assert pods == {"j-actor-0", "j-actor-1"}
    assert all(r["role"] == "actor" for r in ranks)
    ips = {r["pod"]: r["rendezvous_host"] for r in ranks}
    assert ips == {"j-actor-0": "127.0.0.2", "j-actor-1": "127.0.0.3"}
    # The group's store is rank 0's pod IP, and rank 1 on the other pod joined it: 1 + 2.
    assert by_rank[1]["store"] == by_rank[0]["store"]
    assert by_rank[0]["store"][0] == by_rank[0]["rendezvous_host"] != by_rank[1]["rendezvous_host"]
    assert all(r["all_reduce"] == 3.0 for r in ranks)
