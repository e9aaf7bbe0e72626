"""Stage `sync`: the weight sync's NCCL paths on the GPUs at hand.

* the bucketed broadcast (`sync.buckets.bucketed_broadcast`) of bf16 CUDA tensors through
  device-resident buckets over a `ProcessGroupNCCL`: with 2+ GPUs from one process to a receiver
  process on the next GPU (digests compared, GB/s); with one GPU over a one-rank group (NCCL puts
  one rank per GPU: the sender's whole path runs, nobody receives);
* a `SyncGroup(backend="nccl")` whose receiver never connects: the source drops it within its
  timeout (it waits for the receiver's ready mark, then for its ack) and does not hang.

    python sync.py --receiver PORT RESULT   # the receiver process on cuda:1 (run by the stage)
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from common import Stage, free_port, main, synchronize

SYNC_TIMEOUT = 3.0


def weights(device: str, mib: int = 256) -> list[tuple[str, Any]]:
    import torch

    g = torch.Generator().manual_seed(0)
    shapes = [(4096, 4096)] * (mib // 32) + [(257,), (1024, 3)]  # large ones alone, small ones packed
    return [
        (f"w{i}", torch.randn(s, generator=g).to(torch.bfloat16).to(device)) for i, s in enumerate(shapes)
    ]


def one_rank_broadcast(stage: Stage) -> None:
    import torch.distributed as dist

    from rlhf_trainer.sync import tensor_digest
    from rlhf_trainer.sync.buckets import bucketed_broadcast

    store = dist.HashStore()
    if stage.device.startswith("cuda"):
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timedelta(seconds=60)
        pg: Any = dist.ProcessGroupNCCL(dist.PrefixStore("one/", store), 0, 1, opts)
    else:  # CPU rehearsal: the same path over gloo
        pg = dist.ProcessGroupGloo(dist.PrefixStore("one/", store), 0, 1, timedelta(seconds=60))
    items = weights(stage.device)
    digest = tensor_digest(items)
    t0 = time.perf_counter()
    stats = bucketed_broadcast(items, pg, 0, 32 << 20, timeout=30, device=stage.device)
    synchronize(stage.device)
    stage.figure("one_rank_broadcast_seconds", time.perf_counter() - t0, "s")
    stage.figure("one_rank_broadcast_buckets", stats.buckets)
    stage.check(
        "one-rank bucketed broadcast completes, tensors intact",
        stats.buckets > 0 and tensor_digest(items) == digest,
        f"{stats.buckets} buckets",
    )


def receiver(port: int, out: str) -> None:
    """Rank 1 of a 2-GPU sync group, on cuda:1 (chosen by index: CUDA is initialised here)."""
    import torch

    from rlhf_trainer.sync import SyncGroup, WeightReceiver, connect_store, tensor_digest

    torch.cuda.set_device(1)
    store = connect_store("127.0.0.1", port, is_source=False, timeout=60)
    group = SyncGroup(store, "r1", timeout=30, backend="nccl", device="cuda:1")
    group.rebuild(["actor", "r1"], 1)
    sink = WeightReceiver(device="cuda:1")
    group.receive(sink)
    Path(out).write_text(json.dumps({"digest": tensor_digest(sink.tensors.items())}))


def two_gpu_broadcast(stage: Stage) -> None:
    import torch

    from rlhf_trainer.sync import SyncGroup, connect_store, tensor_digest

    if not stage.device.startswith("cuda") or torch.cuda.device_count() < 2:
        stage.note("two-GPU NCCL broadcast", "needs 2 GPUs (NCCL puts one rank per GPU)")
        return
    port, out = free_port(), stage.scratch / "rx.json"
    store = connect_store("127.0.0.1", port, is_source=True, timeout=60)
    rx = subprocess.Popen([sys.executable, __file__, "--receiver", str(port), str(out)])
    group = SyncGroup(store, "actor", timeout=30, backend="nccl", device="cuda:0")
    group.rebuild(["actor", "r1"], 1)
    items = weights("cuda:0", mib=1024)
    t0 = time.perf_counter()
    res = group.push(items, version=1)
    seconds = time.perf_counter() - t0
    rx.wait(timeout=60)
    got = json.loads(out.read_text())
    stage.figure("two_gpu_sync_gb_per_s", res.stats.bytes / seconds / 1e9, "GB/s")
    stage.check(
        "two-GPU NCCL sync: bit-exact", got["digest"] == tensor_digest(items) and res.members == ["r1"]
    )


def dead_receiver(stage: Stage) -> None:
    import torch

    from rlhf_trainer.sync import SyncGroup, connect_store

    backend = "nccl" if stage.device.startswith("cuda") else "gloo"
    store = connect_store("127.0.0.1", free_port(), is_source=True, timeout=60)
    group = SyncGroup(store, "actor", timeout=SYNC_TIMEOUT, backend=backend, device=stage.device)
    t0 = time.perf_counter()
    group.rebuild(["actor", "r1"], 1)  # r1 never connects
    items = [("w", torch.ones(1024, device=stage.device))]
    res = group.push(items, version=1)
    seconds = time.perf_counter() - t0
    bound = 4 * SYNC_TIMEOUT + 10
    stage.figure("dead_receiver_dropped_after_s", seconds, "s")
    stage.check(
        "a receiver that never connects is dropped",
        res.dropped == ["r1"] and res.members == [],
        f"dropped {res.dropped}, members {res.members}",
    )
    stage.check("within its timeout bound", seconds <= bound, f"{seconds:.1f} s, bound {bound:.0f} s")
    group.close()


def body(stage: Stage) -> None:
    if stage.device.startswith("cuda"):
        import torch

        torch.cuda.set_device(0)
    one_rank_broadcast(stage)
    two_gpu_broadcast(stage)
    dead_receiver(stage)


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--receiver":
        for part in ("api", "trainer"):
            sys.path.insert(0, str(Path(__file__).resolve().parents[3] / part))
        receiver(int(sys.argv[2]), sys.argv[3])
        sys.exit(0)
    sys.exit(main("sync", body))
