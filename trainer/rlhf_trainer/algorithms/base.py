"""The `Algorithm` interface: what the trainer's workers and controller call, and nothing else.

An algorithm turns a rollout batch into advantages, and a (micro-)batch into a loss. It owns
its hyperparameters (a typed `AlgorithmParams` dataclass built from the manifest's
``spec.algorithm.params``) and any state that must survive a checkpoint (a KL coefficient).

Contract
--------
::

    class Algorithm:
        name: ClassVar[str]             # the ALGORITHMS registry name
        needs_critic: ClassVar[bool]    # the job must run a critic role (value model)
        needs_reference: bool           # the job must run a reference policy (False on an instance whose params make it unused)
        needs_baseline: bool            # the trainer must add `baseline_scores` (greedy responses' rewards, ReMax)
        needs_entropy: bool             # compute_loss reads `entropy` (else the actor skips that work)
        advantages_read_old_log_probs: bool  # compute_advantages reads `old_log_probs` (KL in the reward)
        Params: ClassVar[type[AlgorithmParams]]

        def __init__(self, **params)    # camelCase or snake_case keys; unknown key -> ValueError
        def compute_advantages(self, batch) -> dict   # rollout batch -> batch + "advantages", "returns"
        def compute_loss(self, batch) -> dict         # "loss" (scalar, with grad) + namespaced metrics
        def compute_value_loss(self, batch) -> dict   # needs_critic only: "loss" + critic/* metrics
        def update_step(self, loss_dict) -> None      # once per training step, on the controller
        def state_dict(self) -> dict; def load_state_dict(self, d) -> None

Call order per training step: ``compute_advantages`` once on the whole rollout batch (no
autograd), then for each micro-batch ``compute_loss`` (actor) and ``compute_value_loss``
(critic) followed by ``loss.backward()``, an optimizer step per mini-batch (``miniBatchSize``)
and epoch (``epochsPerBatch``), and then, on the controller, ONE ``update_step`` per training
step with the step's metrics averaged over all its micro-batches, optimizer steps and ranks
(``actor/optimizer_steps`` says how many there were). It runs once per training step, not per
optimizer step, because its state (a KL coefficient) travels to the training workers with the
algorithm at the start of each update: within a step every optimizer step uses the same
coefficient, and the controller that owns it adapts it once from the whole step's KL, counting
the horizon in the step's samples (``batch/num_samples``), as Ziegler et al.'s controller does
per batch. A step that trains nothing (``update/skipped``) calls no ``update_step``.

Batch keys
----------
All `(B, T)` floating tensors over response tokens unless noted; which ones an algorithm reads
depends on it (a missing one is a ValueError naming it and the keys present).

| key | shape | meaning |
|---|---|---|
| `response_mask` | (B, T) | 1.0 valid response token, 0.0 padding (any side, holes, empty rows) |
| `log_probs` | (B, T) | current policy's log-prob of each sampled token, with grad |
| `old_log_probs` | (B, T) | the policy's log-probs when the rollout was made (no grad) |
| `ref_log_probs` | (B, T) | reference policy's log-probs (KL term), optional |
| `entropy` | (B, T) | current policy's token entropy (`entropy.entropy_from_logits`), optional |
| `values` | (B, T) | critic's current prediction, with grad (value loss) |
| `old_values` | (B, T) | critic's prediction when the rollout was scored (GAE) |
| `token_rewards` | (B, T) | per-token rewards, optional (else `scores` on the last valid token) |
| `scores` | (B,) | sequence-level reward |
| `group_index` | (B,) long | which prompt each sample came from (group estimators) |
| `baseline_scores` | (B,) | reward of the greedy response to the sample's prompt (remax; the trainer adds it when `needs_baseline`) |
| `advantages`, `returns` | (B, T) | written by `compute_advantages` |
| `chosen` | (B,) bool | preference: this sample is the preferred one of its pair |
| `pair_index` | (B,) long | preference: the pair each sample belongs to |
| `train_rows` | (B,) bool | optional output of `compute_advantages`: the samples the update trains on (online DPO: the members of a pair); the others are dropped before the update |
| `global_tokens`, `global_seqs` | scalar | optional: valid tokens / non-empty sequences of the whole optimizer step over all micro-batches and ranks (see `aggregation`) |

Returned losses are scalar tensors; metric values are Python floats under namespaced keys
(`actor/...`, `critic/...`). With `global_tokens` / `global_seqs` in the batch, `"loss"` is the
micro-batch's *share* of the step's loss (sum it over micro-batches and ranks), while every
metric describes the micro-batch alone (local normalizers), so the caller averages metrics,
token-weighted, and sums only `"loss"`.

`update_step` reads `actor/kl` (the KL to the reference, which `compute_loss` reports whenever
`ref_log_probs` is present) when the algorithm adapts its KL coefficient, and
`batch/num_samples` (sequences trained on in the step; 1 if absent), which the adaptive
controller's horizon is counted in.

Writing your own
----------------
Subclass `Algorithm` (or a built-in, see `builtin.DynamicKLPPO`), give it a `Params` class — a
``@dataclasses.dataclass(frozen=True)`` derived from `AlgorithmParams` whose fields use
`param(default, doc)` and whose `validate()` holds the cross-field rules — and either register it
(``@ALGORITHMS.register("my_algo")``) or name it by import path in the manifest
(``spec.algorithm.name: my_pkg.algos:MyAlgo``).
"""

