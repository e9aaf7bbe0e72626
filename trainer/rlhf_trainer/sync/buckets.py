"""Bucketed broadcast of named tensors: the wire format of a weight sync.

A sync is one *stream* from the source rank to every other rank of a process group:

1. a header: the JSON list of `TensorMeta` (name, shape, dtype) plus the sender's `version`,
   broadcast as a length (int64) and the bytes (uint8);
2. the tensors' bytes in header order, in messages ("buckets") of at most `bucket_bytes`
   (`plan_messages`): a tensor of at least `pack_below` bytes (1 MiB by default) travels alone, a
   larger one than a bucket in bucket-sized chunks, so the bucket size bounds memory whatever the
   largest tensor is; smaller tensors are packed together. Both sizes are in the header.

Both sides work on `uint8` views, so any dtype (bf16 included) travels bit-exactly over gloo.

At most two messages are in flight. A message that is one tensor's range travels straight from
the caller's tensor and, on a receiver whose parameter has the stream's dtype, straight into the
parameter: no copy on either side. Only packed small tensors go through a bucket buffer.

Memory on the sender: at most two bucket buffers plus the tensor being copied when it has to be
materialized: a DTensor
(FSDP2 shard) is gathered with `full_tensor()` only when the stream reaches it and dropped once
copied, so the extra peak is `2 * bucket_bytes + largest parameter` — never the whole model. Every
rank of the FSDP mesh has to take part in those gathers in the same order: the ranks that are not
the sync source call `drain_full_tensors` on the same parameters meanwhile.

`group` is anything with c10d's `broadcast(tensors, BroadcastOptions) -> Work` method: a
`torch.distributed.ProcessGroup` (e.g. from `new_group`) or a backend constructed directly, such as
the `ProcessGroupGloo` that `SyncGroup` builds per membership generation. `src` is the source's
rank *within that group*.
"""

from __future__ import annotations

import json
import math
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Protocol

import torch
import torch.distributed as dist

DEFAULT_BUCKET_BYTES = 64 << 20
#: Messages posted ahead. Only messages packed in a bucket buffer hold memory, and there are at
#: most two of those; zero-copy messages in flight let gloo pipeline through its broadcast tree.
DEFAULT_MAX_INFLIGHT = 8


@dataclass(frozen=True)
class TensorMeta:
    """What a receiver needs to place one tensor of the stream."""

    name: str
    shape: tuple[int, ...]
    dtype: str  # "bfloat16", "float32", ... (torch.<dtype>)

    @property
    def torch_dtype(self) -> torch.dtype:
        dt = getattr(torch, self.dtype, None)
        if not isinstance(dt, torch.dtype):
            raise ValueError(f"tensor {self.name!r}: unknown dtype {self.dtype!r}")
        return dt

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.torch_dtype.itemsize

    @staticmethod
    def of(name: str, t: torch.Tensor) -> TensorMeta:
        return TensorMeta(name, tuple(int(s) for s in t.shape), str(t.dtype).removeprefix("torch."))


@dataclass
class SyncStats:
    """What one stream moved, and the sender's peak extra memory (buffers + materialized tensors)."""

    tensors: int = 0
    bytes: int = 0
    buckets: int = 0
    seconds: float = 0.0
    peak_extra_bytes: int = 0
    version: int = 0
    #: Largest tensor gathered or copied to be sent (0 when everything was sent in place).
    largest_materialized_bytes: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


class Group(Protocol):
    def broadcast(self, tensors: list[torch.Tensor], opts: dist.BroadcastOptions) -> Any: ...


def _opts(src: int, timeout: float | None) -> dist.BroadcastOptions:
    o = dist.BroadcastOptions()
    o.rootRank = src
    o.rootTensor = 0
    if timeout is not None:
        o.timeout = timedelta(seconds=timeout)
    return o


def nccl_watchdog_timeout(timeout: float) -> float:
    """The NCCL op timeout of a sync whose CPU-side deadline is `timeout` (`complete`): longer, so
    the CPU gives up and aborts the group before NCCL's watchdog acts on the op."""
    return 2 * timeout + 30


