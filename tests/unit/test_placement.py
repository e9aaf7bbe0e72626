"""Which worker asks Ray for which resources, from the spec alone (`rlhf_trainer.placement`).

Table-driven: each row is a role's `replicas`/`resources` and what its ranks must ask for, on a
cluster (the driver in the GPU-less controller pod) and locally. Nothing here looks at the
machine's GPUs: the answer may not depend on what the driver sees.
"""

from __future__ import annotations

import json
import sys

import pytest

from rlhf_api import contract
from rlhf_api.loader import load_manifest, parse_spec
from rlhf_trainer import placement


def _spec(role: str, replicas: int, gpus: int, cpu: str = "4") -> object:
    roles: dict[str, object] = {"placement": "disaggregated"}
    if role == "rollout":
        roles[role] = {
            "replicas": replicas,
            "minReplicas": min(1, replicas),
            "maxReplicas": max(1, replicas),
            "resources": {"gpus": gpus, "cpu": cpu},
        }
    else:
        roles[role] = {"replicas": replicas, "resources": {"gpus": gpus, "cpu": cpu}}
    return parse_spec(
        {
            "model": {"path": "m"},
            "data": {"path": "d.jsonl"},
            "reward": {"functions": [{"path": "r:f"}]},
            "roles": roles,
        }
    )


# role, replicas, gpus per pod -> ranks, GPUs per rank
CASES = [
    ("actor", 1, 0, 1, 0),
    ("actor", 2, 0, 2, 0),
    ("actor", 1, 1, 1, 1),
    ("actor", 1, 8, 8, 1),  # a pod with 8 GPUs runs 8 ranks
    ("actor", 2, 8, 16, 1),
    ("critic", 2, 4, 8, 1),
    ("reference", 1, 2, 2, 1),  # the reference runs on its GPUs when given them
    ("reward", 1, 1, 1, 1),  # so does the reward model
    ("reward", 3, 0, 3, 0),
    ("rollout", 1, 0, 1, 0),
    ("rollout", 2, 4, 2, 4),  # one engine per pod, over all of its GPUs (tensor parallel)
    ("rollout", 3, 1, 3, 1),
]


@pytest.mark.parametrize("role,replicas,gpus,ranks,gpus_per_rank", CASES)
@pytest.mark.parametrize("cluster", [True, False], ids=["cluster", "local"])
def test_ranks_and_gpus_come_from_the_roles_resources(role, replicas, gpus, ranks, gpus_per_rank, cluster):
    p = placement.role_placement(_spec(role, replicas, gpus), role, cluster=cluster, worker_cpus=0.25)
    assert (p.ranks, p.num_gpus) == (ranks, gpus_per_rank)
    assert p.device == ("cuda" if gpus else "cpu")
    assert p.ray_options()["num_gpus"] == gpus_per_rank
    assert p.ranks * p.num_gpus == replicas * gpus  # every GPU the pods get is used, none twice


@pytest.mark.parametrize("role,replicas,gpus,ranks,gpus_per_rank", CASES)
def test_on_a_cluster_the_ranks_fill_exactly_their_role_pods(role, replicas, gpus, ranks, gpus_per_rank):
    """Each rank asks for one unit of its role's resource; a pod advertises as many units as ranks
    it runs (`contract.ranks_per_pod`, the operator's `--resources`), plus CPUs they all fit in."""
    from rlhf_operator.children import ray_cpus

    spec = _spec(role, replicas, gpus, cpu="3")
    p = placement.role_placement(spec, role, cluster=True, worker_cpus=2.0)
    assert p.resources == {contract.ray_role_resource(role): 1.0}
    per_pod = contract.ranks_per_pod(role, gpus)
    assert ranks == replicas * per_pod
    assert per_pod * p.num_cpus <= ray_cpus("3")  # the pod's ranks fit in the CPUs it gives Ray
    assert per_pod * p.num_gpus <= gpus or gpus == 0


def test_locally_no_custom_resources_and_the_worker_cpus():
    p = placement.role_placement(_spec("actor", 2, 0), "actor", cluster=False, worker_cpus=0.25)
    assert p.ray_options() == {"num_cpus": 0.25, "num_gpus": 0, "resources": {}}


def test_cpu_shares_round_down_to_rays_resolution():
    """Seven ranks on a 1-CPU pod: 7 × share must not exceed 1 after Ray's 4-decimal rounding."""
    p = placement.role_placement(_spec("actor", 1, 7, cpu="1"), "actor", cluster=True, worker_cpus=1.0)
    assert p.num_cpus == 0.1428 and 7 * p.num_cpus <= 1


