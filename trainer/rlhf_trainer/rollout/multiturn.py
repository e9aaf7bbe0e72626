"""Multi-turn rollouts: engine -> environment -> engine, batched across episodes.

    batch = rollout_episodes(engine, tokenizer, env, prompt_ids, n, max_turns=4, max_total_tokens=96)

Every round generates one model turn for each live episode in ONE `engine.generate` call (the
first round: `n` samples per prompt, sharing the prompt's prefill; later rounds: one sample per
episode, its context the prompt and everything said so far, as token ids, never re-tokenized
text). The environment (`environments.Environment`) then answers each episode; its observation's
tokens are appended and the episode goes on, or it ends: the environment said `done`, the turn
budget (`max_turns` model turns) or the token budget (`max_total_tokens` response tokens, the
model's and the environment's) ran out. Ended episodes leave the batch; the next round generates
for the others only.

A model turn ends at the engine's end-of-sequence token, at `rollout.maxNewTokens`, or right
after the first of the environment's `stop` strings (its tool call's closing tag): the engine
samples the whole turn, and the tokens after the stop string are dropped, which leaves exactly
the sample of a policy that stops there (no kept token depends on a dropped one).

The result is one `RolloutBatch` row per episode: `response_ids` the turns one after the other,
`response_mask` 1 on the model's tokens and 0 on the environment's (they are not trained on),
`observation_mask` 1 on the environment's, `turn_rewards` each environment reward on the last
model token of the turn it answered, and `turns` the model turns of each episode.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from rlhf_trainer.environments import Environment, Episode, Turn
from rlhf_trainer.rollout.batch import RolloutBatch


@dataclass
class _Trace:
    """One episode's tokens while it runs."""

    episode: Episode
    ids: list[int] = field(default_factory=list)
    model: list[float] = field(default_factory=list)
    """1.0 per model token, 0.0 per environment token (the loss mask)."""
    log_probs: list[float] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    finished: bool = False
    """The environment ended the episode after a complete model turn (not a budget)."""


def rollout_episodes(
    engine: Any,
    tokenizer: Any,
    env: Environment,
    prompt_ids: Sequence[Sequence[int]],
    n: int = 1,
    *,
    greedy: bool = False,
    temperature: float | None = None,
    max_turns: int,
    max_total_tokens: int,
) -> RolloutBatch:
    """`n` episodes per prompt (rows of one prompt adjacent), as the module docstring says."""
    if max_turns < 1 or max_total_tokens < 1:
        raise ValueError(
            f"rollout_episodes: max_turns {max_turns} and max_total_tokens {max_total_tokens} must be >= 1"
        )
    stops = list(getattr(env, "stop", None) or [])
    traces = [
        _Trace(Episode(prompt=tokenizer.decode(list(p), skip_special_tokens=True), prompt_ids=list(p)))
        for p in prompt_ids
        for _ in range(n)
    ]
    first = engine.generate([list(p) for p in prompt_ids], n, greedy=greedy, temperature=temperature)
    live = list(range(len(traces)))
    out = first
    for turn in range(max_turns):
        if turn:
            contexts = [traces[k].episode.prompt_ids + traces[k].ids for k in live]
            out = engine.generate(contexts, 1, greedy=greedy, temperature=temperature)
        last_round = turn == max_turns - 1
        live = [
            k
            for row, k in enumerate(live)
            if _advance(traces[k], out, row, tokenizer, env, stops, max_total_tokens, last_round)
        ]
        if not live:
            break
    return _batch(traces, first, int(first.pad_token_id))


