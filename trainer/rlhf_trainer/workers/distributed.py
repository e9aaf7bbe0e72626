"""torch.distributed plumbing of a worker group: rendezvous, seeding, thread count.

Each role with several ranks gets its own process group (gloo on CPU, NCCL on GPU). Rank 0 picks
the TCP store address (`pick_store_address`); every rank then calls `init_group` with it.
"""

from __future__ import annotations

import os
import random
import socket
from datetime import timedelta

import torch
import torch.distributed as dist

#: How long a collective may block before the group raises instead of hanging forever.
COLLECTIVE_TIMEOUT = timedelta(seconds=int(os.environ.get("RLHF_COLLECTIVE_TIMEOUT_S", "300")))


def pick_store_address() -> tuple[str, int]:
    """An address on this host with a free TCP port, for the group's TCPStore (called on rank 0)."""
    host = os.environ.get("RLHF_NODE_IP") or "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return host, int(s.getsockname()[1])


def init_group(address: tuple[str, int], rank: int, world_size: int) -> None:
    """Join the role's process group; rank 0 hosts the TCPStore at `address`."""
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    store = dist.TCPStore(address[0], address[1], world_size, rank == 0, timeout=COLLECTIVE_TIMEOUT)
    dist.init_process_group(
        backend, store=store, rank=rank, world_size=world_size, timeout=COLLECTIVE_TIMEOUT
    )


def set_threads() -> None:
    """One intra-op thread per worker unless RLHF_TORCH_THREADS says otherwise: workers share the cores."""
    torch.set_num_threads(int(os.environ.get("RLHF_TORCH_THREADS", "1")))


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
