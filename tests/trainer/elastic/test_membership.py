"""The membership sources of the rollout fleet, without Ray: the plan from slots held to slots
wanted, the local policy source, and the cluster source following a job's `status.rollout`
through a fake job reader (the real API server path is proven by the cluster tests)."""

from __future__ import annotations

from typing import Any

import pytest

from rlhf_api import contract
from rlhf_trainer.fleet.cluster_membership import (
    API_REQUEST_TIMEOUT,
    ClusterMembership,
    KubernetesJob,
    rollout_target,
)
from rlhf_trainer.fleet.membership import PolicyMembership, Target, matches, plan_change

from .fake_job import FakeJob

# -- the plan ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("members", "loading", "replicas", "leaving", "cancel", "launch"),
    [
        ({"r0": 0}, {}, 1, [], [], []),  # nothing to do
        ({"r0": 0}, {}, 3, [], [], [1, 2]),  # scale up: the empty slots
        ({"r0": 0, "r1": 1, "r2": 2}, {}, 1, ["r1", "r2"], [], []),  # scale down: slots >= 1 leave
        ({"r2": 1}, {}, 2, [], [], [0]),  # slot 0 lost: refilled, slot 1 kept
        ({"r0": 0}, {"r5": 1, "r6": 2}, 2, [], ["r6"], []),  # still loading for a slot now gone
        ({"r0": 0}, {"r5": 1}, 3, [], [], [2]),  # a loading replica holds its slot
        ({"r0": 0, "r1": 1}, {}, 0, ["r0", "r1"], [], []),  # (the fleet clamps 0 to 1 before)
    ],
)
def test_plan_change(members, loading, replicas, leaving, cancel, launch):
    change = plan_change(members, loading, replicas)
    assert (change.leaving, change.cancel, change.launch) == (leaving, cancel, launch)
    assert bool(change) == bool(leaving or cancel or launch)


def test_matches_needs_exactly_the_target_slots_and_nothing_loading():
    assert matches({"a": 0, "b": 1}, {}, Target(2, 5))
    assert not matches({"a": 0}, {}, Target(2, 5))  # slot 1 missing
    assert not matches({"a": 0}, {"b": 1}, Target(2, 5))  # slot 1 still loading
    assert not matches({"a": 0, "b": 2}, {}, Target(2, 5))  # a replica in a leaving slot
    assert not matches({"a": 0}, {}, Target(0, 5))  # zero replicas is never met (slot 0 stays)


# -- the cluster source ---------------------------------------------------------------------------


def test_rollout_target_follows_the_operators_record_not_the_spec():
    job = FakeJob(desired=2, generation=3)
    job.job["spec"]["roles"]["rollout"]["replicas"] = 4  # /scale written, not reconciled yet
    assert rollout_target(job.job) == Target(2, 3)
    # before the operator's first pass: the spec's count, nothing to report
    assert rollout_target({"spec": {"roles": {"rollout": {"replicas": 3}}}}) == Target(3, 0)
    assert rollout_target({"spec": {}, "status": None}) == Target(1, 0)


def test_cluster_membership_reports_each_generation_once_after_it_is_synced():
    job = FakeJob(desired=1, generation=1)
    source = ClusterMembership(job)
    assert source.initial() == Target(1, 1)
    assert source.target(0, {}) == Target(1, 1)
    source.synced(Target(1, 1), changed=False)
    source.synced(Target(1, 1), changed=False)  # the next step's sync: no second patch
    assert job.synced == [1]
    assert job.patches[0] == {"status": {contract.STATUS_ROLLOUT: {contract.ROLLOUT_SYNCED_GENERATION: 1}}}

    job.operator_writes(desired=3, generation=2)  # kubectl scale --replicas=3
    assert source.target(1, {}) == Target(3, 2)
    assert source.step_metrics() == {"rollout/job_generation": 2.0, "rollout/job_synced_generation": 1.0}
    source.synced(Target(3, 2), changed=True)
    assert job.synced == [1, 2]
    assert source.step_metrics()["rollout/job_synced_generation"] == 2.0


def test_cluster_membership_never_reports_generation_zero():
    job = FakeJob(spec_replicas=2)  # the operator has not recorded a generation yet
    source = ClusterMembership(job)
    assert source.target(0, {}) == Target(2, 0)
    source.synced(Target(2, 0), changed=True)
    assert job.patches == []