from __future__ import annotations

import abc
import inspect
from collections.abc import Callable, Mapping
from typing import Any, ClassVar, TypeVar

from rlhf_api.algorithm_params import AlgorithmParams, _snake, param

from .registry import ALGORITHMS

__all__ = [
    "Algorithm",
    "AlgorithmParams",
    "Batch",
    "param",
    "bind_call",
    "build_algorithm",
    "list_algorithms",
    "describe_params",
    "require",
]

#: A batch: tensors by the names in the module docstring, plus optional scalar normalizers.
Batch = dict[str, Any]

P = TypeVar("P", bound="AlgorithmParams")


def bind_call(
    fn: Callable[..., Any], tensors: Mapping[str, Any], params: Mapping[str, Any], what: str
) -> Any:
    """Call a registered component by its signature: how `Algorithm` dispatches without special cases.

    Positional parameters are looked up by name in `tensors` (the batch); a missing one with a
    default is left at it, a missing required one is a ValueError naming it. Keyword-only
    parameters are taken from `params` when present there, else left at their defaults.
    """
    signature = inspect.signature(fn)
    args: list[Any] = []
    kwargs: dict[str, Any] = {}
    for p in signature.parameters.values():
        if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD):
            value = tensors.get(p.name)
            if value is None:
                if p.default is inspect.Parameter.empty:
                    raise ValueError(
                        f"{what} needs batch key {p.name!r}; the batch has {', '.join(sorted(tensors)) or 'no keys'}"
                    )
                value = p.default
            args.append(value)
        elif p.kind == inspect.Parameter.KEYWORD_ONLY and p.name in params:
            kwargs[p.name] = params[p.name]
    return fn(*args, **kwargs)


def require(batch: Mapping[str, Any], key: str, who: str) -> Any:
    """batch[key], or a ValueError naming the key, who needs it and the keys present."""
    value = batch.get(key)
    if value is None:
        raise ValueError(
            f"{who} needs batch key {key!r}; the batch has {', '.join(sorted(batch)) or 'no keys'}"
        )
    return value


