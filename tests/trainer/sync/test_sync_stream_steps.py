"""The named steps of a weight-sync stream, each alone (no process group): the sender's
`SourceTensors` (materialize in order, check the header, send in place when it can) and the
receiver's `SinkCursor` (begin in order, end each tensor once all its bytes are in)."""

from __future__ import annotations

import pytest
import torch

from rlhf_trainer.sync.buckets import SinkCursor, SourceTensors, SyncStats, TensorMeta, stream_metas


def test_source_tensors_materialize_in_order_and_send_in_place_when_they_can() -> None:
    seen: list[str] = []

    def transform(name: str, t: torch.Tensor) -> torch.Tensor:
        seen.append(name)
        return t if name != "b" else t.t()  # a transposed view: not the caller's layout, copied

    items = [("a", torch.arange(6.0)), ("b", torch.ones(2, 3)), ("c", torch.zeros(4))]
    metas = [
        TensorMeta("a", (6,), "float32"),
        TensorMeta("b", (3, 2), "float32"),
        TensorMeta("c", (4,), "float32"),
    ]
    stats = SyncStats()
    source = SourceTensors(items, metas, transform, torch.device("cpu"), stats)

    data, in_place = source.bytes_of(1)  # reaching b materializes a first
    assert seen == ["a", "b"]
    assert not in_place and source.held == 24 and data.dtype == torch.uint8 and data.numel() == 24
    assert source.bytes_of(1)[0] is data  # the same tensor again: no second materialization
    assert seen == ["a", "b"]
    source.finish()
    assert seen == ["a", "b", "c"]
    assert source.in_place and source.held == 0
    assert stats.largest_materialized_bytes == 24


def test_source_tensors_refuse_a_tensor_that_differs_from_the_header() -> None:
    items = [("w", torch.ones(2, 2))]
    source = SourceTensors(items, [TensorMeta("w", (4,), "float32")], None, torch.device("cpu"), SyncStats())
    with pytest.raises(ValueError, match=r"tensor 'w' is .*header said"):
        source.bytes_of(0)


def test_stream_metas_need_the_callers_metas_with_a_transform() -> None:
    items = [("w", torch.ones(2))]
    assert stream_metas(items, None, None) == [TensorMeta("w", (2,), "float32")]
    with pytest.raises(ValueError, match="a transform changes shapes"):
        stream_metas(items, None, lambda _n, t: t)
    with pytest.raises(ValueError, match="2 metas for 1 tensors"):
        stream_metas(items, [TensorMeta("w", (2,), "float32")] * 2, None)


class RecordingSink:
    def __init__(self, size_of: dict[str, int] | None = None):
        self.events: list[tuple[str, str]] = []
        self.size_of = size_of or {}

    def begin(self, meta: TensorMeta) -> torch.Tensor:
        self.events.append(("begin", meta.name))
        return torch.zeros(self.size_of.get(meta.name, meta.nbytes), dtype=torch.uint8)

    def end(self, meta: TensorMeta, data: torch.Tensor) -> None:
        self.events.append(("end", meta.name))


def test_sink_cursor_begins_ahead_and_ends_in_order_once_complete() -> None:
    metas = [
        TensorMeta("a", (2,), "float32"),
        TensorMeta("b", (1,), "float32"),
        TensorMeta("c", (1,), "int64"),
    ]
    sink = RecordingSink()
    cursor = SinkCursor(sink, metas)
    cursor.dst(1)  # a later message's receive posted first: a and b begun, in order
    assert sink.events == [("begin", "a"), ("begin", "b")]
    cursor.received(1, 4)  # b complete, but a is not: nothing ends out of order
    cursor.finish_ready()
    assert sink.events == [("begin", "a"), ("begin", "b")]
    cursor.received(0, 8)
    cursor.finish_ready()
    assert sink.events[2:] == [("end", "a"), ("end", "b")]
    cursor.received(2, 8)
    cursor.finish_ready()
    assert sink.events[4:] == [("begin", "c"), ("end", "c")]


def test_sink_cursor_refuses_a_buffer_of_the_wrong_size() -> None:
    cursor = SinkCursor(RecordingSink({"a": 3}), [TensorMeta("a", (2,), "float32")])
    with pytest.raises(ValueError, match=r"sink gave torch.uint8 x 3 .* \(8 bytes\)"):
        cursor.dst(0)