def _advance(
    trace: _Trace,
    out: RolloutBatch,
    row: int,
    tokenizer: Any,
    env: Environment,
    stops: list[str],
    max_total_tokens: int,
    last_round: bool,
) -> bool:
    """Append row `row` of `out` as the episode's next model turn, let the environment answer and
    append its observation; True when the episode goes on to another model turn."""
    keep = out.response_mask[row] > 0
    ids = out.response_ids[row][keep].tolist()
    log_probs = out.log_probs[row][keep].tolist()
    ended = bool(out.finished[row]) if out.finished is not None else len(ids) < out.response_ids.shape[1]
    cut = stop_cut(tokenizer, ids, stops)
    if cut is not None:
        ids, log_probs, ended = ids[:cut], log_probs[:cut], True
    room = max_total_tokens - len(trace.ids)
    if len(ids) > room:
        ids, log_probs, ended = ids[:room], log_probs[:room], False
    if not ids:  # the engine wrote nothing (its length bound): the episode ends, cut
        return False
    trace.ids += ids
    trace.model += [1.0] * len(ids)
    trace.log_probs += log_probs
    trace.rewards += [0.0] * len(ids)
    episode = trace.episode
    episode.turns.append(Turn("model", tokenizer.decode(ids, skip_special_tokens=True), ids))
    episode.truncated = not ended
    answer = env.step(episode)
    trace.rewards[-1] += float(answer.reward)
    if answer.done:
        trace.finished = ended
        return False
    if last_round:
        return False
    obs = answer.observation_ids
    if obs is None:
        obs = tokenizer(answer.observation, add_special_tokens=False).input_ids if answer.observation else []
    if len(trace.ids) + len(obs) >= max_total_tokens:  # no room left for the model to answer it
        return False
    trace.ids += list(obs)
    trace.model += [0.0] * len(obs)
    trace.log_probs += [0.0] * len(obs)
    trace.rewards += [0.0] * len(obs)
    episode.turns.append(Turn("env", answer.observation, list(obs)))
    return True


def stop_cut(tokenizer: Any, ids: list[int], stops: Sequence[str]) -> int | None:
    """The number of leading tokens of `ids` whose text first contains one of `stops` (the turn
    ends after them), or None when the text holds none."""
    if not stops or not ids:
        return None
    text = tokenizer.decode(ids, skip_special_tokens=True)
    if not any(s in text for s in stops):
        return None
    for k in range(1, len(ids) + 1):
        head = tokenizer.decode(ids[:k], skip_special_tokens=True)
        if any(s in head for s in stops):
            return k
    return None


def _batch(traces: list[_Trace], first: RolloutBatch, pad: int) -> RolloutBatch:
    """The episodes as one `RolloutBatch` (prompts as the first round laid them out)."""
    b, width = len(traces), max(1, max(len(t.ids) for t in traces))

    def rows(values: Sequence[Sequence[float]], dtype: torch.dtype, fill: float) -> torch.Tensor:
        out = torch.full((b, width), fill, dtype=dtype)
        for r, v in enumerate(values):
            out[r, : len(v)] = torch.tensor(v, dtype=dtype)
        return out

    model = rows([t.model for t in traces], torch.float32, 0.0)  # (B, T)
    real = rows([[1.0] * len(t.ids) for t in traces], torch.float32, 0.0)  # (B, T)
    return RolloutBatch(
        prompt_ids=first.prompt_ids,
        prompt_mask=first.prompt_mask,
        response_ids=rows([t.ids for t in traces], torch.long, pad),
        response_mask=model,
        log_probs=rows([t.log_probs for t in traces], torch.float32, 0.0),
        prompt_index=list(first.prompt_index),
        pad_token_id=pad,
        finished=torch.tensor([t.finished for t in traces], dtype=torch.bool),
        observation_mask=real - model,
        turn_rewards=rows([t.rewards for t in traces], torch.float32, 0.0),
        turns=torch.tensor([t.episode.model_turns for t in traces], dtype=torch.long),
    )


def final_turns(batch: Any, tokenizer: Any) -> list[str]:
    """Each row's last model turn as text: the tokens after its last environment token (the
    whole response where the environment never spoke). `batch`: a `RolloutBatch` or a mapping
    with `response_ids`, `response_mask` and `observation_mask`."""
    fields: dict[str, Any] = batch if isinstance(batch, dict) else vars(batch)
    ids: torch.Tensor = fields["response_ids"]
    model: torch.Tensor = fields["response_mask"] > 0
    env: torch.Tensor | None = fields.get("observation_mask")
    out = []
    for r in range(ids.shape[0]):
        start = 0
        if env is not None and bool((env[r] > 0).any()):
            start = int((env[r] > 0).nonzero().max()) + 1
        kept = [int(t) for t, m in zip(ids[r, start:].tolist(), model[r, start:].tolist()) if m]
        out.append(tokenizer.decode(kept, skip_special_tokens=True))
    return out


