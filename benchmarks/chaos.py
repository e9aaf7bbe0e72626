"""Chaos soak: random rollout resizes and rollout-replica kills over one disaggregated local run.

    python benchmarks/chaos.py [--resizes 100] [--kills 5] [--steps 110] [--max-replicas 3] [--seed 0]

One `rlhf run` of the tiny bootstrap model (GRPO, disaggregated) whose rollout fleet is sized by a
scripted membership source (`ScriptedMembership`, a `fleet.membership.MembershipSource` like the
local policy and the operator's): a seeded random walk over 1..max-replicas, a different size at
each of the first `--resizes` step boundaries. At `--kills` steps one serving replica, chosen at
random, is SIGKILLed while it generates (generation is slowed on those steps so that the kill
lands mid-rollout). The fleet's own machinery does the rest: drains and requeues on a shrink,
requeues a dead replica's leases, refills its slot at the next boundary, rebuilds the sync group
and pushes the weights, hashing them on the actor and on every replica (`verify_weights`).

Printed figures: resizes done (boundaries after which the fleet held the scripted size), kills
done, prompts consumed vs expected (the data loader's count and the prompt queue's enqueued /
acked counters, per step), sync checks passed (syncs whose every replica digest equals the
actor's) and the wall time. `tests/trainer/elastic/test_chaos_soak.py` runs the short form
(10 resizes, 1 kill) in CI and asserts the same figures.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

CACHE = Path("~/.cache/rlhf-operator").expanduser()
#: Seconds per prompt each replica sleeps on a kill step, and when the kill fires after the
#: rollout starts: every replica holds at least one prompt for longer than that.
KILL_DELAY = 1.0
KILL_AFTER = 0.4


@dataclass(frozen=True)
class Plan:
    """What the soak does to the fleet."""

    initial: int
    """Replicas the run starts with."""
    sizes: list[int]
    """`sizes[s]`: the fleet's size asked for at the boundary after step `s` (serving step s+1)."""
    kills: list[int]
    """Steps during whose rollout one serving replica is SIGKILLed."""

    def serving(self, step: int) -> int:
        return self.initial if step == 0 else self.sizes[step - 1]


def make_plan(resizes: int, kills: int, steps: int, max_replicas: int, seed: int) -> Plan:
    """A seeded random walk over `1..max_replicas` changing size at each of the first `resizes`
    boundaries, then holding; `kills` distinct steps whose serving fleet has 2 or more replicas
    (a kill then leaves a survivor to take the requeued prompts)."""
    if max_replicas < 3:
        raise ValueError(
            f"max_replicas must be at least 3 (a kill step needs 2 serving after any size), got {max_replicas}"
        )
    if steps <= resizes:
        raise ValueError(f"steps ({steps}) must exceed resizes ({resizes}): the last resize serves a step")
    if kills > steps - 1:
        raise ValueError(f"kills ({kills}) must be fewer than steps ({steps}): step 0 is never a kill step")
    rng = random.Random(seed)
    kill_steps = sorted(rng.sample(range(1, steps), kills))
    initial = 2
    sizes: list[int] = []
    size = initial
    late_kill = any(k > resizes for k in kill_steps)  # served by the walk's last size
    for s in range(steps):
        if s < resizes:
            floor = 2 if s + 1 in kill_steps or (s == resizes - 1 and late_kill) else 1
            size = rng.choice([n for n in range(floor, max_replicas + 1) if n != size])
        sizes.append(size)
    return Plan(initial, sizes, kill_steps)


class ScriptedMembership:
    """A `MembershipSource` that asks for `plan.sizes[step]` at each boundary (a new generation
    for each change, as the operator's `status.rollout` would). New replicas are waited for
    (`join_wait` None), so each resize takes effect at its own boundary."""

    join_wait: float | None = None

    def __init__(self, plan: Plan):
        from rlhf_trainer.fleet.membership import Target

        self.plan = plan
        self.current = Target(plan.initial, generation=1)
        self.synced_targets: list[Any] = []

    def initial(self) -> Any:
        return self.current

    def target(self, step: int, metrics: dict[str, float]) -> Any:
        from rlhf_trainer.fleet.membership import Target

        size = self.plan.sizes[min(step, len(self.plan.sizes) - 1)]
        if size != self.current.replicas:
            self.current = Target(size, self.current.generation + 1)
        return self.current

    def placement(self, index: int) -> dict[str, float]:
        return {}

    def synced(self, target: Any, changed: bool) -> None:
        self.synced_targets.append(target)

    def attach_metrics(self, registry: Any) -> None:
        pass

    def step_metrics(self) -> dict[str, float]:
        return {}


