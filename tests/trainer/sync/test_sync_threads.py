"""Bucketed broadcast and SyncGroup over real gloo, with the members as threads of this process
(fast: no process spawn). The multi-process tests in test_sync_multiprocess.py cover the same
paths across processes, plus membership changes, deaths and FSDP2 sources."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
import sync_procs
import torch
import torch.distributed as dist

from rlhf_trainer.sync import (
    ReshardPlan,
    SyncGroup,
    WeightReceiver,
    bucketed_broadcast,
    default_pack_below,
    default_tp_rules,
    plan_messages,
    receive_broadcast,
    tensor_digest,
)


def _threads(*fns: Callable[[], Any]) -> list[Any]:
    out: list[Any] = [None] * len(fns)
    errs: list[BaseException] = []

    def wrap(i: int, f: Callable[[], Any]) -> None:
        try:
            out[i] = f()
        except BaseException as e:  # surfaced below
            errs.append(e)

    ts = [threading.Thread(target=wrap, args=(i, f)) for i, f in enumerate(fns)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout=120)
    if errs:
        raise errs[0]
    return out


@pytest.mark.parametrize("bucket", [509, 4093, 1 << 16, 1 << 22])
def test_bucketed_broadcast_bit_exact(bucket: int) -> None:
    store = dist.HashStore()
    w = sync_procs.weights(1, big=bucket >= 1 << 16)
    pgs = _threads(
        *[lambda r=r: dist.ProcessGroupGloo(dist.PrefixStore("b/", store), r, 3) for r in range(3)]
    )
    rx1, rx2 = WeightReceiver(), WeightReceiver()
    stats, s1, s2 = _threads(
        lambda: bucketed_broadcast(w.items(), pgs[0], 0, bucket, version=7),
        lambda: receive_broadcast(rx1, pgs[1], 0),
        lambda: receive_broadcast(rx2, pgs[2], 0),
    )
    sizes = [t.numel() * t.element_size() for t in w.values()]
    total = sum(sizes)
    assert stats.bytes == total and stats.buckets == len(plan_messages(sizes, bucket)) == s1.buckets
    assert s1.version == s2.version == 7
    assert (
        tensor_digest(rx1.tensors.items()) == tensor_digest(rx2.tensors.items()) == tensor_digest(w.items())
    )
    assert stats.peak_extra_bytes <= 2 * min(bucket, total)  # nothing materialized: buffers only


@pytest.mark.parametrize("bucket", [1, 7, 64, 100, 4096])
def test_plan_messages_covers_every_byte_once(bucket: int) -> None:
    sizes = [0, 3, 64, 0, 1000, 5, 5, 17, 4096, 0]
    msgs = plan_messages(sizes, bucket)
    seen = [(i, off, n) for m in msgs for i, off, n in m]
    assert all(sum(n for _, _, n in m) <= bucket for m in msgs)
    # in stream order, contiguous, every byte of every tensor exactly once
    expect = [(i, o) for i, n in enumerate(sizes) for o in range(n)]
    assert [(i, off + k) for i, off, n in seen for k in range(n)] == expect
    # a tensor of at least pack_below bytes is alone in its messages (zero-copy)
    for m in msgs:
        if any(sizes[i] >= default_pack_below(bucket) for i, _, _ in m):
            assert len(m) == 1


def test_receiver_writes_model_in_place_and_casts() -> None:
    store = dist.HashStore()
    src = torch.nn.Linear(8, 4).to(torch.bfloat16)
    dst_same = torch.nn.Linear(8, 4).to(torch.bfloat16)
    dst_fp32 = torch.nn.Linear(8, 4)
    ptr = dst_same.weight.data_ptr()
    pgs = _threads(
        *[lambda r=r: dist.ProcessGroupGloo(dist.PrefixStore("m/", store), r, 3) for r in range(3)]
    )
    _threads(
        lambda: bucketed_broadcast(src.named_parameters(), pgs[0], 0, 16),
        lambda: receive_broadcast(WeightReceiver(dst_same), pgs[1], 0),
        lambda: receive_broadcast(WeightReceiver(dst_fp32), pgs[2], 0),
    )
    assert dst_same.weight.data_ptr() == ptr and torch.equal(dst_same.weight, src.weight)
    assert torch.equal(dst_fp32.weight, src.weight.float()) and torch.equal(dst_fp32.bias, src.bias.float())


def test_strict_receiver_names_unknown_tensor() -> None:
    rx = WeightReceiver(torch.nn.Linear(2, 2))
    from rlhf_trainer.sync import TensorMeta

    with pytest.raises(KeyError, match="'nope'"):
        rx.begin(TensorMeta("nope", (2,), "float32"))
    with pytest.raises(ValueError, match=r"model has shape \(2, 2\), stream \(3,\)"):
        rx.begin(TensorMeta("weight", (3,), "float32"))


def test_sync_group_generations_and_tp_channel() -> None:
    """SyncGroup over a shared store: generation 1 with one receiver, generation 2 with two, each
    a fresh gloo group; then a TP channel that carries only rank 1's slices."""
    store = dist.HashStore()
    groups = {m: SyncGroup(store, m, timeout=30, bucket_bytes=500) for m in ("src", "a", "b")}
    w1, w2 = sync_procs.weights(1), sync_procs.weights(2)

    def member(m: str, gen: int, members: list[str], w: dict[str, torch.Tensor]) -> Any:
        g = groups[m]
        g.rebuild(members, gen)
        if not g.active:
            return None
        if g.is_source:
            return g.push(w.items(), version=gen)
        rx = WeightReceiver()
        g.receive(rx)
        return tensor_digest(rx.tensors.items()), rx.version

    res = _threads(*[lambda m=m: member(m, 1, ["src", "a"], w1) for m in groups])
    assert res[0].members == ["a"] and res[1] == (tensor_digest(w1.items()), 1) and res[2] is None
    res = _threads(*[lambda m=m: member(m, 2, ["src", "a", "b"], w2) for m in groups])
    assert res[0].members == ["a", "b"] and res[1] == res[2] == (tensor_digest(w2.items()), 2)

    plan = ReshardPlan.for_tensors(w2.items(), 2, default_tp_rules(head_dim=8))
    ch = {m: SyncGroup(store, m, prefix="tp1", timeout=30) for m in ("src", "b")}
    rx = WeightReceiver()

    def tp_member(m: str) -> Any:
        ch[m].rebuild(["src", "b"], 1)
        return ch[m].push(w2.items(), 2, plan=plan, tp_rank=1) if m == "src" else ch[m].receive(rx)

    _threads(*[lambda m=m: tp_member(m) for m in ch])
    for name, full in w2.items():
        assert torch.equal(rx.tensors[name], plan.shard(name, 1).take(full)), name
    assert rx.tensors["model.layers.0.mlp.down_proj.weight"].shape == (32, 32)


