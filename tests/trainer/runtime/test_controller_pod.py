"""`rlhf controller` inside the controller pod the operator builds: the metrics port and Ray head
the pod spec promises (Service port, readiness probe, role pods' `ray start --address`)."""

from __future__ import annotations

import copy
import json

from rlhf_api.loader import parse_job
from rlhf_operator import children
from rlhf_trainer import ray_node
from rlhf_trainer.run_cli import prepare_controller_pod

JOB = {
    "apiVersion": "rlhf.dev/v1alpha1",
    "kind": "RLTrainingJob",
    "metadata": {"name": "j", "namespace": "ns"},
    "spec": {
        "model": {"path": "m"},
        "data": {"path": "d.jsonl"},
        "reward": {"functions": [{"path": "r:f"}]},
        "roles": {"placement": "disaggregated", "critic": {"replicas": 0}, "reference": {"replicas": 0}},
    },
}


def _pod_env(job, role):
    pod = children.build_pod(job, role, 0, attempt=0)
    return {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}, pod


def test_controller_pod_serves_metrics_on_the_port_its_pod_spec_names(monkeypatch):
    job = parse_job(copy.deepcopy(JOB))
    env, pod = _pod_env(job, "controller")
    for key in ("RLHF_ROLE", "RLHF_METRICS_PORT"):
        monkeypatch.setenv(key, env[key])
    monkeypatch.setenv("RLHF_POD_IP", "10.1.2.3")  # what the downward API (status.podIP) gives
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    started: list[list[str]] = []
    address = prepare_controller_pod(job, None, start=lambda cmd, check: started.append(cmd))
    ports = {p["name"]: p["containerPort"] for p in pod["spec"]["containers"][0]["ports"]}
    assert job.spec.output.metrics_port == ports["metrics"]
    # The head listens where the role pods' `rlhf worker --address=<controller>:<port>` points,
    # advertising the pod's IP.
    (cmd,) = started
    assert cmd[1:5] == ["-m", "rlhf_trainer.ray_node", "start", "--head"] and f"--port={ports['ray']}" in cmd
    # The node's agents on fixed pod-local ports, so its raylet waits for no port file.
    assert set(ray_node.agent_port_args()) <= set(cmd)
    assert "--node-ip-address=10.1.2.3" in cmd
    assert address == "auto"
    _, actor = _pod_env(job, "actor")
    assert (
        f"--address={children.controller_address(job)}:{ports['ray']}"
        in actor["spec"]["containers"][0]["command"]
    )


def test_outside_a_pod_nothing_changes(monkeypatch):
    job = parse_job(copy.deepcopy(JOB))
    monkeypatch.delenv("RLHF_ROLE", raising=False)
    assert prepare_controller_pod(job, "10.0.0.1:6379", start=lambda *a, **k: 1 / 0) == "10.0.0.1:6379"
    assert job.spec.output.metrics_port == 0


def test_ranks_ask_ray_for_their_role_pods_resource(monkeypatch):
    from rlhf_trainer.workers.group import placement_resources

    job = parse_job(copy.deepcopy(JOB))
    monkeypatch.setenv("RLHF_ROLE", "controller")
    for role in ("actor", "rollout"):
        _, pod = _pod_env(job, role)
        (advertised,) = [a for a in pod["spec"]["containers"][0]["command"] if a.startswith("--resources=")]
        assert placement_resources(role).items() <= json.loads(advertised.split("=", 1)[1]).items()
    monkeypatch.delenv("RLHF_ROLE")
    assert placement_resources("actor") == {}  # locally: plain CPU actors


def test_a_head_that_fails_to_start_is_tried_again(monkeypatch):
    """Ray allows a node 30 s to register; on a loaded node the head can miss that once."""
    import subprocess

    job = parse_job(copy.deepcopy(JOB))
    env, _ = _pod_env(job, "controller")
    monkeypatch.setenv("RLHF_ROLE", env["RLHF_ROLE"])
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    calls: list[list[str]] = []

    def start(cmd, check):
        calls.append(cmd)
        if "--head" in cmd and len(calls) == 1:
            raise subprocess.CalledProcessError(1, cmd)

    assert prepare_controller_pod(job, None, start=start) == "auto"
    head = ray_node.command(["--head"])[1:5]
    assert [c[1:5] if "--head" in c else c[:3] for c in calls] == [head, ["ray", "stop", "--force"], head]

    monkeypatch.setenv("RLHF_RAY_START_ATTEMPTS", "1")

    def always_fails(cmd, check):
        if check:
            raise subprocess.CalledProcessError(1, cmd)

    import pytest

    with pytest.raises(subprocess.CalledProcessError):
        prepare_controller_pod(parse_job(copy.deepcopy(JOB)), None, start=always_fails)
