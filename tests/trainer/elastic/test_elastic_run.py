"""`rlhf run` with an elastic rollout fleet on CPU: the autoscaling policy grows and shrinks the
fleet mid-run, every sync leaves each replica with the actor's exact weights, every prompt is
consumed exactly once, and a replica killed during a sync is dropped and replaced."""

from __future__ import annotations

import os
import signal

import pytest

from .conftest import exactly_once, make_job, read_metrics


class StepClock:
    """The policy's clock: 20 s per step (advanced after each step's sync)."""

    def __init__(self) -> None:
        self.t = 20.0

    def __call__(self) -> float:
        return self.t


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_policy_scales_rollout_fleet_1_3_2(tiny_model, ray_session, tmp_path):
    """Load (the rollout wait fraction, scripted per step) goes high, then back to target, then
    low: the policy (target 0.3, window 30 s, cooldown 15 s) scales 1 -> 3, holds 3 one more
    period (stabilization), then scales to 2."""
    from rlhf_trainer.controller import run
    from rlhf_trainer.fleet.elastic import ElasticOptions
    from rlhf_trainer.sync.push import SyncRecord

    clock = StepClock()
    load = {0: 0.9, 1: 0.3, 2: 0.2, 3: 0.2}

    def wait_fraction(step: int, metrics: dict[str, float]) -> float:
        return load.get(step, 0.3)

    syncs: list[SyncRecord] = []

    scraped: dict[str, float | None] = {}

    def synced(record: SyncRecord) -> None:
        syncs.append(record)
        clock.t = 20.0 * (record.step + 2)  # the next boundary is 20 s later
        if record.step == 4:  # the controller's /metrics, as Prometheus would see it
            from urllib.request import urlopen

            from rlhf_api.autoscale import parse_exposition

            port = (tmp_path / "metrics_port").read_text().strip()
            text = urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
            for series in (
                "rlhf_autoscale_decisions_total",
                "rlhf_rollout_replicas",
                "rlhf_rollout_max_replicas",
            ):
                scraped[series] = parse_exposition(text, series, "sum")

    job = make_job(
        "elastic-scale",
        roles={
            "placement": "disaggregated",
            "actor": {"replicas": 2},
            "rollout": {"replicas": 1, "minReplicas": 1, "maxReplicas": 3},
        },
        autoscaling={
            "enabled": True,
            "target": 0.3,
            "tolerance": 0.1,
            "periodSeconds": 15,
            "stabilizationWindowSeconds": 30,
            "cooldownSeconds": 15,
        },
    )
    options = ElasticOptions(clock=clock, signal=wait_fraction, verify_weights=True, on_sync=synced)
    run(job, run_dir=tmp_path, elastic=options)
    rows = read_metrics(tmp_path)
    print("replicas", [r["rollout/replicas"] for r in rows])
    print("sync wall seconds", [round(s.wall_seconds, 3) for s in syncs])
    print("queue", {k: v for k, v in rows[-1].items() if k.startswith("queue/")})

    # The policy's decisions, and the fleet after each step boundary.
    assert [r["autoscale/desired_replicas"] for r in rows] == [3, 3, 3, 2, 2]
    assert [r["rollout/replicas"] for r in rows] == [3, 3, 3, 2, 2]
    assert [r["rollout/generation"] for r in rows] == [2, 2, 2, 3, 3]
    assert all(r["rollout/synced_generation"] == r["rollout/generation"] for r in rows)
    # Training continued on every step, and every sync gave each replica the actor's weights.
    assert [r["actor/policy_version"] for r in rows] == [1, 2, 3, 4, 5]
    assert [len(s.members) for s in syncs] == [3, 3, 3, 2, 2]
    for s in syncs:
        assert s.actor_digest and s.dropped == []
        assert s.replica_digests == {m: s.actor_digest for m in s.members}, s
    assert syncs[3].members == ["rollout-0", "rollout-1"]  # the newest replica left
    # 5 evaluations counted; the gauges as of the last logged step (3)
    assert scraped == {
        "rlhf_autoscale_decisions_total": 5,
        "rlhf_rollout_replicas": 2,
        "rlhf_rollout_max_replicas": 3,
    }
    exactly_once(rows, prompts=30)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_replica_killed_during_sync_is_replaced(tiny_model, ray_session, tmp_path):
    """SIGKILL to a replica's process while the weights are being pushed (step 1): the push
    completes for the survivor, the step completes, the next boundary starts a replacement that
    gets the current weights. Then SIGKILL to a replica while it generates (step 3, slowed down by
    the delay knob): its leased prompts are requeued to the other replica, which generates them.
    The prompt counts stay exact throughout."""
    import threading

    from rlhf_trainer.controller import run
    from rlhf_trainer.fleet.elastic import ElasticOptions
    from rlhf_trainer.sync.push import SyncRecord, SyncStart

    killed: dict[str, int] = {}
    pids: dict[str, int] = {}

    def kill(name: str) -> None:
        os.kill(pids[name], signal.SIGKILL)
        killed[name] = pids[name]

    def kill_during_sync(start: SyncStart) -> None:
        pids.update(start.pids)
        if start.step == 1:
            kill(start.members[-1])

    def slow_step_3(step: int) -> float:
        if step != 3:
            return 0.0
        threading.Timer(0.5, kill, args=("rollout-0",)).start()
        return 1.0  # seconds per prompt: each replica's 3 prompts take 3 s

    syncs: list[SyncRecord] = []
    job = make_job(
        "elastic-kill",
        training={"steps": 4},
        roles={
            "placement": "disaggregated",
            "actor": {"replicas": 2},  # FSDP2: a failed stream makes both ranks gather again
            "rollout": {"replicas": 2, "maxReplicas": 2},
        },
    )
    options = ElasticOptions(
        verify_weights=True,
        sync_timeout=3.0,
        on_sync_start=kill_during_sync,
        on_sync=syncs.append,
        generation_delay=slow_step_3,
    )
    run(job, run_dir=tmp_path, elastic=options)
    rows = read_metrics(tmp_path)
    print("replicas", [r["rollout/replicas"] for r in rows])
    print(
        "sync wall seconds",
        [round(s.wall_seconds, 2) for s in syncs],
        "attempts",
        [s.attempts for s in syncs],
    )
    print("queue", {k: v for k, v in rows[-1].items() if k.startswith("queue/")})

    assert list(killed) == ["rollout-1", "rollout-0"]
    assert [s.members for s in syncs] == [
        ["rollout-0", "rollout-1"],
        ["rollout-0"],
        ["rollout-0", "rollout-2"],
        ["rollout-2", "rollout-3"],
    ]
    assert syncs[1].dropped == ["rollout-1"] and syncs[1].attempts == 2
    for s in syncs:
        assert s.replica_digests == {m: s.actor_digest for m in s.members}, s
    assert [r["rollout/replicas"] for r in rows] == [2, 1, 2, 2]
    assert [r["actor/policy_version"] for r in rows] == [1, 2, 3, 4]
    assert rows[1]["sync/dropped"] == 1
    assert rows[-1]["queue/requeued"] == 3  # rollout-0's share of step 3
    exactly_once(rows, prompts=24)