def _bcast(group: Group, t: torch.Tensor, src: int, timeout: float | None) -> Any:
    if t.is_cuda and timeout is not None:
        timeout = nccl_watchdog_timeout(timeout)
    return group.broadcast([t], _opts(src, timeout))


#: How often the CPU looks at a GPU collective that is not done yet (`complete`).
GPU_POLL_SECONDS = 0.0005


def complete(work: Any, timeout: float | None, device: torch.device) -> None:
    """Wait until one collective is done, or raise within `timeout`.

    Gloo (CPU tensors): `Work.wait()`, which the op's own timeout bounds. NCCL (GPU tensors):
    `wait()` only makes the current stream wait, so a dead peer would hang whatever touches the
    data next; instead the CPU polls `Work.is_completed()` (true once the GPU finished it) up to
    `timeout` and then raises `TimeoutError`, and the caller aborts the group (`SyncGroup`). The
    group's own NCCL timeout is set longer, so its watchdog never acts first."""
    if device.type != "cuda" or timeout is None:
        work.wait()
        return
    deadline = time.monotonic() + timeout
    while not work.is_completed():
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"a weight-sync collective did not complete within {timeout:g}s (a member died?)"
            )
        time.sleep(GPU_POLL_SECONDS)
    work.wait()  # raises the collective's error, if it had one


def is_dtensor(t: object) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - old torch
        return False
    return isinstance(t, DTensor)


def materialize(t: torch.Tensor) -> torch.Tensor:
    """The full, local, contiguous value of `t` (a collective for a DTensor)."""
    if is_dtensor(t):
        t = t.full_tensor()  # type: ignore[attr-defined]
    return t.detach().contiguous()


