"""Multi-turn rollouts: the calculator environment, the episode loop over the hf engine, the loss
mask on a recorded batch, the trainer's forward over environment tokens, GAE across them."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from rlhf_trainer.environments import EnvStep, Episode, Turn, build_environment
from rlhf_trainer.environments.calculator import CalculatorEnv, evaluate
from rlhf_trainer.rollout import RolloutBatch
from rlhf_trainer.rollout.hf import HFRolloutEngine
from rlhf_trainer.rollout.multiturn import (
    add_environment_rewards,
    final_turns,
    observation_counts,
    rollout_episodes,
    stop_cut,
)

PROMPTS = ["1+2=", "13+4=", "7*8=", "hello"]


class ScriptedEnv:
    """Answers `obs<k>|` to every model turn, `answers[prompt]` times, then says done; each answer
    is recorded with its episode (so the test knows which tokens the environment wrote)."""

    def __init__(self, answers: dict[str, int], reward: float = 0.5):
        self.answers, self.reward = answers, reward
        self.written: list[tuple[Episode, list[int]]] = []

    def step(self, episode: Episode) -> EnvStep:
        k = episode.state.get("k", 0)
        if k >= self.answers[episode.prompt]:
            return EnvStep(done=True, reward=1.0)
        episode.state["k"] = k + 1
        return EnvStep(observation=f"obs{k}|", reward=self.reward)


def _engine(tiny_lm: tuple[Any, Any], **kw: Any) -> HFRolloutEngine:
    model, tok = tiny_lm
    return HFRolloutEngine(model, tok, **{"max_new_tokens": 5, "temperature": 1.0, "seed": 0, **kw})


def _episodes(
    tiny_lm: tuple[Any, Any], answers: dict[str, int], n: int = 2, **kw: Any
) -> tuple[RolloutBatch, ScriptedEnv]:
    _, tok = tiny_lm
    env = ScriptedEnv(answers)
    batch = rollout_episodes(
        _engine(tiny_lm), tok, env, [tok(p).input_ids for p in PROMPTS], n,
        max_turns=kw.get("max_turns", 4), max_total_tokens=kw.get("max_total_tokens", 200),
    )  # fmt: skip
    return batch, env


# -- the calculator ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("expression", "value"),
    [("2+3", "5"), ("37*48", "1776"), ("7/2", "3.5"), ("-(4-6)**2", "-4"), ("8/4", "2")],
)
def test_the_calculator_evaluates_arithmetic(expression: str, value: str) -> None:
    assert evaluate(expression) == value


@pytest.mark.parametrize("expression", ["__import__('os').getcwd()", "x+1", "1/0", "9**9**9", "2+", "1" * 80])
def test_the_calculator_refuses_what_is_not_bounded_arithmetic(expression: str) -> None:
    assert evaluate(expression).startswith("error:")


def test_the_calculator_answers_a_call_and_ends_on_a_turn_without_one() -> None:
    env = build_environment("rlhf_trainer.environments.calculator:CalculatorEnv", {"callReward": -0.1})
    assert isinstance(env, CalculatorEnv) and env.stop == ["</tool>"]
    episode = Episode(prompt="37*48=", prompt_ids=[1], turns=[Turn("model", "<tool>37*48</tool>", [5])])
    answer = env.step(episode)
    assert (answer.observation, answer.reward, answer.done) == ("<result>1776</result>", -0.1, False)
    episode.turns += [Turn("env", answer.observation, [6]), Turn("model", "1776", [7])]
    assert env.step(episode).done


def test_a_bad_environment_is_refused_naming_the_field() -> None:
    with pytest.raises(ValueError, match=r"spec\.rollout\.multiTurn\.environment.*no_such_module"):
        build_environment("no_such_module:Env")
    with pytest.raises(TypeError, match=r"multiTurn\.kwargs"):
        build_environment("rlhf_trainer.environments.calculator:CalculatorEnv", {"bogus": 1})
    with pytest.raises(TypeError, match="not a class"):
        build_environment("rlhf_trainer.environments.calculator:evaluate")


# -- the episode loop ----------------------------------------------------------------------------


def test_every_environment_token_has_mask_0_and_every_model_token_1(tiny_lm: tuple[Any, Any]) -> None:
    """On a recorded batch: rebuild each row from the episode's turns (the model's tokens as the
    engine sampled them, the environment's as it wrote them) and compare position by position."""
    _, tok = tiny_lm
    answers = {"1+2=": 0, "13+4=": 1, "7*8=": 2, "hello": 3}
    batch, env = _episodes(tiny_lm, answers, n=2)
    assert batch.observation_mask is not None and batch.turns is not None
    assert len(batch) == 8 and batch.prompt_index == [0, 0, 1, 1, 2, 2, 3, 3]
    pad = batch.pad_token_id
    for row in range(len(batch)):
        prompt = PROMPTS[batch.prompt_index[row]]
        expected_env = answers[prompt]
        assert int(batch.turns[row]) == expected_env + 1  # episodes that end early leave the batch
        assert int(observation_counts(batch.observation_mask)[row]) == expected_env
        ids, mask = batch.response_ids[row], batch.response_mask[row]
        obs = batch.observation_mask[row]
        assert bool(((mask > 0) & (obs > 0)).sum() == 0)  # no token is both
        env_text = tok.decode(ids[obs > 0].tolist())
        assert env_text == "".join(f"obs{k}|" for k in range(expected_env))
        assert bool((batch.log_probs[row][obs > 0] == 0).all())
        assert bool((batch.log_probs[row][mask > 0] < 0).all())
        real = int(((mask > 0) | (obs > 0)).sum())
        assert bool((ids[real:] == pad).all()) and bool((mask[real:] == 0).all())
    # the environment's reward on the last model token of each turn it answered, 1.0 at done
    assert torch.allclose(
        batch.turn_rewards.sum(-1),
        torch.tensor([0.5 * answers[PROMPTS[i]] + 1.0 for i in batch.prompt_index]),
    )
    # finished: the environment said done after a turn that ended (EOS), not one cut at maxNewTokens
    ended = [int(r[m > 0][-1]) == tok.eos_token_id for r, m in zip(batch.response_ids, batch.response_mask)]
    assert batch.finished.tolist() == ended