class Algorithm(abc.ABC):
    """Base class of every RL algorithm; see the module docstring for the contract."""

    name: ClassVar[str] = ""
    needs_critic: ClassVar[bool] = False
    #: Class default; an instance may turn it off when its params make the reference unused
    #: (a policy-gradient algorithm with klCoef 0 never reads ref_log_probs).
    needs_reference: bool = False
    #: The advantages need `baseline_scores` (B,): the reward of a greedy response to each
    #: sample's prompt, which the trainer generates and scores before the advantage phase (ReMax).
    needs_baseline: bool = False
    #: `compute_loss` reads `entropy` (B, T). The actor computes the entropy (a full-vocabulary
    #: pass over the response logits, and its backward) only for algorithms that say so. True by
    #: default, so an algorithm written before this flag keeps receiving it.
    needs_entropy: bool = True
    Params: ClassVar[type[AlgorithmParams]] = AlgorithmParams

    @property
    def advantages_read_old_log_probs(self) -> bool:
        """`compute_advantages` reads `old_log_probs` (a KL penalty in the reward), so the trainer
        must compute them before the update even when the batch is trained on once. Default: any
        algorithm with a reference policy might (the conservative answer for user algorithms)."""
        return bool(self.needs_reference)

    def __init__(self, **params: Any) -> None:
        self.params = self.Params.from_dict(params)

    @abc.abstractmethod
    def compute_advantages(self, batch: Batch) -> Batch:
        """Return a new batch with `advantages` (B, T) (and `returns` (B, T)) added."""

    @abc.abstractmethod
    def compute_loss(self, batch: Batch) -> dict[str, Any]:
        """Return {"loss": scalar tensor with grad, "<ns>/<metric>": float, ...}."""

    def compute_value_loss(self, batch: Batch) -> dict[str, Any]:
        """Critic loss; only algorithms with `needs_critic` implement it."""
        raise ValueError(
            f"algorithm {self.name or type(self).__name__!r} has no critic (needs_critic is False)"
        )

    def update_step(self, loss_dict: Mapping[str, Any]) -> None:  # noqa: B027 - optional hook
        """Called once per training step (after all its optimizer steps, on the controller) with
        the step's aggregated metrics; see the module docstring. Default: nothing."""

    def state_dict(self) -> dict[str, Any]:
        """State to checkpoint (not the params, which come from the manifest)."""
        return {"algorithm": self.name or type(self).__name__}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        expected = self.name or type(self).__name__
        if state.get("algorithm") != expected:
            raise ValueError(
                f"checkpoint holds state of algorithm {state.get('algorithm')!r}, not {expected!r}"
            )


def build_algorithm(name_or_path: str, params: Mapping[str, Any] | None = None, job: Any = None) -> Algorithm:
    """Instantiate a registered algorithm (or `package.module:Class`) with manifest params.

    `job`: the `JobSpec`; params its `Params.job_defaults` name and `params` leaves out are
    taken from it (without a job they keep their declared defaults)."""
    cls = ALGORITHMS.get(name_or_path)
    if not (isinstance(cls, type) and issubclass(cls, Algorithm)):
        raise ValueError(f"{name_or_path!r} is {cls!r}, not a subclass of rlhf_trainer.algorithms.Algorithm")
    given = dict(params or {})
    if job is not None:
        named = {_snake(str(k)) for k in given}
        for field_name, path in cls.Params.job_defaults.items():
            if field_name not in named:
                value = job
                for part in path.split("."):
                    value = getattr(value, part)
                given[field_name] = value
    return cls(**given)


def list_algorithms() -> list[str]:
    """Names of the registered algorithms."""
    return ALGORITHMS.names()


def describe_params(name_or_path: str) -> dict[str, tuple[Any, Any, str]]:
    """{param: (type, default, doc)} of an algorithm's params, for documentation and CRD generation."""
    cls = ALGORITHMS.get(name_or_path)
    if not (isinstance(cls, type) and issubclass(cls, Algorithm)):
        raise ValueError(f"{name_or_path!r} is {cls!r}, not a subclass of rlhf_trainer.algorithms.Algorithm")
    return cls.Params.describe()