@dataclass
class Soak:
    """What one soak run recorded."""

    plan: Plan
    syncs: list[Any] = field(default_factory=list)
    """`SyncRecord` of every weight sync."""
    starts: list[Any] = field(default_factory=list)
    """`SyncStart` of every weight sync (members and their pids)."""
    killed: dict[int, str] = field(default_factory=dict)
    """Step -> the replica SIGKILLed during its rollout."""
    rows: list[dict[str, Any]] = field(default_factory=list)
    wall_seconds: float = 0.0


def run_soak(job: Any, plan: Plan, run_dir: Path, *, seed: int = 0, sync_timeout: float = 5.0) -> Soak:
    """Run `job` (disaggregated; `maxReplicas` at least the plan's largest size) under `plan`."""
    from rlhf_trainer.controller import run
    from rlhf_trainer.fleet.elastic import ElasticOptions
    from rlhf_trainer.metrics import read_jsonl

    soak = Soak(plan)
    rng = random.Random(seed + 1)

    def kill(step: int) -> None:
        last = soak.starts[-1]  # the sync before this step: its members serve the step
        victim = rng.choice(last.members)
        os.kill(last.pids[victim], signal.SIGKILL)
        soak.killed[step] = victim

    def delay(step: int) -> float:
        if step not in plan.kills:
            return 0.0
        threading.Timer(KILL_AFTER, kill, args=(step,)).start()
        return KILL_DELAY

    options = ElasticOptions(
        membership=ScriptedMembership(plan),
        verify_weights=True,
        sync_timeout=sync_timeout,
        on_sync_start=soak.starts.append,
        on_sync=soak.syncs.append,
        generation_delay=delay,
    )
    t0 = time.perf_counter()
    run(job, run_dir=run_dir, resume=False, elastic=options)
    soak.wall_seconds = time.perf_counter() - t0
    soak.rows = read_jsonl(Path(run_dir) / "metrics.jsonl")
    return soak


def figures(soak: Soak, job: Any) -> dict[str, Any]:
    """The soak's outcome, counted from the fleet's own records (sync records, the prompt queue's
    and the data loader's counters in the run log)."""
    spec = job.spec
    steps, per_step = spec.training.steps, spec.training.prompts_per_step
    samples = per_step * spec.rollout.samples_per_prompt
    plan, rows, syncs = soak.plan, soak.rows, soak.syncs
    resizes = sum(
        1
        for s, sync in enumerate(syncs)
        if plan.sizes[s] != plan.serving(s) and len(sync.members) == plan.sizes[s]
    )
    # A step's prompts were each generated and acked exactly once (the leasing raises otherwise;
    # the counters show it across steps, kills and drains included).
    previous = {"queue/enqueued": 0.0, "queue/acked": 0.0}
    exact_steps = 0
    for r in rows:
        if (
            r["queue/enqueued"] - previous["queue/enqueued"] == per_step
            and r["queue/acked"] - previous["queue/acked"] == per_step
            and r["rollout/samples"] == samples
        ):
            exact_steps += 1
        previous = r
    last = rows[-1] if rows else {}
    verified = [
        s
        for s in syncs
        if s.actor_digest is not None
        and not s.dropped
        and s.replica_digests == {m: s.actor_digest for m in s.members}
    ]
    # A killed replica never comes back: no later sync has it as a member.
    kills = sum(1 for step, name in soak.killed.items() if all(name not in s.members for s in syncs[step:]))
    return {
        "steps_done": len(rows),
        "steps_expected": steps,
        "resizes_done": resizes,
        "resizes_expected": sum(1 for s in range(steps) if plan.sizes[s] != plan.serving(s)),
        "kills_done": kills,
        "kills_expected": len(plan.kills),
        "prompts_consumed": int(last.get("data/prompts_consumed", 0)),
        "prompts_enqueued": int(last.get("queue/enqueued", 0)),
        "prompts_acked": int(last.get("queue/acked", 0)),
        "prompts_requeued": int(last.get("queue/requeued", 0)),
        "stale_acks": int(last.get("queue/stale_acks", 0)),
        "prompts_expected": steps * per_step,
        "exact_steps": exact_steps,
        "sync_checks_passed": len(verified),
        "syncs": len(syncs),
        "replica_digests_checked": sum(len(s.replica_digests) for s in verified),
        "fleet_sizes": [len(s.members) for s in syncs],
        "reshard_seconds": round(sum(r.get("reshard/seconds", 0.0) for r in rows), 1),
        "sync_seconds": round(sum(s.wall_seconds for s in syncs), 1),
        "rollout_seconds": round(sum(r.get("timing/rollout", 0.0) for r in rows), 1),
        "wall_seconds": round(soak.wall_seconds, 1),
    }


