"""Two role "pods" on this host, as the operator wires them, for test_pod_rendezvous.py.

Each pod is a Ray node whose raylet has the pod's own environment (what `rlhf worker` gives
`ray start` in a real pod: RLHF_POD_IP from the downward API, RLHF_ROLE) and advertises the
role's Ray resource; loopback aliases 127.0.0.2 and 127.0.0.3 stand in for the pod IPs. The
driver plays the controller pod (RLHF_ROLE=controller, its own RLHF_POD_IP) and starts a
2-rank actor group with `WorkerGroup`, which puts one rank on each pod and forms the role's
torch.distributed group (gloo) across them. Prints one JSON line: what each rank saw.

Run as a script (its own Ray cluster, apart from the test session's).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

POD_IPS = ("127.0.0.2", "127.0.0.3")


def _probe_worker() -> type:
    import torch
    import torch.distributed as dist

    from rlhf_api import contract
    from rlhf_trainer.workers.base import Worker
    from rlhf_trainer.workers.distributed import rendezvous_host

    class ProbeWorker(Worker):
        role = "actor"
        store: tuple[str, int] | None = None

        def init_group(self, address: tuple[str, int]) -> None:
            self.store = address  # the rendezvous rank 0 offered, as every rank received it
            super().init_group(address)

        def probe(self) -> dict[str, Any]:
            total = torch.tensor([float(self.rank + 1)])
            dist.all_reduce(total)  # across both pods
            return {
                "rank": self.rank,
                "role": contract.ENV_ROLE.get(),
                "pod": contract.ENV_POD_NAME.get(),
                "rendezvous_host": rendezvous_host(),
                "store": list(self.store or ()),
                "all_reduce": float(total.item()),
            }

    return ProbeWorker


def main() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent))  # the workers import this module
    import ray
    from ray.cluster_utils import Cluster

    from rlhf_api import contract
    from rlhf_api.loader import parse_spec
    from rlhf_trainer.startup import start_ray
    from rlhf_trainer.workers.group import WorkerGroup

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    try:
        for i, ip in enumerate(POD_IPS):
            cluster.add_node(
                num_cpus=1,
                resources={contract.ray_role_resource("actor"): 1},
                env_vars={
                    contract.ENV_POD_IP.name: ip,
                    contract.ENV_ROLE.name: "actor",
                    contract.ENV_POD_NAME.name: f"j-actor-{i}",
                },
            )
        # The driver is the controller pod: its own values must not reach the ranks.
        os.environ[contract.ENV_ROLE.name] = contract.CONTROLLER_ROLE
        os.environ[contract.ENV_POD_IP.name] = "127.0.0.1"
        os.environ[contract.ENV_POD_NAME.name] = "j-controller"
        start_ray(cluster.address)
        spec = parse_spec(
            {"model": {"path": "m"}, "data": {"path": "d.jsonl"}, "reward": {"functions": [{"path": "r:f"}]}}
        )
        group = WorkerGroup(_probe_worker(), spec, replicas=2, distributed=True, num_cpus=1)
        print(json.dumps(group.call("probe")), flush=True)
        group.shutdown()
    finally:
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    main()