def test_the_turn_and_token_budgets_end_episodes_as_truncated(tiny_lm: tuple[Any, Any]) -> None:
    answers = {p: 10 for p in PROMPTS}
    batch, _ = _episodes(tiny_lm, answers, n=1, max_turns=3)
    assert batch.turns.tolist() == [3, 3, 3, 3] and not bool(batch.finished.any())
    assert observation_counts(batch.observation_mask).tolist() == [2, 2, 2, 2]  # none after the last turn
    batch, _ = _episodes(tiny_lm, answers, n=1, max_total_tokens=12)
    lengths = (batch.response_mask + batch.observation_mask).sum(-1)
    assert bool((lengths <= 12).all()) and not bool(batch.finished.any())


def test_the_same_seed_gives_the_same_episodes(tiny_lm: tuple[Any, Any]) -> None:
    answers = {"1+2=": 0, "13+4=": 1, "7*8=": 2, "hello": 3}
    a, _ = _episodes(tiny_lm, answers)
    b, _ = _episodes(tiny_lm, answers)
    assert torch.equal(a.response_ids, b.response_ids) and torch.equal(a.log_probs, b.log_probs)


def test_a_turn_ends_right_after_the_stop_string(tiny_lm: tuple[Any, Any]) -> None:
    _, tok = tiny_lm
    ids = tok("ab<tool>1+1</tool>zz", add_special_tokens=False).input_ids
    assert tok.decode(ids[: stop_cut(tok, ids, ["</tool>"])]) == "ab<tool>1+1</tool>"
    assert stop_cut(tok, ids, ["</nope>"]) is None


