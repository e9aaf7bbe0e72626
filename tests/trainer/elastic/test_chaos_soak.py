"""The chaos soak's short form (`benchmarks/chaos.py --resizes 10 --kills 1`): ten scripted rollout
resizes and one SIGKILL of a generating replica over a disaggregated `rlhf run` of the tiny
model. Every step's prompts are consumed exactly once, every sync's weight digests match the
actor's on every replica, and the run finishes all its steps."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from .conftest import exactly_once, make_job

BENCH = Path(__file__).resolve().parents[3] / "benchmarks"


def _chaos() -> Any:
    sys.path.insert(0, str(BENCH))
    try:
        import chaos
    finally:
        sys.path.remove(str(BENCH))
    return chaos


def test_the_soak_plan_resizes_at_each_boundary_and_kills_only_with_a_survivor():
    chaos = _chaos()
    for seed in range(20):
        plan = chaos.make_plan(resizes=10, kills=3, steps=14, max_replicas=3, seed=seed)
        assert sum(plan.sizes[s] != plan.serving(s) for s in range(14)) == 10
        assert all(1 <= n <= 3 for n in plan.sizes)
        assert len(plan.kills) == 3 and all(plan.serving(k) >= 2 for k in plan.kills)
    with pytest.raises(ValueError, match="steps .* must exceed resizes"):
        chaos.make_plan(resizes=10, kills=1, steps=10, max_replicas=3, seed=0)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_chaos_soak_short_form(tiny_model, ray_session, tmp_path):
    chaos = _chaos()
    steps = 11
    plan = chaos.make_plan(resizes=10, kills=1, steps=steps, max_replicas=3, seed=0)
    job = make_job(
        "chaos-soak",
        training={"steps": steps},
        roles={
            "placement": "disaggregated",
            "rollout": {"replicas": plan.initial, "maxReplicas": 3},
        },
    )
    soak = chaos.run_soak(job, plan, tmp_path, seed=0)
    fig = chaos.figures(soak, job)
    print(chaos.report(fig))

    # The run finished, and the fleet held the scripted size after every boundary.
    assert fig["steps_done"] == steps
    assert fig["fleet_sizes"] == plan.sizes
    assert fig["resizes_done"] == fig["resizes_expected"] == 10
    # The kill landed mid-rollout: the victim's leases were requeued to the survivors, and it
    # never synced again (its slot was refilled by a new replica).
    assert fig["kills_done"] == 1 and len(soak.killed) == 1
    assert fig["prompts_requeued"] >= 1
    # Every prompt of every step was consumed exactly once.
    assert fig["prompts_consumed"] == fig["prompts_acked"] == fig["prompts_expected"] == steps * 6
    assert fig["exact_steps"] == steps
    exactly_once(soak.rows, prompts=steps * 6)
    # Every sync hashed the weights on the actor and on each replica, and they matched.
    assert fig["syncs"] == fig["sync_checks_passed"] == steps
    assert fig["replica_digests_checked"] == sum(plan.sizes)
    for s in soak.syncs:
        assert s.actor_digest and s.replica_digests == {m: s.actor_digest for m in s.members}, s
    assert [r["actor/policy_version"] for r in soak.rows] == list(range(1, steps + 1))
