"""The controller pod's fleet following the operator, on real Ray with stand-in workers (no
models, no gloo): a fake job's `status.rollout` moves 1 -> 3 -> 1 replicas and a pod is
replaced; the fleet starts replicas for new slots without holding training up, adopts them once
loaded, drains and stops leaving ones, pushes the current weights to every member, and writes
`syncedGeneration` only then. Every prompt is generated exactly once throughout."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch

from rlhf_trainer.fleet.cluster_membership import ClusterMembership
from rlhf_trainer.fleet.elastic import ElasticOptions, RolloutFleet

from .fake_job import FakeJob

pytestmark = pytest.mark.timeout(180)


class Prompt:
    def __init__(self, token: int):
        self.ids = [token]


def stand_ins(setup_seconds: float) -> tuple[type, type]:
    """Ray actor classes with the methods the fleet calls on `ActorWorker` rank 0 and on
    `RolloutWorker`. Defined in a function so Ray ships them by value to its workers."""

    class Source:
        def __init__(self) -> None:
            self.generations: list[tuple[list[str], int]] = []

        def start_sync(self, timeout: float, backend: str = "gloo") -> tuple[str, int]:
            return ("127.0.0.1", 0)

        def sync_rebuild(self, members: list[str], generation: int) -> bool:
            self.generations.append((members, generation))
            return True

        def sync_push(self, version: int, verify: bool) -> dict[str, Any]:
            return {"dropped": [], "epoch": 0, "attempts": 1, "seconds": 0.0, "bytes": 0}

        def rebuilt(self) -> list[tuple[list[str], int]]:
            return self.generations

    class Replica:
        def __init__(self, slot: int) -> None:
            self.slot = slot
            self.version = 0
            self.name = ""

        def setup(self) -> None:
            time.sleep(setup_seconds)  # a pod pulling its image and loading the model

        def pid(self) -> int:
            import os

            return os.getpid()

        def join_sync(self, store: tuple[str, int], me: str, timeout: float, backend: str = "gloo") -> None:
            self.name = me

        def sync_rebuild(self, members: list[str], generation: int) -> bool:
            return self.name in members

        def sync_receive(self, verify: bool) -> dict[str, Any]:
            self.version += 1
            return {"version": self.version}

        def weights(self) -> int:
            return self.version

        def generate(
            self,
            prompt_ids: list[list[int]],
            n: int,
            step: int,
            delay: float,
            greedy: bool = False,
            temperature: float | None = None,
        ) -> dict[str, Any]:
            time.sleep(delay * len(prompt_ids))
            rows = [p[0] for p in prompt_ids for _ in range(n)]
            b = len(rows)
            return {
                "prompt_ids": torch.tensor(rows).unsqueeze(1),
                "prompt_mask": torch.ones(b, 1, dtype=torch.long),
                "response_ids": torch.tensor(rows).unsqueeze(1),
                "response_mask": torch.ones(b, 1),
                "log_probs": torch.zeros(b, 1),
                "prompt_index": [i for i in range(len(prompt_ids)) for _ in range(n)],
                "pad_token_id": 0,
                "finished": None,
                "policy_version": torch.full((b,), self.version),
            }

    return Source, Replica


class Launcher:
    """The `ReplicaLauncher` a rollout `WorkerGroup` is, over the stand-in class; logs what it
    does in `events` (shared with the fake job, so the order of stops and patches shows)."""

    def __init__(self, replica_cls: Any, events: list[tuple[str, Any]]):
        import ray

        self.remote = ray.remote(num_cpus=0)(replica_cls)
        self.workers: list[Any] = []
        self.slots: dict[Any, int] = {}
        self.events = events

    def launch(self, rank: int) -> tuple[Any, Any]:
        worker = self.remote.remote(rank)
        self.slots[worker] = rank
        self.events.append(("launch", rank))
        return worker, worker.setup.remote()

    def adopt(self, worker: Any) -> None:
        self.workers.append(worker)

    def remove(self, worker: Any) -> None:
        import ray

        self.events.append(("stop", self.slots.get(worker)))
        self.workers = [w for w in self.workers if w is not worker]
        ray.kill(worker, no_restart=True)


class LoggedJob(FakeJob):
    def __init__(self, events: list[tuple[str, Any]], **kw: Any):
        super().__init__(**kw)
        self.events = events

    def patch_status(self, patch: dict[str, Any]) -> None:
        super().patch_status(patch)
        self.events.append(("synced", patch["status"]["rollout"]["syncedGeneration"]))


def dead(handle: Any) -> None:
    """Kill a replica and return once it is gone, as it is when its pod has been replaced:
    `ray.kill` is asynchronous, and a call sent right after it may still be served."""
    import ray

    ray.kill(handle, no_restart=True)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            ray.get(handle.pid.remote(), timeout=5)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            return
        time.sleep(0.1)
    raise AssertionError("the killed replica still answers after 30 s")


def test_fleet_follows_the_jobs_rollout_generation(ray_session):
    import ray

    source_cls, replica_cls = stand_ins(setup_seconds=1.0)
    events: list[tuple[str, Any]] = []
    job = LoggedJob(events, desired=1, generation=1)
    membership = ClusterMembership(job, pin_to_pods=False)
    launcher = Launcher(replica_cls, events)
    first, ready = launcher.launch(0)
    ray.get(ready)
    launcher.adopt(first)
    actor = ray.remote(num_cpus=0)(source_cls).remote()
    fleet = RolloutFleet.start([actor], launcher, [first], membership, ElasticOptions(sync_timeout=5))
    version = 0
    consumed = 0

    def step(n_prompts: int = 6) -> dict[str, float]:
        """One controller step: rollout, boundary, sync (the policy version bumps in between)."""
        nonlocal version, consumed
        outputs, positions = fleet.generate([Prompt(100 + i) for i in range(n_prompts)], 2, version)
        consumed += n_prompts
        assert sorted(p for ps in positions for p in ps) == list(range(n_prompts))
        metrics: dict[str, float] = {}
        metrics.update(fleet.boundary(version, metrics))
        version += 1
        fleet.sync(version, version)
        return {**metrics, **fleet.step_metrics()}

    def wait_loaded() -> None:
        """Until the replicas still loading have (the next boundary adopts them)."""
        ray.get([r.ready for r in fleet.loading.values()])

    def weights() -> dict[str, int]:
        return {n: ray.get(r.handle.weights.remote()) for n, r in fleet.members.items()}

    # generation 1 (one replica): synced after the first push
    m = step()
    assert job.synced == [1] and m["rollout/replicas"] == 1
    assert weights() == {"rollout-0": 1}

    # kubectl scale --replicas=3: the new pods' replicas load for 1 s; training does not wait
    job.operator_writes(desired=3, generation=2)
    m = step()
    assert m["rollout/replicas"] == 1 and m["rollout/loading"] == 2
    assert job.synced == [1]  # not synced while slots 1 and 2 are still loading
    assert [e for e in events if e[0] == "launch"] == [("launch", 0), ("launch", 1), ("launch", 2)]
    wait_loaded()
    m = step()
    assert m["rollout/replicas"] == 3 and m["rollout/loading"] == 0
    assert {r.index for r in fleet.members.values()} == {0, 1, 2}
    assert job.synced == [1, 2]
    # each member holds the weights just pushed (the newcomers got them before they served)
    assert weights() == {"rollout-0": 3, "rollout-1": 1, "rollout-2": 1}
    rebuilt = ray.get(actor.rebuilt.remote())
    assert rebuilt[-1] == (["actor", "rollout-0", "rollout-1", "rollout-2"], 2)

    # kubectl scale --replicas=1: slots 1 and 2 leave; they are stopped before the patch that
    # lets the operator delete their pods
    events.clear()
    job.operator_writes(desired=1, generation=3)
    m = step()
    assert m["rollout/replicas"] == 1
    assert events == [("stop", 1), ("stop", 2), ("synced", 3)]
    assert ray.get(actor.rebuilt.remote())[-1] == (["actor", "rollout-0"], 3)

    # kubectl scale --replicas=2, the new pod loaded before the boundary after next
    job.operator_writes(desired=2, generation=4)
    step()
    wait_loaded()
    step()
    assert job.synced == [1, 2, 3, 4]

    # pod 0 replaced between two steps: its replica died with it and the operator bumped the
    # generation; the boundary's ping finds it gone before a prompt is leased to it
    dead(fleet.members["rollout-0"].handle)
    job.operator_writes(desired=2, generation=5)
    events.clear()
    fleet.boundary(version, {})
    assert "rollout-0" not in fleet.members
    assert events == [("stop", 0), ("launch", 0)]
    version += 1
    fleet.sync(version, version)
    assert job.synced[-1] == 4  # slot 0 is still loading
    step()  # the survivor generates every prompt meanwhile
    wait_loaded()
    step()
    assert sorted(r.index for r in fleet.members.values()) == [0, 1]
    assert job.synced == [1, 2, 3, 4, 5]

    # back to one replica, then its pod is replaced between two steps: no member is left, so
    # the next rollout waits for the replacement, which gets the current weights first
    job.operator_writes(desired=1, generation=6)
    step()
    assert job.synced[-1] == 6
    assert list(fleet.members) == ["rollout-4"]  # slot 0's replacement of the previous scene
    dead(fleet.members["rollout-4"].handle)
    job.operator_writes(desired=1, generation=7)
    fleet.boundary(version, {})
    assert not fleet.members and len(fleet.loading) == 1
    version += 1
    fleet.sync(version, version)  # nobody to push to
    assert job.synced[-1] == 6
    m = step()
    assert job.synced[-1] == 7 and m["rollout/replicas"] == 1
    assert weights() == {"rollout-5": 2}  # the refill's push, then the step's

    # the only replica dies in the middle of a rollout: its leases wait for the replacement
    fleet.options.generation_delay = lambda step: 0.5
    threading.Timer(0.3, ray.kill, args=(fleet.members["rollout-5"].handle,)).start()
    step()
    fleet.options.generation_delay = None
    assert list(fleet.members) == ["rollout-6"] and job.synced[-1] == 7
    assert fleet.leasing.queue.counters.requeued == 6

    counters = fleet.leasing.queue.counters
    assert counters.enqueued == counters.acked == consumed
    assert counters.leased == counters.acked + counters.requeued and counters.stale_acks == 0
    fleet.shutdown()
    for w in [*launcher.workers, actor]:
        ray.kill(w, no_restart=True)