class EpisodeGenerator:
    """What a worker that owns an engine calls to generate: one response per sample (the
    engine's `generate`), or `rollout_episodes` when `rollout_spec.multi_turn` is set (the
    environment built on first use, once per worker)."""

    def __init__(self, rollout_spec: Any):
        self.multi_turn = rollout_spec.multi_turn
        self.env: Environment | None = None

    def generate(
        self,
        engine: Any,
        prompt_ids: list[list[int]],
        n: int,
        greedy: bool = False,
        temperature: float | None = None,
    ) -> RolloutBatch:
        if self.multi_turn is None:
            return engine.generate(prompt_ids, n, greedy=greedy, temperature=temperature)  # type: ignore[no-any-return]
        if self.env is None:
            from rlhf_trainer.environments import build_environment

            self.env = build_environment(self.multi_turn.environment, self.multi_turn.kwargs)
        return rollout_episodes(
            engine,
            engine.tokenizer,
            self.env,
            prompt_ids,
            n,
            greedy=greedy,
            temperature=temperature,
            max_turns=self.multi_turn.max_turns,
            max_total_tokens=self.multi_turn.max_total_tokens,
        )


# -- on the controller: the episodes' metrics, reward columns and rewards -----------------------

#: Columns every reward function of a multi-turn job may take (`rewards.RESPONSE_COLUMNS` too):
#: the model's last turn as text, its model turns, the environment's observations and its
#: summed reward. The reward phase adds them (`dataflow.phases.reward_columns`).
EPISODE_COLUMNS = ("final_turn", "turns", "observations", "env_reward")


def observation_counts(observation_mask: torch.Tensor) -> torch.Tensor:
    """(B,) long: the environment's observations per row (runs of 1 in `observation_mask` (B, T))."""
    env = observation_mask > 0
    starts = env & ~torch.nn.functional.pad(env[:, :-1], (1, 0), value=False)  # (B, T): a run begins
    return starts.sum(-1)


def episode_columns(batch: Any, tokenizer: Any) -> list[dict[str, Any]]:
    """Each row's `EPISODE_COLUMNS` (`final_turn` None without a tokenizer)."""
    finals = final_turns(batch.tensors, tokenizer) if tokenizer is not None else [None] * len(batch)
    turns = batch["turns"].tolist() if "turns" in batch else [None] * len(batch)
    observations = observation_counts(batch["observation_mask"]).tolist()
    env_reward = batch["turn_rewards"].sum(-1).tolist() if "turn_rewards" in batch else [0.0] * len(batch)
    keys = EPISODE_COLUMNS
    return [dict(zip(keys, row)) for row in zip(finals, turns, observations, env_reward)]


def add_environment_rewards(batch: Any, scores: torch.Tensor) -> torch.Tensor:
    """The episodes' scores (B,): the reward functions' `scores` plus the environment's rewards.
    Sets `token_rewards` (B, T): each environment reward on its turn's last model token, the
    functions' score on the episode's last one, so that token-level estimators (GAE,
    REINFORCE++) credit each turn; their sum is the score outcome estimators (GRPO) read."""
    from rlhf_trainer.algorithms.masking import scores_to_token_rewards

    turn_rewards = batch["turn_rewards"].float()  # (B, T)
    functions = torch.nan_to_num(scores.float(), nan=0.0)  # (B,): a failed reward's row is dropped later
    batch["token_rewards"] = turn_rewards + scores_to_token_rewards(functions, batch["response_mask"])
    return scores + turn_rewards.sum(-1)


def episode_metrics(rollout: RolloutBatch) -> dict[str, float]:
    """`multiturn/*` of a step: turns per episode, the share of episodes the environment answered
    at least once (the tool-call rate of a tool environment), observations per episode, the
    environment's share of the response tokens and its mean reward per episode."""
    assert rollout.observation_mask is not None and rollout.turn_rewards is not None
    observations = observation_counts(rollout.observation_mask).float()  # (B,)
    env_tokens = float(rollout.observation_mask.sum())
    model_tokens = float(rollout.response_mask.sum())
    turns = rollout.turns.float() if rollout.turns is not None else torch.ones(len(rollout))
    return {
        "multiturn/turns_mean": float(turns.mean()),
        "multiturn/observed_fraction": float((observations > 0).float().mean()),
        "multiturn/observations_mean": float(observations.mean()),
        "multiturn/env_token_fraction": env_tokens / max(1.0, env_tokens + model_tokens),
        "multiturn/env_reward_mean": float(rollout.turn_rewards.sum(-1).mean()),
    }
