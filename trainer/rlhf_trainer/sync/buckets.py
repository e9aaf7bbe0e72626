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


class SendWindow:
    """The sender's messages in flight: at most `max_inflight` of them, at most two holding a
    bucket buffer of `buf_size` bytes (a zero-copy message, sent from the caller's tensor, holds
    none). Completing the oldest message frees its buffer for the next packed one."""

    def __init__(
        self,
        group: Group,
        src: int,
        timeout: float | None,
        device: torch.device,
        buf_size: int,
        max_inflight: int,
    ):
        self.group, self.src, self.timeout, self.device = group, src, timeout, device
        self.buf_size, self.max_inflight = buf_size, max_inflight
        self.free: list[torch.Tensor] = []
        self.allocated = 0
        self.inflight: deque[tuple[Any, torch.Tensor | None, torch.Tensor]] = (
            deque()
        )  # (work, buffer, sent view)

    @property
    def buffer_bytes(self) -> int:
        """Bytes held by the bucket buffers allocated so far (never more than two)."""
        return self.allocated * self.buf_size

    def retire_oldest(self) -> None:
        work, buf, _ = self.inflight.popleft()
        complete(work, self.timeout, self.device)
        if buf is not None:
            self.free.append(buf)

    def acquire(self) -> torch.Tensor:
        """A free bucket buffer: a new one while fewer than two exist, else the oldest's back."""
        if not self.free and self.allocated < 2:
            self.free.append(torch.empty(self.buf_size, dtype=torch.uint8, device=self.device))
            self.allocated += 1
        while not self.free:
            self.retire_oldest()
        return self.free.pop()

    def post(self, view: torch.Tensor, buf: torch.Tensor | None) -> None:
        # Zero-copy messages cost no memory in flight; buffered ones are bounded by acquire().
        while len(self.inflight) >= self.max_inflight:
            self.retire_oldest()
        self.inflight.append((_bcast(self.group, view, self.src, self.timeout), buf, view))

    def drain(self) -> None:
        while self.inflight:
            self.retire_oldest()


class SourceTensors:
    """The stream's tensors as the sender reaches them: materialized strictly in order (DTensor
    gathers are collectives matched by the other FSDP ranks' `drain_full_tensors`), transformed,
    checked against the header's `metas`, and dropped as soon as the stream moves past them, so at
    most one materialized tensor is held. `held` is the bytes of that copy (0 when the tensor is
    sent in place); the largest is recorded in `stats.largest_materialized_bytes`."""

    def __init__(
        self,
        items: Sequence[tuple[str, torch.Tensor]],
        metas: Sequence[TensorMeta],
        transform: Callable[[str, torch.Tensor], torch.Tensor] | None,
        device: torch.device,
        stats: SyncStats,
    ):
        self.items, self.metas, self.transform, self.device, self.stats = (
            items,
            metas,
            transform,
            device,
            stats,
        )
        self.index = -1
        self.data = torch.empty(0, dtype=torch.uint8)
        self.in_place = True
        self.held = 0

    def bytes_of(self, i: int) -> tuple[torch.Tensor, bool]:
        """Tensor `i` as flat bytes, and whether they are the caller's own memory on the group's
        device (then a message can be sent straight from them)."""
        while self.index < i:
            self._advance()
        return self.data, self.in_place

    def finish(self) -> None:
        """Reach the last tensor: trailing zero-size tensors still take part in the gathers."""
        self.bytes_of(len(self.items) - 1)

    def _advance(self) -> None:
        self.index += 1
        name, t = self.items[self.index]
        meta = self.metas[self.index]
        self.data = torch.empty(0, dtype=torch.uint8)  # drop the previous one first
        full = materialize(t)
        if self.transform is not None:
            full = self.transform(name, full).contiguous()
        if TensorMeta.of(meta.name, full) != meta:
            raise ValueError(f"tensor {name!r} is {TensorMeta.of(name, full)}, header said {meta}")
        self.in_place = not is_dtensor(t) and full.data_ptr() == t.data_ptr() and full.device == self.device
        self.held = 0 if self.in_place else full.nbytes
        self.stats.largest_materialized_bytes = max(self.stats.largest_materialized_bytes, self.held)
        self.data = _as_bytes(full)