def test_final_turn_is_the_text_after_the_last_observation(tiny_lm: tuple[Any, Any]) -> None:
    _, tok = tiny_lm
    answers = {"1+2=": 0, "13+4=": 1, "7*8=": 2, "hello": 3}
    batch, env = _episodes(tiny_lm, answers, n=1)
    finals = final_turns(batch, tok)
    full = [
        tok.decode(r[m > 0].tolist(), skip_special_tokens=True)
        for r, m in zip(batch.response_ids, batch.response_mask)
    ]
    assert finals[0] == full[0]  # no observation: the whole response
    for text, whole in zip(finals[1:], full[1:]):
        assert whole.endswith(text) and len(text) < len(whole)


# -- the trainer over the holes ------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["padded", "trimmed", "packed"])
def test_the_trainer_scores_model_tokens_as_the_engine_sampled_them(
    tiny_lm: tuple[Any, Any], layout: str
) -> None:
    """The actor's teacher-forced log-probs equal the engine's at every model token, the
    environment's tokens attended to (in every forward layout); without `observation_mask` they
    would not be (the control)."""
    from rlhf_trainer.workers.modeling import packable, token_log_probs

    model, _ = tiny_lm
    batch, _ = _episodes(tiny_lm, {"1+2=": 0, "13+4=": 1, "7*8=": 2, "hello": 3})
    data = {k: v for k, v in batch.to_dict().items() if isinstance(v, torch.Tensor)}
    assert layout != "packed" or packable(data)
    with torch.no_grad():
        logp, _ = token_log_probs(model, data, layout=layout)
        blind, _ = token_log_probs(
            model, {k: v for k, v in data.items() if k != "observation_mask"}, layout="trimmed"
        )
    model_tokens = batch.response_mask > 0
    assert torch.allclose(logp[model_tokens], batch.log_probs[model_tokens], atol=1e-4)
    later = model_tokens & (batch.observation_mask.cumsum(-1) > 0)  # model tokens after an observation
    assert bool(later.any())
    assert not torch.allclose(blind[later], batch.log_probs[later], atol=1e-3)


def test_gae_carries_across_the_environment_tokens() -> None:
    """GAE over a response with holes equals GAE over the same model tokens laid end to end."""
    from rlhf_trainer.algorithms.advantages import gae

    torch.manual_seed(0)
    mask = torch.tensor([[1, 1, 0, 0, 1, 1, 0, 1], [1, 0, 1, 1, 1, 0, 0, 0]], dtype=torch.float32)
    rewards, values = torch.randn(2, 8) * mask, torch.randn(2, 8)
    adv, ret = gae(rewards, values, mask, gamma=0.9, lam=0.8, whiten_advantages=False)
    for r in range(2):
        keep = mask[r] > 0
        a, b = gae(
            rewards[r : r + 1, keep],
            values[r : r + 1, keep],
            mask[r : r + 1, keep],
            gamma=0.9,
            lam=0.8,
            whiten_advantages=False,
        )
        assert torch.allclose(adv[r, keep], a[0]) and torch.allclose(ret[r, keep], b[0])
        assert bool((adv[r, ~keep] == 0).all())


def test_environment_rewards_join_the_score_and_sit_on_each_turn() -> None:
    from rlhf_trainer.dataflow import StepBatch

    mask = torch.tensor([[1, 1, 0, 0, 1, 0], [1, 1, 1, 0, 0, 0]], dtype=torch.float32)
    turn = torch.tensor([[0, 0.5, 0, 0, 0, 0], [0, 0, 0.25, 0, 0, 0]])
    batch = StepBatch(tensors={"response_mask": mask, "turn_rewards": turn}, prompts=["a", "b"])
    scores = add_environment_rewards(batch, torch.tensor([1.0, float("nan")]))
    assert scores[0] == 1.5 and torch.isnan(scores[1])  # a failed reward stays failed
    expected = torch.tensor([[0, 0.5, 0, 0, 1.0, 0], [0, 0, 0.25, 0, 0, 0]])
    assert torch.equal(batch["token_rewards"], expected)


