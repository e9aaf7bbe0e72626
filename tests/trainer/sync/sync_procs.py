"""Process bodies of the multi-process sync tests (spawned with torch.multiprocessing; importable
by the children because spawn passes the parent's sys.path). Each writes its observations to
`<out>/<name>.json` (and tensors to `.pt`) for the test to check."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from rlhf_trainer.sync import (
    DroppedError,
    ReshardPlan,
    SyncGroup,
    WeightReceiver,
    connect_store,
    default_tp_rules,
    tensor_digest,
)

HOST = "127.0.0.1"
#: (bucket bytes, big tensors): a prime size smaller than most tensors (everything straddles), a
#: prime size, a size many tensors fit in, and one bucket larger than the whole stream.
BUCKET_CASES = [(509, False), (4093, False), (65536, True), (4 << 20, True)]


def weights(version: int, big: bool = False) -> dict[str, torch.Tensor]:
    """Deterministic test tensors: mixed dtypes, a scalar, an empty tensor, odd byte sizes, and a
    Qwen2-like layer for the TP plan (4 heads of 8, 2 KV heads)."""
    g = torch.Generator().manual_seed(version)
    r = lambda *s, dt=torch.float32: torch.randn(*s, generator=g).to(dt)  # noqa: E731
    w = {
        "model.embed_tokens.weight": r(50, 32, dt=torch.bfloat16),  # vocab 50: uneven over 4
        "model.layers.0.self_attn.q_proj.weight": r(32, 32),
        "model.layers.0.self_attn.q_proj.bias": r(32),
        "model.layers.0.self_attn.k_proj.weight": r(16, 32, dt=torch.bfloat16),
        "model.layers.0.self_attn.v_proj.weight": r(16, 32),
        "model.layers.0.self_attn.o_proj.weight": r(32, 32),
        "model.layers.0.mlp.gate_proj.weight": r(64, 32),
        "model.layers.0.mlp.up_proj.weight": r(64, 32),
        "model.layers.0.mlp.down_proj.weight": r(32, 64),
        "model.layers.0.input_layernorm.weight": r(32),
        "model.norm.weight": r(3, dt=torch.float16),  # 6 bytes: odd boundaries
        "scalar": torch.tensor(float(version)),
        "empty": torch.empty(0, 4),
        "steps": torch.arange(7, dtype=torch.int64) + version,
        "lm_head.weight": r(50, 32, dt=torch.bfloat16),
    }
    if big:
        w["big"] = r(256, 1024)  # 1 MiB, spans many buckets
    return w


def _write(out: str, name: str, obj: Any) -> None:
    Path(out, f"{name}.json").write_text(json.dumps(obj))


_stores: dict[int, Any] = {}


def _group(rank: int, port: int, me: str, timeout: float, prefix: str = "rlhf-sync", **kw: Any) -> SyncGroup:
    if port not in _stores:  # one store per process, shared by its groups (channels)
        _stores[port] = connect_store(HOST, port, is_source=rank == 0, timeout=60)
    return SyncGroup(_stores[port], me, timeout=timeout, prefix=prefix, hostname=HOST, **kw)


def buckets_and_tp(rank: int, port: int, out: str) -> None:
    """Source + 2 receivers. Several bucket sizes through one group (receiver 1 collects, receiver
    2 writes into an fp32 module: in place and with a cast), then two TP channels."""
    names = ["src", "r1", "r2"]
    me = names[rank]
    sg = _group(rank, port, me, timeout=20)
    sg.rebuild(names, generation=1)
    report: dict[str, Any] = {"digests": [], "buckets": []}
    for i, (bucket, big) in enumerate(BUCKET_CASES):
        t0 = time.monotonic()
        sg.bucket_bytes = bucket
        w = weights(i, big=big)
        if me == "src":
            res = sg.push(w.items(), version=i)
            report["buckets"].append(res.stats.buckets)
            report["peak"] = res.stats.peak_extra_bytes
            report["digests"].append(tensor_digest(w.items()))
        elif me == "r1":
            rx = WeightReceiver()
            sg.receive(rx)
            report["digests"].append(tensor_digest(rx.tensors.items()))
            report["version"] = rx.version
        else:
            w32 = {n.replace(".", "_"): t for n, t in w.items()}
            model = torch.nn.Module()
            for n, t in w32.items():
                model.register_buffer(
                    n, torch.zeros(t.shape, dtype=torch.float32 if t.is_floating_point() else t.dtype)
                )
            # the stream's names have dots; map them onto this module's buffer names
            rx = WeightReceiver(targets={n: model.get_buffer(n.replace(".", "_")) for n in w})
            sg.receive(rx)
            exact = all(
                torch.equal(
                    model.get_buffer(n.replace(".", "_")), t.to(model.get_buffer(n.replace(".", "_")).dtype)
                )
                for n, t in w.items()
            )
            report["digests"].append(exact)
        report.setdefault("seconds", []).append(round(time.monotonic() - t0, 3))
    # Tensor parallelism: channel r holds the source and TP rank r of the engine (r1 -> 0, r2 -> 1).
    w = weights(99)
    plan = ReshardPlan.for_tensors(w.items(), tp_size=2, rules=default_tp_rules(head_dim=8))
    channels = {"r1": 0, "r2": 1}
    if me == "src":
        for tp in (0, 1):
            ch = _group(rank, port, me, timeout=20, prefix=f"tp{tp}")
            ch.rebuild(["src", [k for k, v in channels.items() if v == tp][0]], generation=1)
            ch.push(w.items(), version=99, plan=plan, tp_rank=tp)
        torch.save(w, Path(out, "full.pt"))
    else:
        tp = channels[me]
        ch = _group(rank, port, me, timeout=20, prefix=f"tp{tp}")
        ch.rebuild(["src", me], generation=1)
        rx = WeightReceiver()
        ch.receive(rx)
        torch.save(rx.tensors, Path(out, f"shards{tp}.pt"))
    _write(out, me, report)


def membership(rank: int, port: int, out: str) -> None:
    """Fleet 1 -> 3 -> 2 replicas, a new group per generation, weights pushed after each rebuild."""
    names = ["src", "r1", "r2", "r3"]
    me = names[rank]
    sg = _group(rank, port, me, timeout=20, bucket_bytes=1000)
    gens = {1: ["src", "r1"], 2: ["src", "r1", "r2", "r3"], 3: ["src", "r1", "r3"]}
    report: dict[str, Any] = {}
    for gen, members in gens.items():
        sg.rebuild(members, generation=gen)
        if not sg.active:
            report[str(gen)] = "out"
            continue
        if me == "src":
            res = sg.push(weights(gen).items(), version=gen)
            report[str(gen)] = {
                "members": res.members,
                "rebuild_s": sg.rebuild_seconds,
                "digest": tensor_digest(weights(gen).items()),
            }
        else:
            rx = WeightReceiver()
            sg.receive(rx)
            report[str(gen)] = {"digest": tensor_digest(rx.tensors.items()), "version": rx.version}
    _write(out, me, report)


def kill_mid_sync(rank: int, port: int, out: str, timeout: float) -> None:
    """r2 dies (os._exit) in the middle of the first push; the others must get the weights."""
    names = ["src", "r1", "r2", "r3"]
    me = names[rank]
    sg = _group(rank, port, me, timeout=timeout, bucket_bytes=4096)
    sg.rebuild(names, generation=1)
    w = weights(5, big=True)
    t0 = time.monotonic()
    if me == "src":
        res = sg.push(w.items(), version=5)
        _write(
            out,
            me,
            {
                "dropped": res.dropped,
                "members": res.members,
                "attempts": res.attempts,
                "seconds": time.monotonic() - t0,
                "digest": tensor_digest(w.items()),
            },
        )
        return
    rx = WeightReceiver()
    if me == "r2":
        real_begin = rx.begin

        def begin(meta: Any) -> torch.Tensor:
            if meta.name == "big":  # mid-stream: "big" is 256 of the stream's 267 buckets
                os._exit(1)
            return real_begin(meta)

        rx.begin = begin  # type: ignore[method-assign]
    try:
        sg.receive(rx)
        _write(out, me, {"digest": tensor_digest(rx.tensors.items()), "seconds": time.monotonic() - t0})
    except DroppedError as e:
        _write(out, me, {"dropped": str(e)})


def fsdp_source(rank: int, port: int, out: str) -> None:
    """Ranks 0 and 1 train a tiny model under FSDP2 (their own gloo world); rank 0 is also the
    sync source; process 2 is a rollout replica outside that world."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64), torch.nn.Linear(64, 8)
    )
    if rank < 2:
        fsdp_store = dist.TCPStore(HOST, port + 1, 2, is_master=rank == 0)
        dist.init_process_group("gloo", store=fsdp_store, rank=rank, world_size=2)
        from torch.distributed.fsdp import fully_shard

        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer)
        fully_shard(model)
    me = ["src", "fsdp1", "r1"][rank]
    sg = _group(0 if rank == 0 else 1, port, me, timeout=30, bucket_bytes=2048)
    if rank == 1:
        from rlhf_trainer.sync import drain_full_tensors

        drain_full_tensors(model.named_parameters())  # the gathers of the push
        tensor_digest(model.named_parameters())  # the gathers of the digest
        dist.destroy_process_group()
        return
    sg.rebuild(["src", "r1"], generation=1)
    if rank == 0:
        res = sg.push(model.named_parameters(), version=1)
        digest = tensor_digest(model.named_parameters())
        largest = max(p.numel() * p.element_size() for p in model.parameters())
        _write(
            out,
            me,
            {
                "digest": digest,
                "peak": res.stats.peak_extra_bytes,
                "largest": largest,
                "largest_materialized": res.stats.largest_materialized_bytes,
            },
        )
        dist.destroy_process_group()
    else:
        rx = WeightReceiver()
        sg.receive(rx)
        _write(out, me, {"digest": tensor_digest(rx.tensors.items())})