def drain_full_tensors(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Take part in the per-parameter gathers of a sync on an FSDP rank that is not the source."""
    for _, t in named_tensors:
        if is_dtensor(t):
            t.full_tensor()  # type: ignore[attr-defined]


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def _send_header(
    group: Group,
    src: int,
    metas: Sequence[TensorMeta],
    version: int,
    timeout: float | None,
    device: torch.device,
    layout: tuple[int, int],
) -> None:
    payload = json.dumps(
        {
            "version": version,
            "bucket_bytes": layout[0],
            "pack_below": layout[1],
            "tensors": [[m.name, list(m.shape), m.dtype] for m in metas],
        }
    ).encode()
    size = torch.tensor([len(payload)], dtype=torch.int64, device=device)
    complete(_bcast(group, size, src, timeout), timeout, device)
    body = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(device)
    complete(_bcast(group, body, src, timeout), timeout, device)


def _recv_header(
    group: Group, src: int, timeout: float | None, device: torch.device
) -> tuple[list[TensorMeta], int, tuple[int, int]]:
    n = torch.zeros(1, dtype=torch.int64, device=device)
    complete(_bcast(group, n, src, timeout), timeout, device)
    buf = torch.empty(int(n.item()), dtype=torch.uint8, device=device)
    complete(_bcast(group, buf, src, timeout), timeout, device)
    d = json.loads(bytes(buf.cpu().numpy()).decode())
    metas = [TensorMeta(name, tuple(shape), dt) for name, shape, dt in d["tensors"]]
    return metas, int(d["version"]), (int(d["bucket_bytes"]), int(d["pack_below"]))


def default_pack_below(bucket_bytes: int) -> int:
    """Tensors smaller than this are packed: 1 MiB (a message that size amortizes its per-message
    cost), or a quarter bucket when buckets are smaller than 4 MiB."""
    return max(1, min(bucket_bytes // 4, 1 << 20))


def plan_messages(
    sizes: Sequence[int], bucket_bytes: int, pack_below: int | None = None
) -> list[list[tuple[int, int, int]]]:
    """Cut a stream of tensors (byte `sizes`, in order) into messages of at most `bucket_bytes`:
    each message a list of (tensor index, byte offset, length) segments, in stream order.

    Tensors of at least `pack_below` bytes (default `default_pack_below`) travel alone, a larger
    one than a bucket in bucket-sized chunks, so their messages are contiguous ranges of one
    tensor and need no copy on either side; smaller tensors are packed together. The sender puts
    both sizes in the header, so receivers compute the same plan.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
    alone = max(1, default_pack_below(bucket_bytes) if pack_below is None else pack_below)
    msgs: list[list[tuple[int, int, int]]] = []
    cur: list[tuple[int, int, int]] = []
    cur_len = 0
    for i, n in enumerate(sizes):
        if n == 0:
            continue
        if n >= alone:
            if cur:
                msgs.append(cur)
                cur, cur_len = [], 0
            msgs += [[(i, off, min(bucket_bytes, n - off))] for off in range(0, n, bucket_bytes)]
            continue
        if cur_len + n > bucket_bytes:
            msgs.append(cur)
            cur, cur_len = [], 0
        cur.append((i, 0, n))
        cur_len += n
    if cur:
        msgs.append(cur)
    return msgs


def bucketed_broadcast(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    group: Group,
    src: int,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    *,
    version: int = 0,
    timeout: float | None = None,
    transform: Callable[[str, torch.Tensor], torch.Tensor] | None = None,
    metas: Sequence[TensorMeta] | None = None,
    max_inflight: int = DEFAULT_MAX_INFLIGHT,
    device: torch.device | str = "cpu",
    pack_below: int | None = None,
) -> SyncStats:
    """Send `named_tensors` (tensors or DTensors, not yet gathered) from rank `src` of `group`.

    Every other rank of the group calls `receive_broadcast` at the same time. `transform(name, t)`
    maps each materialized tensor to what is sent (a TP shard, a dtype cast); then `metas` must
    describe the transformed tensors, in order. `device` is where the group's collectives
    operate (`cpu` for gloo, the rank's GPU for NCCL): bucket buffers live there, and tensors
    elsewhere are copied through them. Returns the stream's `SyncStats`.
    """
    t0 = time.perf_counter()
    items = list(named_tensors)
    if metas is None:
        if transform is not None:
            raise ValueError("a transform changes shapes: pass the metas of the transformed tensors")
        metas = [TensorMeta.of(n, t) for n, t in items]
    if len(metas) != len(items):
        raise ValueError(f"{len(metas)} metas for {len(items)} tensors")
    pack = default_pack_below(bucket_bytes) if pack_below is None else pack_below
    msgs = plan_messages([m.nbytes for m in metas], bucket_bytes, pack)
    dev = torch.device(device)
    _send_header(group, src, metas, version, timeout, dev, (bucket_bytes, pack))

    total = sum(m.nbytes for m in metas)
    stats = SyncStats(tensors=len(items), bytes=total, version=version, buckets=len(msgs))
    buf_size = min(bucket_bytes, total)
    free: list[torch.Tensor] = []
    allocated = 0
    inflight: deque[tuple[Any, torch.Tensor | None, torch.Tensor]] = deque()  # (work, buffer, sent view)

    def retire_oldest() -> None:
        work, buf, _ = inflight.popleft()
        complete(work, timeout, dev)
        if buf is not None:
            free.append(buf)

    def acquire() -> torch.Tensor:
        nonlocal allocated
        if not free and allocated < 2:
            free.append(torch.empty(buf_size, dtype=torch.uint8, device=dev))
            allocated += 1
        while not free:
            retire_oldest()
        return free.pop()

    def post(view: torch.Tensor, buf: torch.Tensor | None) -> None:
        # Zero-copy messages cost no memory in flight; buffered ones are bounded by acquire().
        while len(inflight) >= max_inflight:
            retire_oldest()
        inflight.append((_bcast(group, view, src, timeout), buf, view))

    # Tensors are materialized strictly in order (DTensor gathers are collectives matched by the
    # other FSDP ranks' drain_full_tensors) and dropped as soon as the stream moves past them.
    cur_i, cur_data, cur_in_place, cur_held = -1, torch.empty(0, dtype=torch.uint8), True, 0

    def tensor(i: int) -> tuple[torch.Tensor, bool]:
        nonlocal cur_i, cur_data, cur_in_place, cur_held
        while cur_i < i:
            cur_i += 1
            name, t = items[cur_i]
            cur_data = torch.empty(0, dtype=torch.uint8)  # drop the previous one first
            full = materialize(t)
            if transform is not None:
                full = transform(name, full).contiguous()
            if TensorMeta.of(metas[cur_i].name, full) != metas[cur_i]:
                raise ValueError(
                    f"tensor {name!r} is {TensorMeta.of(name, full)}, header said {metas[cur_i]}"
                )
            cur_in_place = not is_dtensor(t) and full.data_ptr() == t.data_ptr() and full.device == dev
            cur_held = 0 if cur_in_place else full.nbytes
            stats.largest_materialized_bytes = max(stats.largest_materialized_bytes, cur_held)
            cur_data = _as_bytes(full)
        return cur_data, cur_in_place

    for msg in msgs:
        if len(msg) == 1:
            i, off, n = msg[0]
            data, in_place = tensor(i)
            if in_place:  # zero-copy: send straight from the caller's tensor
                post(data[off : off + n], None)
                stats.peak_extra_bytes = max(stats.peak_extra_bytes, allocated * buf_size)
                continue
        buf, pos = acquire(), 0
        for i, off, n in msg:
            data, _ = tensor(i)
            buf[pos : pos + n].copy_(data[off : off + n])
            pos += n
            stats.peak_extra_bytes = max(stats.peak_extra_bytes, allocated * buf_size + cur_held)
        post(buf[:pos], buf)
    tensor(len(items) - 1)  # trailing zero-size tensors still take part in the gathers
    while inflight:
        retire_oldest()
    stats.seconds = time.perf_counter() - t0
    return stats


class Sink(Protocol):
    """Where received tensors go. `begin` returns a flat uint8 tensor of `meta.nbytes` to fill
    (the destination's own bytes when possible); `end` is called once it is full. Both are called
    in stream order; `begin` may run a few tensors ahead of the matching `end`."""

    def begin(self, meta: TensorMeta) -> torch.Tensor: ...

    def end(self, meta: TensorMeta, data: torch.Tensor) -> None: ...


def receive_broadcast(
    sink: Sink,
    group: Group,
    src: int,
    *,
    timeout: float | None = None,
    on_bucket: Callable[[int], None] | None = None,
    max_inflight: int = DEFAULT_MAX_INFLIGHT,
    device: torch.device | str = "cpu",
) -> SyncStats:
    """The receiving side of `bucketed_broadcast` (the message plan comes with the header). Receives are posted up
    to `max_inflight` messages ahead (at most two of them into bucket buffers); a message holding one tensor's range is received straight into the sink's
    buffer for it (the model's own parameter when dtypes match), packed ones into one of two
    bucket buffers and scattered."""
    t0 = time.perf_counter()
    dev = torch.device(device)
    metas, version, (bucket_bytes, pack_below) = _recv_header(group, src, timeout, dev)
    sizes = [m.nbytes for m in metas]
    total = sum(sizes)
    msgs = plan_messages(sizes, bucket_bytes, pack_below)
    buf_size = min(bucket_bytes, total)
    remaining = list(sizes)
    dsts: dict[int, torch.Tensor] = {}
    begun, ended = 0, 0
    free: list[torch.Tensor] = []
    allocated = 0

    def dst(i: int) -> torch.Tensor:
        nonlocal begun
        while begun <= i:
            d = sink.begin(metas[begun])
            if d.dtype != torch.uint8 or d.numel() != sizes[begun]:
                raise ValueError(
                    f"sink gave {d.dtype} x {d.numel()} for {metas[begun]} ({sizes[begun]} bytes)"
                )
            dsts[begun] = d
            begun += 1
        return dsts[i]

    def finish_ready() -> None:
        nonlocal ended
        while ended < len(metas) and remaining[ended] == 0:
            sink.end(metas[ended], dst(ended))
            del dsts[ended]
            ended += 1

    def direct(m: int) -> bool:  # one tensor's range, and the sink's buffer is on the group's device
        return len(msgs[m]) == 1 and dst(msgs[m][0][0]).device == dev

    def can_post(m: int) -> bool:
        return direct(m) or bool(free) or allocated < 2

    def post(m: int) -> tuple[Any, torch.Tensor | None]:
        nonlocal allocated
        msg = msgs[m]
        if direct(m):
            i, off, n = msg[0]
            return _bcast(group, dst(i)[off : off + n], src, timeout), None
        if not free:
            free.append(torch.empty(buf_size, dtype=torch.uint8, device=dev))
            allocated += 1
        buf = free.pop()
        return _bcast(group, buf[: sum(n for _, _, n in msg)], src, timeout), buf

    works: dict[int, tuple[Any, torch.Tensor | None]] = {}
    next_post = 0

    def post_ahead() -> None:
        nonlocal next_post
        while next_post < len(msgs) and len(works) < max_inflight and can_post(next_post):
            works[next_post] = post(next_post)
            next_post += 1

    post_ahead()
    for m, msg in enumerate(msgs):
        work, buf = works.pop(m)
        complete(work, timeout, dev)
        pos = 0
        for i, off, n in msg:
            if buf is not None:
                dst(i)[off : off + n].copy_(buf[pos : pos + n])
            pos += n
            remaining[i] -= n
        if buf is not None:
            free.append(buf)
        finish_ready()
        if on_bucket is not None:
            on_bucket(m)
        post_ahead()
    finish_ready()
    return SyncStats(
        tensors=len(metas),
        bytes=total,
        buckets=len(msgs),
        seconds=time.perf_counter() - t0,
        version=version,
        peak_extra_bytes=allocated * buf_size,
    )


class WeightReceiver:
    """A `Sink` that writes into a model's parameters and buffers (by name), or, with no model,
    collects the tensors in `tensors`; `targets` maps stream names to destination tensors directly
    (for an engine whose names differ). Same dtype and contiguous destinations are written in place
    with no extra copy; others go through a temporary and are cast (e.g. a bf16 stream into an fp32
    model). `strict` rejects a name the model lacks; `version` is the sender's policy version of
    the last completed stream (set by `SyncGroup.receive`)."""

    def __init__(
        self,
        model: torch.nn.Module | None = None,
        *,
        targets: dict[str, torch.Tensor] | None = None,
        strict: bool = True,
        device: torch.device | str = "cpu",
    ):
        self.device = torch.device(device)  # where collected (model-less) tensors are kept
        self.targets = targets
        if model is not None:
            self.targets = {**dict(model.named_parameters()), **dict(model.named_buffers())}
        self.strict = strict
        self.tensors: dict[str, torch.Tensor] = {}
        self.received: list[str] = []
        self.version: int | None = None

    def begin(self, meta: TensorMeta) -> torch.Tensor:
        if self.targets is None:
            return torch.empty(meta.nbytes, dtype=torch.uint8, device=self.device)
        target = self.targets.get(meta.name)
        if target is None:
            if self.strict:
                raise KeyError(f"received tensor {meta.name!r} that the model does not have")
            return torch.empty(meta.nbytes, dtype=torch.uint8)
        if tuple(target.shape) != meta.shape:
            raise ValueError(
                f"tensor {meta.name!r}: model has shape {tuple(target.shape)}, stream {meta.shape}"
            )
        if target.dtype == meta.torch_dtype and target.is_contiguous():
            return _as_bytes(target.data)
        return torch.empty(meta.nbytes, dtype=torch.uint8, device=target.device)

    def end(self, meta: TensorMeta, data: torch.Tensor) -> None:
        self.received.append(meta.name)
        value = data.view(meta.torch_dtype).reshape(meta.shape)
        if self.targets is None:
            self.tensors[meta.name] = value
            return
        target = self.targets.get(meta.name)
        if target is None:
            return
        if value.data_ptr() != target.data_ptr():
            with torch.no_grad():
                target.copy_(value)


def tensor_digest(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> str:
    """A SHA-256 over names, dtypes, shapes and bytes (in name order): equal weights, equal digest."""
    import hashlib

    h = hashlib.sha256()
    for name, t in sorted(named_tensors, key=lambda nt: nt[0]):
        full = materialize(t).cpu()
        h.update(f"{name}|{full.dtype}|{tuple(full.shape)}|".encode())
        h.update(_as_bytes(full).numpy().tobytes())
    return h.hexdigest()