def test_a_failed_read_holds_the_fleet_and_a_failed_patch_is_retried(caplog):
    job = FakeJob(desired=2, generation=4)
    source = ClusterMembership(job, fallback_replicas=3)
    job.fail_reads = 1
    assert source.initial() == Target(3, 0)  # the mounted spec's count when the job cannot be read
    assert source.target(0, {}) == Target(2, 4)
    job.fail_reads = 1
    assert source.target(1, {}) == Target(2, 4)  # held: the last target read
    assert "could not read" in caplog.text

    job.fail_patches = 1
    source.synced(Target(2, 4), changed=True)
    assert job.synced == [] and source.reported == 0
    assert "could not write status.rollout.syncedGeneration=4" in caplog.text
    source.synced(Target(2, 4), changed=False)  # after the next sync
    assert job.synced == [4]


def test_cluster_placement_pins_each_slot_to_its_pod():
    source = ClusterMembership(FakeJob())
    assert source.placement(0) == {"rlhf.dev/rollout-0": 1.0}
    assert source.placement(7) == {contract.ray_rollout_slot_resource(7): 1.0}
    assert source.join_wait == 0.0  # training goes on while a new pod starts
    assert ClusterMembership(FakeJob(), pin_to_pods=False).placement(3) == {}


def test_cluster_membership_only_in_a_pod(monkeypatch):
    monkeypatch.delenv(contract.ENV_KUBERNETES_SERVICE_HOST.name, raising=False)
    assert ClusterMembership.from_environment("job", "ns") is None


def test_kubernetes_job_reads_and_patches_the_named_job():
    calls: list[tuple[str, tuple[Any, ...]]] = []
    timeouts: list[Any] = []

    class Api:
        def get_namespaced_custom_object(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
            calls.append(("get", args))
            timeouts.append(kwargs.get("_request_timeout"))
            return {"status": {"rollout": {"desired": 2, "generation": 5}}}

        def patch_namespaced_custom_object_status(self, *args: Any, **kwargs: Any) -> None:
            calls.append(("patch", args))
            timeouts.append(kwargs.get("_request_timeout"))

    source = ClusterMembership(KubernetesJob(Api(), "grpo", "team-a"))
    assert source.target(0, {}) == Target(2, 5)
    source.synced(Target(2, 5), changed=True)
    where = ("rlhf.dev", "v1alpha1", "team-a", "rltrainingjobs", "grpo")
    assert calls == [
        ("get", where),
        ("patch", (*where, {"status": {"rollout": {"syncedGeneration": 5}}})),
    ]
    assert timeouts == [API_REQUEST_TIMEOUT, API_REQUEST_TIMEOUT]  # no call can hang the step loop


# -- the local source -----------------------------------------------------------------------------


def test_policy_membership_without_autoscaling_keeps_the_spec_size():
    source = PolicyMembership(2)
    assert source.initial() == Target(2)
    assert source.target(0, {"rollout/wait_fraction": 0.99}) == Target(2)
    assert source.placement(1) == {} and source.join_wait is None
    assert PolicyMembership(0).initial() == Target(1)  # zero replicas cannot generate


def test_policy_membership_runs_the_policy_once_per_period_and_cools_down_after_a_reshard():
    from rlhf_api.autoscale import Autoscaler

    now = [0.0]
    autoscaler = Autoscaler(min_replicas=0, max_replicas=4, target=0.2, window=0.0, cooldown=30.0)
    source = PolicyMembership(1, autoscaler, period=10.0, clock=lambda: now[0])
    assert autoscaler.min_replicas == 1
    metrics: dict[str, float] = {"rollout/wait_fraction": 0.6}
    assert source.target(0, metrics) == Target(3)  # ceil(1 x 0.6 / 0.2)
    assert metrics["autoscale/desired_replicas"] == 3.0 and metrics["autoscale/signal"] == 0.6
    now[0] = 5.0
    assert source.target(1, {"rollout/wait_fraction": 0.01}) == Target(3)  # within the period
    source.synced(Target(3), changed=True)  # the reshard completed at t=5: cooldown until t=35
    now[0] = 20.0
    assert source.target(2, {"rollout/wait_fraction": 0.01}) == Target(3)
    now[0] = 40.0
    assert source.target(3, {"rollout/wait_fraction": 0.01}) == Target(1)
