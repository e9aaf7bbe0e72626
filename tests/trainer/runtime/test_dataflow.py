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


class _FailsOnSeven:
    """A reward with a bug: it raises on a prompt holding a 7 (runtime_rewards.fails_on_seven)."""

    def compute_reward(self, prompts, responses, **_):
        if any("7" in p for p in prompts):
            raise ValueError("cannot score response")
        return [1.0 for _ in responses]


class _LocalRewards:
    """The reward role's `score` call on a real `CombinedReward`, in this process (the Ray group
    only splits rows between workers)."""

    def __init__(self, on_error: str):
        from rlhf_trainer.rewards import CombinedReward

        self.combined = CombinedReward([("fails_on_seven", 1.0, _FailsOnSeven())], on_error=on_error)

    def __len__(self) -> int:
        return 1

    def call_each(self, method, args_list):
        assert method == "score"
        return [self.combined.compute(p, r, c, messages=m) for p, r, c, m, _ in args_list]


def _scored_stream(on_error: str, *after):
    """A seed-style `spec.pipeline` stream: a source, the reward operator, then `after`."""
    from types import SimpleNamespace

    from rlhf_trainer.dataflow import RewardOperator

    def source(_):
        b = _batch()
        b.prompts = ["1+1=", "2+7=", "3+7=", "4+4=", "5+5=", "6+1="]  # two contain a 7
        return b

    ctx = SimpleNamespace(reward=_LocalRewards(on_error), step=0)
    return DataStream([source, RewardOperator(ctx), *after])


def test_a_failed_reward_never_reaches_a_pipeline_as_a_zero():
    """Issue 22: the reward phase wrote 0 for a failed score and only the built-in stream dropped
    it; a seed-style FilterOperator(threshold=-0.5) kept those rows. Now the reward operator drops
    them, counted in `reward/dropped`."""
    sink = Record("sink")
    metrics = DataStream(_scored_stream("skip", FilterOperator(threshold=-0.5), sink).operators).step()
    assert sink.seen == [["1+1=", "4+4=", "5+5=", "6+1="]]
    assert metrics["reward/dropped"] == 2.0 and metrics["reward/invalid"] == 2.0
    assert metrics["filter/filter_dropped"] == 0.0


def test_a_failed_reward_under_penalty_trains_with_the_penalty_and_under_fail_stops():
    sink = Record("sink")
    stream = _scored_stream("penalty", sink)
    metrics = stream.step()
    assert len(sink.seen[0]) == 6 and metrics["reward/dropped"] == 0.0
    assert stream.last_batch["scores"].tolist() == [1.0, -1.0, -1.0, 1.0, 1.0, 1.0]
    with pytest.raises(Exception, match="cannot score response"):
        _scored_stream("fail", sink).step()


def test_the_update_operators_drop_rows_a_stream_scored_itself():
    """A stream that wrote `reward_valid` itself (phases.score in its own operator): the update
    operators drop the failed rows before preparing anything."""
    from rlhf_trainer.dataflow import phases

    batch = _batch()
    batch["reward_valid"] = torch.tensor([True, False, True, True, True, False])
    out = phases.drop_invalid_rewards(batch)
    assert out.prompts == ["p0", "p2", "p3", "p4"] and out.metrics["reward/dropped"] == 2.0
    again = phases.drop_invalid_rewards(out)
    assert len(again) == 4 and again.metrics["reward/dropped"] == 2.0
    routed = Record("routed")
    metrics = DataStream(
        [lambda _: batch, ConditionalUpdateOperator(lambda b: b["scores"] >= 0, routed)]
    ).step()
    assert routed.seen == [["p0", "p2", "p3", "p4"]] and metrics["reward/dropped"] == 2.0


def _round_batch(scores: list[float], width: int, name: str) -> StepBatch:
    """A scored round of len(scores) / 2 prompts, two samples each, responses `width` wide."""
    n = len(scores)
    return StepBatch(
        tensors={
            "response_mask": torch.ones(n, width),
            "prompt_ids": torch.ones(n, width + 1, dtype=torch.long),
            "scores": torch.tensor(scores),
            "group_index": torch.arange(n) // 2,
        },
        prompts=[f"{name}{i // 2}" for i in range(n)],
        responses=[f"r{i}" for i in range(n)],
        columns=[{} for _ in range(n)],
        metrics={"reward/mean": 0.5},
    )


class _Rounds:
    """DynamicSamplingOperator whose extra rounds are prepared batches (the real ones generate
    and score on the workers: tests/trainer/runtime/test_dapo.py)."""

    def __new__(cls, prompts_per_step: int, max_extra_rounds: int, rounds: list[StepBatch]):
        from types import SimpleNamespace

        from rlhf_trainer.dataflow import DynamicSamplingOperator

        spec = SimpleNamespace(
            training=SimpleNamespace(prompts_per_step=prompts_per_step),
            algorithm=SimpleNamespace(dynamic_sampling=SimpleNamespace(max_extra_rounds=max_extra_rounds)),
        )
        op = DynamicSamplingOperator(SimpleNamespace(spec=spec))
        queue = list(rounds)
        op._round = lambda: queue.pop(0) if queue else None  # type: ignore[method-assign]
        return op


