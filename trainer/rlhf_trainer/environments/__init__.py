"""Environments of multi-turn, tool-using rollouts (`spec.rollout.multiTurn`).

An environment is what answers the model between its turns: a tool that runs the call the model
wrote, a simulated user, a game. Users give one by import path, as reward functions
(`multiTurn.environment: my_pkg.tools:SearchEnv`, built with `multiTurn.kwargs`). After every
model turn of an episode the rollout (`rollout.multiturn.rollout_episodes`) calls

    env.step(episode) -> EnvStep(observation="<result>5</result>", reward=0.0, done=False)

with the episode so far (`Episode`: the prompt, every turn's text and token ids, a `state` dict
the environment may keep per episode). The observation's tokens are appended to the episode
(masked out of the loss: the model did not write them) and the model speaks again, until the
environment says `done` or the turn / token budget runs out.

The contract is written once here; the rollout loop and every environment import it.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

__all__ = ["EnvStep", "Environment", "Episode", "Turn", "build_environment"]


@dataclass
class Turn:
    """One turn of an episode: written by the model (`role` "model") or the environment ("env")."""

    role: str
    text: str
    ids: list[int]


@dataclass
class Episode:
    """One episode as the environment sees it after a model turn."""

    prompt: str
    """The prompt's text (decoded from its token ids)."""
    prompt_ids: list[int]
    turns: list[Turn] = field(default_factory=list)
    """Every turn so far, in order; the last one is the model's turn just written."""
    state: dict[str, Any] = field(default_factory=dict)
    """The environment's own per-episode state (empty at the start, kept across its calls)."""
    truncated: bool = False
    """The model's last turn was cut (at the turn's or the episode's token budget) without an
    end-of-sequence token."""

    @property
    def last_model_text(self) -> str:
        """The text of the model's latest turn ("" before any)."""
        return next((t.text for t in reversed(self.turns) if t.role == "model"), "")

    @property
    def model_turns(self) -> int:
        return sum(t.role == "model" for t in self.turns)


@dataclass
class EnvStep:
    """The environment's answer to one model turn."""

    observation: str = ""
    """Text appended to the episode for the model to read (a tool result, a user turn); "" for none.
    Tokenized without special tokens: put any chat-template markup the model expects in it."""
    reward: float = 0.0
    """This turn's reward contribution: summed into the episode's score (and placed on the turn's
    last model token for token-level estimators such as GAE)."""
    done: bool = False
    """The episode ends here (the observation, if any, is not appended)."""
    observation_ids: list[int] | None = None
    """The observation as token ids, when the environment tokenizes it itself (wins over the text)."""


ENVIRONMENT_FIELD = "spec.rollout.multiTurn.environment"


@runtime_checkable
class Environment(Protocol):
    """What `multiTurn.environment` names: a class built with `multiTurn.kwargs`."""

    def step(self, episode: Episode) -> EnvStep: ...


def environment_class(path: str) -> type:
    """The environment class at `path` (`package.module:Class`), not yet built; errors name
    `spec.rollout.multiTurn.environment` and say what is valid."""
    from rlhf_trainer.user_code import ImportPathError, import_object

    try:
        obj = import_object(path)
    except ImportPathError as err:  # not the rewards' wrapper: its message says "reward path"
        raise ValueError(
            f"{ENVIRONMENT_FIELD}: {path!r}: {err}; valid: an importable package.module:Class"
        ) from err
    if not inspect.isclass(obj):
        raise TypeError(
            f"{ENVIRONMENT_FIELD}: {path!r} is a {type(obj).__name__}, not a class with step(episode)"
        )
    return obj


def build_environment(path: str, kwargs: dict[str, Any] | None = None) -> Environment:
    """The environment class at `path` (`environment_class`) built with `kwargs`; errors name
    `spec.rollout.multiTurn.environment` and say what is valid."""
    where = ENVIRONMENT_FIELD
    obj = environment_class(path)
    try:
        env = obj(**dict(kwargs or {}))
    except TypeError as err:
        raise TypeError(
            f"{where}: {path!r} does not take spec.rollout.multiTurn.kwargs {kwargs!r}: {err}"
        ) from err
    if not callable(getattr(env, "step", None)):
        raise TypeError(f"{where}: {path!r} has no step(episode) -> EnvStep method")
    return env  # type: ignore[no-any-return,return-value]