def job_document(steps: int, max_replicas: int, prompts_per_step: int) -> dict[str, Any]:
    """The soak's job on the bootstrap model in the cache (created on first use)."""
    return {
        "apiVersion": "rlhf.dev/v1alpha1",
        "kind": "RLTrainingJob",
        "metadata": {"name": "bench-chaos"},
        "spec": {
            "model": {"path": str(CACHE / "models/tiny-arithmetic"), "bootstrap": "tiny-arithmetic"},
            "data": {"path": str(CACHE / "data/tiny-arithmetic.jsonl")},
            "reward": {"functions": [{"path": "rlhf_trainer.rewards.builtin:arithmetic_exact"}]},
            "algorithm": {"name": "grpo", "params": {"klCoef": 0.0}},
            "rollout": {"samplesPerPrompt": 2, "maxNewTokens": 3},
            "training": {
                "steps": steps,
                "promptsPerStep": prompts_per_step,
                "microBatchSize": 2 * prompts_per_step,
                "learningRate": 1e-3,
            },
            "checkpoint": {"every": 0},
            "output": {"progress": False, "report": False},
            "roles": {
                "placement": "disaggregated",
                "critic": {"replicas": 0},
                "reference": {"replicas": 0},
                "rollout": {"replicas": 2, "maxReplicas": max_replicas},
            },
        },
    }


def report(fig: dict[str, Any]) -> str:
    return "\n".join(
        [
            f"steps done          {fig['steps_done']} / {fig['steps_expected']}",
            f"resizes done        {fig['resizes_done']} / {fig['resizes_expected']}  (fleet sizes {fig['fleet_sizes']})",
            f"kills done          {fig['kills_done']} / {fig['kills_expected']}",
            f"prompts consumed    {fig['prompts_consumed']} / {fig['prompts_expected']} expected "
            f"(enqueued {fig['prompts_enqueued']}, acked {fig['prompts_acked']}, requeued "
            f"{fig['prompts_requeued']}, stale acks {fig['stale_acks']}; steps exact "
            f"{fig['exact_steps']} / {fig['steps_expected']})",
            f"sync checks passed  {fig['sync_checks_passed']} / {fig['syncs']} "
            f"({fig['replica_digests_checked']} replica digests equal to the actor's)",
            f"wall time           {fig['wall_seconds']} s  (boundaries resharding {fig['reshard_seconds']} s, "
            f"syncs {fig['sync_seconds']} s, rollouts {fig['rollout_seconds']} s)",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--resizes", type=int, default=100)
    parser.add_argument("--kills", type=int, default=5)
    parser.add_argument("--steps", type=int, default=None, help="default: resizes + 2")
    parser.add_argument("--max-replicas", type=int, default=3)
    parser.add_argument("--prompts-per-step", type=int, default=6)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    steps = args.steps if args.steps is not None else args.resizes + 2
    try:
        plan = make_plan(args.resizes, args.kills, steps, args.max_replicas, args.seed)
    except ValueError as err:
        parser.error(str(err))

    from rlhf_api.loader import parse_job
    from rlhf_trainer.startup import start_ray

    job = parse_job(job_document(steps, args.max_replicas, args.prompts_per_step))
    owns = start_ray()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            soak = run_soak(job, plan, Path(tmp), seed=args.seed)
    finally:
        if owns:
            import ray

            ray.shutdown()
    fig = figures(soak, job)
    print(report(fig))
    ok = (
        fig["steps_done"] == fig["steps_expected"]
        and fig["resizes_done"] == fig["resizes_expected"]
        and fig["kills_done"] == fig["kills_expected"]
        and fig["prompts_consumed"]
        == fig["prompts_enqueued"]
        == fig["prompts_acked"]
        == fig["prompts_expected"]
        and fig["exact_steps"] == fig["steps_expected"]
        and fig["sync_checks_passed"] == fig["syncs"] == fig["steps_expected"]
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