def test_dynamic_sampling_oversamples_until_full_and_its_counts_add_up():
    first = _round_batch([1, 1, 0, 1, 0, 0], 3, "a")  # a0 uniform, a1 varied, a2 uniform
    second = _round_batch([1, 0, 1, 1, 0, 1], 5, "b")  # b0, b2 varied, b1 uniform
    op = _Rounds(prompts_per_step=3, max_extra_rounds=3, rounds=[second])
    out = op(first)
    assert out.prompts == ["a1", "a1", "b0", "b0", "b2", "b2"]
    assert out["response_mask"].shape == (6, 5) and out["response_mask"][:2].sum() == 6  # re-padded
    assert out["prompt_ids"].shape == (6, 6) and out["prompt_ids"][0, 0] == 0  # prompts padded on the left
    assert len(torch.unique(out["group_index"])) == 3
    m = out.metrics
    assert m["dynamic_sampling/rounds"] == 1.0 and m["dynamic_sampling/groups_kept"] == 3.0
    assert m["dynamic_sampling/groups_generated"] == 6.0 and m["dynamic_sampling/groups_uniform"] == 3.0
    assert m["dynamic_sampling/groups_generated"] == sum(
        m[f"dynamic_sampling/groups_{k}"] for k in ("kept", "uniform", "surplus")
    )
    assert m["reward/mean"] == 0.5  # the first round's metrics stay


def test_dynamic_sampling_leaves_surplus_groups_out_and_stops_at_its_bound():
    varied = _round_batch([1, 0, 0, 1, 1, 0], 3, "a")
    out = _Rounds(prompts_per_step=2, max_extra_rounds=3, rounds=[])(varied)
    assert out.prompts == ["a0", "a0", "a1", "a1"]
    assert out.metrics["dynamic_sampling/groups_surplus"] == 1.0
    assert out.metrics["dynamic_sampling/rounds"] == 0.0
    uniform = [_round_batch([1, 1, 0, 0], 2, x) for x in "abcd"]
    out = _Rounds(prompts_per_step=2, max_extra_rounds=2, rounds=uniform[1:])(uniform[0])
    assert len(out) == 0 and out.metrics["dynamic_sampling/rounds"] == 2.0  # bounded: a, b, c only
    assert out.metrics["dynamic_sampling/groups_generated"] == 6.0
    assert out.metrics["dynamic_sampling/groups_kept"] == 0.0


def test_the_truncation_flag_and_length_reach_the_reward_functions_as_columns():
    from rlhf_trainer.dataflow import phases
    from rlhf_trainer.rollout import RolloutBatch

    rollout = RolloutBatch(
        prompt_ids=torch.ones(3, 2, dtype=torch.long),
        prompt_mask=torch.ones(3, 2, dtype=torch.long),
        response_ids=torch.ones(3, 4, dtype=torch.long),
        response_mask=torch.tensor([[1.0, 1, 0, 0], [1, 1, 1, 1], [1, 1, 1, 1]]),
        log_probs=torch.zeros(3, 4),
        finished=torch.tensor([True, False, True]),  # row 2 ended with EOS on its last token
    )
    truncated = phases.truncated_rows(rollout, max_new_tokens=4)
    assert truncated.tolist() == [False, True, False]
    rollout.finished = None  # an engine that does not say: judged by length
    assert phases.truncated_rows(rollout, max_new_tokens=4).tolist() == [False, True, True]
    batch = StepBatch(
        tensors={"response_mask": rollout.response_mask, "truncated": truncated},
        prompts=["p", "q", "r"],
        columns=[{"answer": "1"}, {"answer": "2", "truncated": "dataset's"}, {}],
    )
    assert phases.reward_columns(batch) == [
        {"answer": "1", "truncated": False, "response_length": 2},
        {"answer": "2", "truncated": True, "response_length": 4},
        {"truncated": False, "response_length": 4},
    ]


def test_a_reward_function_naming_truncated_gets_it_through_the_reward_phase():
    from types import SimpleNamespace

    from rlhf_trainer.dataflow import phases
    from rlhf_trainer.rewards import CombinedReward, FunctionReward

    def stops(prompts, responses, truncated, response_length):
        return [-1.0 if cut else float(n) for cut, n in zip(truncated, response_length)]

    class Rewards(_LocalRewards):
        def __init__(self):
            self.combined = CombinedReward([("stops", 1.0, FunctionReward(stops))])

    batch = _batch()
    batch["truncated"] = torch.tensor([False, True, False, False, True, False])
    batch["response_mask"] = torch.tensor([[1.0, 0, 0]] * 3 + [[1.0, 1, 1]] * 3)
    out = phases.score(SimpleNamespace(reward=Rewards(), step=0), batch)
    assert out["scores"].tolist() == [1.0, -1.0, 1.0, 3.0, -1.0, 3.0]