def test_rebuild_rejects_bad_membership() -> None:
    g = SyncGroup(dist.HashStore(), "src")
    with pytest.raises(ValueError, match="distinct"):
        g.rebuild(["src", "src"], 1)
    g.rebuild(["src"], 1)
    with pytest.raises(ValueError, match="generation must increase"):
        g.rebuild(["src"], 1)
    assert g.push([("x", torch.ones(2))], version=1).members == []


@pytest.mark.gpu
def test_cuda_tensors_through_device_buffers() -> None:
    """GPU: CUDA source tensors, device="cuda" bucket buffers, one receiver writing a CUDA model in
    place and one collecting on the CPU (gloo moves CUDA tensors; NCCL needs 2 GPUs)."""
    store = dist.HashStore()
    src = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Linear(256, 8)).cuda().to(torch.bfloat16)
    dst = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Linear(256, 8)).cuda().to(torch.bfloat16)
    pgs = _threads(
        *[lambda r=r: dist.ProcessGroupGloo(dist.PrefixStore("g/", store), r, 3) for r in range(3)]
    )
    cpu_rx = WeightReceiver()
    _threads(
        lambda: bucketed_broadcast(src.named_parameters(), pgs[0], 0, 4096, device="cuda"),
        lambda: receive_broadcast(WeightReceiver(dst), pgs[1], 0, device="cuda"),
        lambda: receive_broadcast(cpu_rx, pgs[2], 0, device="cuda"),
    )
    for (name, p), (_, q) in zip(src.named_parameters(), dst.named_parameters()):
        assert torch.equal(p, q) and torch.equal(p.cpu(), cpu_rx.tensors[name]), name


def test_a_gpu_collective_that_never_completes_gives_up_within_the_timeout() -> None:
    """`buckets.complete` on a GPU device polls `Work.is_completed()` instead of trusting
    `wait()` (which, under NCCL, only orders streams): a broadcast whose source never posts raises
    TimeoutError after the timeout, and one that completes returns its data. Real gloo works; the
    device only selects the polling path."""
    from datetime import timedelta

    from rlhf_trainer.sync.buckets import complete

    store = dist.HashStore()
    pgs = _threads(
        *[lambda r=r: dist.ProcessGroupGloo(dist.PrefixStore("t/", store), r, 2) for r in range(2)]
    )
    opts = dist.BroadcastOptions()
    opts.rootRank, opts.rootTensor, opts.timeout = 0, 0, timedelta(seconds=60)
    got = torch.zeros(4)
    work = pgs[1].broadcast([got], opts)  # the source has posted nothing yet
    with pytest.raises(TimeoutError, match="did not complete within 0.2s"):
        complete(work, 0.2, torch.device("cuda"))
    pgs[0].broadcast([torch.arange(4.0)], opts).wait()  # now it does: the receive completes
    complete(work, 30.0, torch.device("cuda"))
    assert torch.equal(got, torch.arange(4.0))


def test_nccl_streams_only_to_members_marked_ready_in_the_store() -> None:
    """The NCCL path's handshake (the CPU part): the source names the receivers that did not mark
    themselves ready within the timeout (a NCCL communicator's creation would wait for them with
    no timeout); gloo needs no handshake."""
    store = dist.HashStore()
    nccl = SyncGroup(store, "actor", timeout=0.3, backend="nccl", device="cpu")
    store.set("b/ready/r1", "1")
    assert nccl._unready("b", ["r1", "r2"]) == ["r2"]
    store.set("b/ready/r2", "1")
    assert nccl._unready("b", ["r1", "r2"]) == []
    assert SyncGroup(store, "actor", timeout=0.3)._unready("c", ["r1"]) == []


def test_the_nccl_group_is_built_with_communicator_only_error_handling(monkeypatch) -> None:
    """`TORCH_NCCL_ASYNC_ERROR_HANDLING` is 2 while the sync group is constructed and the pod's own
    value (1: tear down, for gang restarts) is back afterwards."""
    from rlhf_api import contract

    var = contract.ENV_TORCH_NCCL_ASYNC_ERROR_HANDLING
    monkeypatch.setenv(var.name, "1")
    with var.overridden("2"):
        assert var.get() == "2"
    assert var.get() == "1"
    monkeypatch.delenv(var.name)
    with var.overridden("2"):
        assert var.get() == "2"
    assert not var.is_set()