def stream_metas(
    items: Sequence[tuple[str, torch.Tensor]],
    metas: Sequence[TensorMeta] | None,
    transform: Callable[[str, torch.Tensor], torch.Tensor] | None,
) -> Sequence[TensorMeta]:
    """The header's metas: the caller's (required with a transform, which changes shapes), else
    those of the tensors themselves; one per tensor."""
    if metas is None:
        if transform is not None:
            raise ValueError("a transform changes shapes: pass the metas of the transformed tensors")
        metas = [TensorMeta.of(n, t) for n, t in items]
    if len(metas) != len(items):
        raise ValueError(f"{len(metas)} metas for {len(items)} tensors")
    return metas


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
    metas = stream_metas(items, metas, transform)
    pack = default_pack_below(bucket_bytes) if pack_below is None else pack_below
    msgs = plan_messages([m.nbytes for m in metas], bucket_bytes, pack)
    dev = torch.device(device)
    _send_header(group, src, metas, version, timeout, dev, (bucket_bytes, pack))

    total = sum(m.nbytes for m in metas)
    stats = SyncStats(tensors=len(items), bytes=total, version=version, buckets=len(msgs))
    window = SendWindow(group, src, timeout, dev, min(bucket_bytes, total), max_inflight)
    source = SourceTensors(items, metas, transform, dev, stats)
    for msg in msgs:
        if len(msg) == 1:
            i, off, n = msg[0]
            data, in_place = source.bytes_of(i)
            if in_place:  # zero-copy: send straight from the caller's tensor
                window.post(data[off : off + n], None)
                stats.peak_extra_bytes = max(stats.peak_extra_bytes, window.buffer_bytes)
                continue
        buf, pos = window.acquire(), 0
        for i, off, n in msg:
            data, _ = source.bytes_of(i)
            buf[pos : pos + n].copy_(data[off : off + n])
            pos += n
            stats.peak_extra_bytes = max(stats.peak_extra_bytes, window.buffer_bytes + source.held)
        window.post(buf[:pos], buf)
    source.finish()
    window.drain()
    stats.seconds = time.perf_counter() - t0
    return stats


class Sink(Protocol):
    """Where received tensors go. `begin` returns a flat uint8 tensor of `meta.nbytes` to fill
    (the destination's own bytes when possible); `end` is called once it is full. Both are called
    in stream order; `begin` may run a few tensors ahead of the matching `end`."""

    def begin(self, meta: TensorMeta) -> torch.Tensor: ...

    def end(self, meta: TensorMeta, data: torch.Tensor) -> None: ...


class SinkCursor:
    """The receiver's side of the sink protocol: `dst(i)` begins every tensor up to `i` in stream
    order (checking the buffer the sink gives), `received(i, n)` counts bytes in, and
    `finish_ready` ends, in order, every tensor whose bytes have all arrived."""

    def __init__(self, sink: Sink, metas: Sequence[TensorMeta]):
        self.sink, self.metas = sink, metas
        self.remaining = [m.nbytes for m in metas]
        self.dsts: dict[int, torch.Tensor] = {}
        self.begun, self.ended = 0, 0

    def dst(self, i: int) -> torch.Tensor:
        while self.begun <= i:
            meta, size = self.metas[self.begun], self.metas[self.begun].nbytes
            d = self.sink.begin(meta)
            if d.dtype != torch.uint8 or d.numel() != size:
                raise ValueError(f"sink gave {d.dtype} x {d.numel()} for {meta} ({size} bytes)")
            self.dsts[self.begun] = d
            self.begun += 1
        return self.dsts[i]

    def received(self, i: int, n: int) -> None:
        self.remaining[i] -= n

    def finish_ready(self) -> None:
        while self.ended < len(self.metas) and self.remaining[self.ended] == 0:
            self.sink.end(self.metas[self.ended], self.dst(self.ended))
            del self.dsts[self.ended]
            self.ended += 1