def test_rollout_replicas_follow_the_fleet_not_the_spec():
    p = placement.role_placement(_spec("rollout", 1, 2), "rollout", cluster=True, replicas=3)
    assert (p.ranks, p.num_gpus) == (3, 2)


def test_the_operator_advertises_what_the_ranks_ask_for():
    """The pod's `rlhf worker --resources` holds `ranks_per_pod` units of its role's resource."""
    from rlhf_api.loader import parse_job
    from rlhf_operator import children

    manifest = {
        "apiVersion": "rlhf.dev/v1alpha1",
        "kind": "RLTrainingJob",
        "metadata": {"name": "j", "namespace": "ns"},
        "spec": {
            "model": {"path": "m"},
            "data": {"path": "d.jsonl"},
            "reward": {"functions": [{"path": "r:f"}]},
            "roles": {
                "placement": "disaggregated",
                "actor": {"replicas": 1, "resources": {"gpus": 8}},
                "reference": {"replicas": 1, "resources": {"gpus": 2}},
                "rollout": {"replicas": 1, "resources": {"gpus": 4}},
            },
        },
    }
    job = parse_job(manifest)
    for role, units in (("actor", 8), ("reference", 2), ("rollout", 1), ("reward", 1)):
        pod = children.build_pod(job, role, 0)
        (arg,) = [a for a in pod["spec"]["containers"][0]["command"] if a.startswith("--resources=")]
        advertised = json.loads(arg.split("=", 1)[1])
        assert advertised[contract.ray_role_resource(role)] == units
        p = placement.role_placement(job.spec, role, cluster=True)
        assert p.ranks == units  # one pod: every rank fits on it, none more


def test_local_gpu_check_names_what_asked():
    spec = _spec("actor", 1, 2)
    placed = [placement.role_placement(spec, "actor", cluster=False)]
    placement.check_local_gpus(placed, available=2)
    with pytest.raises(ValueError, match=r"asks for 2 GPUs \(actor: 2 rank\(s\) × 1 GPU\).*Ray has 0"):
        placement.check_local_gpus(placed, available=0)


def test_unknown_role_lists_the_valid_ones():
    with pytest.raises(ValueError, match="valid: actor, critic, reference, reward, rollout"):
        placement.role_placement(_spec("actor", 1, 0), "trainer", cluster=False)


def test_the_gpu_examples_place_every_gpu():
    """The H100 examples: every GPU of every pod gets a rank (or an engine), on the cluster."""
    from pathlib import Path

    examples = Path(__file__).resolve().parents[2] / "manifests" / "examples"
    for name in ("grpo-h100.yaml", "ppo-two-pools.yaml"):
        spec = load_manifest(examples / name).spec
        for role in contract.ROLES:
            role_spec = getattr(spec.roles, role)
            p = placement.role_placement(spec, role, cluster=True)
            assert p.ranks * p.num_gpus == max(1, role_spec.replicas) * role_spec.resources.gpus, (name, role)


def test_placement_is_torch_free():
    import subprocess

    code = (
        "import sys, rlhf_trainer.placement; assert 'torch' not in sys.modules and 'ray' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize(
    "requested,actor,rollout,ok",
    [
        ("gloo", "cpu", "cpu", True),
        ("gloo", "cuda", "cuda", True),  # gloo moves GPU weights through CPU buffers
        ("nccl", "cuda", "cuda", True),
        ("nccl", "cpu", "cuda", False),
        ("nccl", "cuda", "cpu", False),
        ("mpi", "cuda", "cuda", False),
    ],
)
def test_sync_backend_is_checked_against_the_placement(requested, actor, rollout, ok):
    if ok:
        assert placement.sync_backend(requested, actor, rollout) == requested
    else:
        with pytest.raises(ValueError, match="RLHF_SYNC_BACKEND"):
            placement.sync_backend(requested, actor, rollout)


def test_the_sync_backend_defaults_to_gloo(monkeypatch):
    from rlhf_trainer.fleet.elastic import ElasticOptions

    monkeypatch.delenv("RLHF_SYNC_BACKEND", raising=False)
    assert ElasticOptions().sync_backend == "gloo"
    monkeypatch.setenv("RLHF_SYNC_BACKEND", "nccl")
    assert ElasticOptions().sync_backend == "nccl"