def test_concat_and_select_keep_the_episode_fields(tiny_lm: tuple[Any, Any]) -> None:
    a, _ = _episodes(tiny_lm, {"1+2=": 0, "13+4=": 1, "7*8=": 2, "hello": 3}, n=1)
    model, tok = tiny_lm
    plain = HFRolloutEngine(model, tok, max_new_tokens=3, seed=0).generate([tok("9").input_ids])
    both = RolloutBatch.concat([a, plain], offset_prompt_index=True)
    assert both.observation_mask is not None and both.turns is None  # the plain part has no turns
    assert torch.equal(both.observation_mask[:4, : a.observation_mask.shape[1]], a.observation_mask)
    assert bool((both.observation_mask[4] == 0).all())
    picked = a.select([3, 1])
    assert torch.equal(picked.observation_mask, a.observation_mask[[3, 1]])
    assert picked.turns.tolist() == [a.turns[3].item(), a.turns[1].item()]


# -- the snippet of docs/multiturn.md ------------------------------------------------------------


def _doc_environment() -> type:
    """The environment class of docs/multiturn.md's first Python block, executed."""
    from pathlib import Path

    text = (Path(__file__).resolve().parents[3] / "docs" / "multiturn.md").read_text()
    code = text.split("```python\n", 1)[1].split("```", 1)[0]
    namespace: dict[str, Any] = {}
    exec(compile(code, "docs/multiturn.md", "exec"), namespace)  # noqa: S102 - the project's own doc
    return namespace["RepeatAfterMe"]  # type: ignore[no-any-return]


def test_the_documented_environment_rewards_each_turn() -> None:
    env = _doc_environment()(words=["cat", "dog"])
    episode = Episode(prompt="hi", prompt_ids=[1])
    rewards, observations = [], []
    for said in ["hello", "cat", "cow"]:  # before any ask, the right word, a wrong one
        episode.turns.append(Turn("model", said + "\n", [5]))
        answer = env.step(episode)
        rewards.append(answer.reward)
        observations.append(answer.observation)
        if answer.done:
            break
        episode.turns.append(Turn("env", answer.observation, [6]))
    assert rewards == [0.0, 1.0, 0.0] and answer.done
    assert observations[:2] == ["user: say cat\nmodel: ", "user: say dog\nmodel: "]


def test_the_documented_environment_runs_in_the_episode_loop(tiny_lm: tuple[Any, Any]) -> None:
    _, tok = tiny_lm
    env = _doc_environment()()
    batch = rollout_episodes(
        _engine(tiny_lm), tok, env, [tok(p).input_ids for p in PROMPTS], 2, max_turns=5, max_total_tokens=200
    )
    assert observation_counts(batch.observation_mask).tolist() == [3] * 8  # three asks, then done
    assert batch.turns.tolist() == [4] * 8
    newline = tok("\n", add_special_tokens=False).input_ids
    for row in range(len(batch)):  # every model turn ends at its first newline, or at maxNewTokens
        runs: list[list[int]] = [[]]
        for t, m, o in zip(batch.response_ids[row], batch.response_mask[row], batch.observation_mask[row]):
            if m > 0:
                runs[-1].append(int(t))
            elif o > 0 and runs[-1]:
                runs.append([])
        assert len(runs) == 4
        for run in runs:
            assert 1 <= len(run) <= 5 and newline[0] not in run[:-1]


def test_an_engine_that_writes_nothing_ends_the_episode(tiny_lm: tuple[Any, Any]) -> None:
    """An engine at its length bound can return an empty turn: the episode ends there (cut), the
    environment is not asked about a turn that was never written."""
    _, tok = tiny_lm
    engine = _engine(tiny_lm)

    class Silent:
        calls = 0

        def generate(
            self, prompts: list[list[int]], n: int = 1, greedy: bool = False, temperature: float | None = None
        ) -> RolloutBatch:
            self.calls += 1
            out = engine.generate(prompts, n, greedy=greedy, temperature=temperature)
            if self.calls > 1:  # later turns: nothing written
                out.response_mask.zero_()
                out.log_probs.zero_()
            return out

    env = ScriptedEnv({p: 5 for p in PROMPTS})
    batch = rollout_episodes(
        Silent(), tok, env, [tok(p).input_ids for p in PROMPTS], max_turns=4, max_total_tokens=100
    )
    assert batch.turns.tolist() == [1] * 4 and observation_counts(batch.observation_mask).tolist() == [1] * 4
    assert not bool(batch.finished.any())