class ReceiveWindow:
    """The receives posted ahead of the one being completed: up to `max_inflight` messages, at
    most two of them into bucket buffers. A message holding one tensor's range, whose sink buffer
    is on the group's device, is received straight into that buffer (`direct`)."""

    def __init__(
        self,
        group: Group,
        src: int,
        timeout: float | None,
        device: torch.device,
        msgs: Sequence[Sequence[tuple[int, int, int]]],
        cursor: SinkCursor,
        buf_size: int,
        max_inflight: int,
    ):
        self.group, self.src, self.timeout, self.device = group, src, timeout, device
        self.msgs, self.cursor, self.buf_size, self.max_inflight = msgs, cursor, buf_size, max_inflight
        self.free: list[torch.Tensor] = []
        self.allocated = 0
        self.works: dict[int, tuple[Any, torch.Tensor | None]] = {}
        self.next_post = 0

    def direct(self, m: int) -> bool:
        return len(self.msgs[m]) == 1 and self.cursor.dst(self.msgs[m][0][0]).device == self.device

    def can_post(self, m: int) -> bool:
        return self.direct(m) or bool(self.free) or self.allocated < 2

    def post(self, m: int) -> tuple[Any, torch.Tensor | None]:
        msg = self.msgs[m]
        if self.direct(m):
            i, off, n = msg[0]
            return _bcast(self.group, self.cursor.dst(i)[off : off + n], self.src, self.timeout), None
        if not self.free:
            self.free.append(torch.empty(self.buf_size, dtype=torch.uint8, device=self.device))
            self.allocated += 1
        buf = self.free.pop()
        return _bcast(self.group, buf[: sum(n for _, _, n in msg)], self.src, self.timeout), buf

    def post_ahead(self) -> None:
        while (
            self.next_post < len(self.msgs)
            and len(self.works) < self.max_inflight
            and self.can_post(self.next_post)
        ):
            self.works[self.next_post] = self.post(self.next_post)
            self.next_post += 1

    def complete(self, m: int) -> None:
        """Wait for message `m`, scatter it out of its bucket buffer (if it used one), count its
        bytes in and free the buffer."""
        work, buf = self.works.pop(m)
        complete(work, self.timeout, self.device)
        pos = 0
        for i, off, n in self.msgs[m]:
            if buf is not None:
                self.cursor.dst(i)[off : off + n].copy_(buf[pos : pos + n])
            pos += n
            self.cursor.received(i, n)
        if buf is not None:
            self.free.append(buf)


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
    """The receiving side of `bucketed_broadcast` (the message plan comes with the header).
    Receives are posted up to `max_inflight` messages ahead (at most two of them into bucket
    buffers); a message holding one tensor's range is received straight into the sink's buffer
    for it (the model's own parameter when dtypes match), packed ones into one of two bucket
    buffers and scattered."""
    t0 = time.perf_counter()
    dev = torch.device(device)
    metas, version, (bucket_bytes, pack_below) = _recv_header(group, src, timeout, dev)
    total = sum(m.nbytes for m in metas)
    msgs = plan_messages([m.nbytes for m in metas], bucket_bytes, pack_below)
    cursor = SinkCursor(sink, metas)
    window = ReceiveWindow(group, src, timeout, dev, msgs, cursor, min(bucket_bytes, total), max_inflight)
    window.post_ahead()
    for m in range(len(msgs)):
        window.complete(m)
        cursor.finish_ready()
        if on_bucket is not None:
            on_bucket(m)
        window.post_ahead()
    cursor.finish_ready()
    return SyncStats(
        tensors=len(metas),
        bytes=total,
        buckets=len(msgs),
        seconds=time.perf_counter() - t0,
        version=version,
        peak_extra_bytes=window.allocated * window.buf_size,
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
