"""DataStream, FilterOperator and ConditionalUpdateOperator on hand-made batches (no workers)."""

from __future__ import annotations

import pytest
import torch

from rlhf_trainer.dataflow import (
    ConditionalUpdateOperator,
    DataStream,
    FilterOperator,
    StepBatch,
    group_mean_at_least,
)


def _batch() -> StepBatch:
    scores = torch.tensor([0.0, 1.0, 0.5, 0.9, 0.1, 0.2])
    return StepBatch(
        tensors={
            "response_mask": torch.ones(6, 3),
            "scores": scores,
            "group_index": torch.tensor([0, 0, 1, 1, 2, 2]),
        },
        prompts=[f"p{i}" for i in range(6)],
        responses=[f"r{i}" for i in range(6)],
        columns=[{} for _ in range(6)],
    )


class Source:
    def __call__(self, batch):
        return _batch()


class Record:
    def __init__(self, name):
        self.name = name
        self.seen: list[list[str]] = []

    def __call__(self, batch):
        self.seen.append(list(batch.prompts))
        batch.metrics[f"{self.name}/rows"] = float(len(batch))
        return batch


def test_stream_runs_operators_in_order_and_returns_metrics():
    sink = Record("sink")
    stream = (
        DataStream().add_operator(Source()).add_operator(FilterOperator(threshold=0.5)).add_operator(sink)
    )
    metrics = stream.step()
    assert sink.seen == [["p1", "p2", "p3"]]
    assert metrics["filter/filter_dropped"] == 3.0
    assert metrics["sink/rows"] == 3.0


def test_conditional_routes_rows_and_prefixes_metrics():
    high, low = Record("high"), Record("low")
    stream = DataStream([Source(), ConditionalUpdateOperator(lambda b: b["scores"] > 0.4, high, low)])
    metrics = stream.step()
    assert high.seen == [["p1", "p2", "p3"]] and low.seen == [["p0", "p4", "p5"]]
    assert metrics["true/high/rows"] == 3.0 and metrics["false/low/rows"] == 3.0


def test_group_condition_keeps_groups_together():
    cond = group_mean_at_least(0.6)
    assert cond(_batch()).tolist() == [False, False, True, True, False, False]


def test_a_stream_without_a_source_is_an_error():
    with pytest.raises(ValueError, match="no operator produced a batch"):
        DataStream().step()
    with pytest.raises(ValueError, match="threshold or a predicate"):
        FilterOperator()


def test_online_dpo_after_a_filter_left_a_group_of_one_trains_on_the_pairs_only():
    """The reward filter dropped a sample: its partner is alone. The advantage phase keeps the
    samples of real pairs (no tie) and counts what it left out; the old code raised."""
    from rlhf_trainer.algorithms import build_algorithm
    from rlhf_trainer.dataflow import phases

    batch = FilterOperator(predicate=lambda b: b["reward_valid"], name="reward_failed")(
        StepBatch(
            tensors={
                "response_mask": torch.ones(6, 3),
                "scores": torch.tensor([1.0, 0.0, 0.5, 0.5, 0.2, 0.0]),
                "reward_valid": torch.tensor([True, True, True, True, True, False]),
                "group_index": torch.tensor([0, 0, 1, 1, 2, 2]),
            },
            prompts=[f"p{i}" for i in range(6)],
            responses=[f"r{i}" for i in range(6)],
            columns=[{} for _ in range(6)],
        )
    )
    out = phases.compute_advantages(None, batch, build_algorithm("online_dpo"))  # type: ignore[arg-type]
    assert out.prompts == ["p0", "p1"]  # group 1 is a tie, group 2 a group of one
    assert out["chosen"].tolist() == [True, False]
    assert out.metrics["dpo/pairs"] == 1.0 and out.metrics["dpo/groups_without_pair"] == 2.0
    assert out.metrics["update/untrained_samples"] == 3.0
    assert out.metrics["filter/reward_failed_dropped"] == 1.0
