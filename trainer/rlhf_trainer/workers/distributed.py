"""torch.distributed plumbing of a worker group: rendezvous, seeding, thread count.

Each role with several ranks gets its own process group (gloo on CPU, NCCL on GPU). Rank 0 picks
the TCP store address (`pick_store_address`); every rank then calls `init_group` with it.
"""

from __future__ import annotations

import random
import socket
from datetime import timedelta

import torch
import torch.distributed as dist

from rlhf_api import contract

#: How long a collective may block before the group raises instead of hanging forever.
COLLECTIVE_TIMEOUT = timedelta(seconds=contract.ENV_COLLECTIVE_TIMEOUT_S.get_int())


def rendezvous_host() -> str:
    """The address other ranks reach this process on. In a pod it is the pod's IP (the operator
    sets RLHF_POD_IP from the downward API; a Ray worker inherits it from its raylet, which runs in
    this pod), so a role's ranks on several pods find each other. Only a local run, where every
    rank is on this host, uses loopback."""
    return contract.ENV_POD_IP.get() or "127.0.0.1"


def pick_store_address() -> tuple[str, int]:
    """An address on this host with a free TCP port, for the group's TCPStore (called on rank 0):
    the rendezvous (`MASTER_ADDR:MASTER_PORT`) of the role's group, reachable from its other pods."""
    host = rendezvous_host()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return host, int(s.getsockname()[1])


def worker_device(requested: str | None, role: str) -> torch.device:
    """The device of a rank: `requested` is what its placement gave it (`placement.RolePlacement
    .device`: `cuda` exactly when it asked Ray for GPUs, which then sets CUDA_VISIBLE_DEVICES, so
    its first GPU is `cuda:0`). None (a worker built in-process): CUDA when this process sees it."""
    if requested is None:
        return torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    device = torch.device(requested)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError(
                f"spec.roles.{role}.resources.gpus: this {role} rank was given GPUs but sees no CUDA device "
                "(CUDA_VISIBLE_DEVICES, driver or a CPU-only torch build); set gpus: 0 to run on CPU"
            )
        device = torch.device("cuda", device.index or 0)
        torch.cuda.set_device(device)
    return device


def backend_for(device: torch.device) -> str:
    """The process-group backend for ranks on `device`: NCCL on GPUs, gloo on CPU."""
    return "nccl" if device.type == "cuda" else "gloo"


def group_device() -> torch.device:
    """The device collectives of the default group run on: the rank's GPU under NCCL (which
    takes no CPU tensors), the CPU under gloo."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def init_group(
    address: tuple[str, int], rank: int, world_size: int, device: torch.device | None = None
) -> None:
    """Join the role's process group; rank 0 hosts the TCPStore at `address`. NCCL when the rank
    computes on a GPU (bound to it with `device_id`), gloo on CPU."""
    device = device or torch.device("cpu")
    # Every rank meets at rank 0's pod IP (the store). Gloo's own connections then bind to the
    # address this pod's hostname resolves to, which the kubelet maps to the pod IP in /etc/hosts
    # (the pod sets hostname and subdomain); NCCL picks a non-loopback interface itself.
    store = dist.TCPStore(address[0], address[1], world_size, rank == 0, timeout=COLLECTIVE_TIMEOUT)
    dist.init_process_group(
        backend_for(device),
        store=store,
        rank=rank,
        world_size=world_size,
        timeout=COLLECTIVE_TIMEOUT,
        device_id=device if device.type == "cuda" else None,
    )


def set_threads() -> None:
    """One intra-op thread per worker unless RLHF_TORCH_THREADS says otherwise: workers share the cores."""
    torch.set_num_threads(contract.ENV_TORCH_THREADS.get_int())


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch: called with a seed derived from (job seed, step, rank) each step,
    so a resumed run draws the same numbers as an uninterrupted one."""
    random.seed(seed)
    try:
        import numpy as np

        np.random.seed(seed % (2**32))
    except ImportError:  # pragma: no cover - numpy ships with the trainer extra
        pass
    torch.manual_seed(seed)


def step_seed(seed: int, step: int, rank: int = 0, stream: int = 0) -> int:
    """A seed for (job seed, step, rank, stream), distinct for every combination."""
    return (seed * 1_000_003 + step * 10_007 + rank * 101 + stream) % (2**63 - 1)


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1
