"""Typed hyperparameters of the built-in algorithms, importable without torch.

Each built-in algorithm's `spec.algorithm.params` is a frozen dataclass here; the algorithm
classes in `rlhf_trainer.algorithms.builtin` use these same classes as their `Params`. A field is
declared with `param(default, doc, ...)`, which carries its bounds and choices, so that one
declaration gives:

* the check at construction (`AlgorithmParams.__post_init__`: type, bounds, choices, then the
  class's `validate()` for cross-field rules) used by the trainer and by `rlhf validate`;
* the CRD's schema of `spec.algorithm.params` (`params_schema`): the union of every built-in's
  keys, typed and bounded, with a description that names the algorithms taking it and their
  default; `kubectl explain rltj.spec.algorithm.params` shows it;
* the CRD's rules keyed on the algorithm name (`cel_rules`): a key the chosen built-in does not
  take is refused, naming the valid ones;
* the manifest reference (`reference_markdown`).

A custom algorithm (`spec.algorithm.name: pkg.module:Class`) may use any of these keys in
`params` (with the same types and bounds) and puts its own keys in `spec.algorithm.customParams`,
which stays free-form; its class checks them when the trainer builds it.
"""

from __future__ import annotations

import contextvars
import dataclasses
import json
import re
import types
import typing
from collections.abc import Mapping
from typing import Any, ClassVar, TypeVar

from rlhf_api import cel

IMPORT_PATH_RE = r"^[A-Za-z_][A-Za-z0-9_.]*:[A-Za-z_][A-Za-z0-9_.]*$"

P = TypeVar("P", bound="AlgorithmParams")


def camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(p[:1].upper() + p[1:] for p in rest)


def _snake(key: str) -> str:
    return re.sub(r"(?<=[a-z0-9])([A-Z])", r"_\1", key).lower()


@dataclasses.dataclass(frozen=True)
class Choices:
    """The valid names of a string param: `names` (the built-in entries of a registry), and, when
    `open`, any import path `package.module:attribute` (a user's own component)."""

    registry: str
    names: tuple[str, ...]
    open: bool = True

    def describe(self) -> str:
        return ", ".join(self.names) + (", or an import path package.module:attribute" if self.open else "")


#: The registries themselves, once the (torch) algorithm library is imported and binds them:
#: then a name is looked up there (a user's registered entries included, an unknown one listing
#: every registered name), rather than in the built-in names above.
_REGISTRIES: dict[str, Any] = {}


def bind_registry(name: str, registry: Any) -> None:
    """Check `Choices(name, ...)` params against `registry` from now on (called by the algorithm library)."""
    _REGISTRIES[name] = registry


def param(
    default: Any,
    doc: str,
    *,
    choices: Any = None,
    minimum: float | None = None,
    maximum: float | None = None,
    exclusive_minimum: bool = False,
    exclusive_maximum: bool = False,
) -> Any:
    """A documented params field. `choices`: a `Choices`, a registry (any registered name or import
    path is valid) or a tuple of allowed strings; `minimum`/`maximum`: bounds of a number (exclusive
    when asked), checked here and rendered into the CRD."""
    meta = {
        "doc": doc,
        "choices": choices,
        "minimum": minimum,
        "maximum": maximum,
        "exclusive_minimum": exclusive_minimum,
        "exclusive_maximum": exclusive_maximum,
    }
    return dataclasses.field(default=default, metadata=meta)


def _type_name(hint: Any) -> str:
    return hint.__name__ if isinstance(hint, type) else str(hint).replace("typing.", "")


def _options(hint: Any) -> tuple[Any, ...]:
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        return typing.get_args(hint)
    return (hint,)


def _coerce(name: str, value: Any, hint: Any) -> Any:
    """Check `value` against a simple type hint (bool, int, float, str, X | None); ints become floats."""
    options = _options(hint)
    if value is None:
        if type(None) in options:
            return None
        raise ValueError(f"param {name!r} must be {_type_name(hint)}, got None")
    for option in options:
        if option is bool and isinstance(value, bool):
            return value
        if option is int and isinstance(value, int) and not isinstance(value, bool):
            return value
        if option is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if option is str and isinstance(value, str):
            return value
    raise ValueError(f"param {name!r} must be {_type_name(hint)}, got {value!r} ({type(value).__name__})")


def bounds_text(meta: Mapping[str, Any]) -> str:
    """`[0, 1)`, `> 0`, `>= 0`, or '' for a param's bounds."""
    low, high = meta.get("minimum"), meta.get("maximum")
    lo = "(" if meta.get("exclusive_minimum") else "["
    hi = ")" if meta.get("exclusive_maximum") else "]"
    if low is not None and high is not None:
        return f"{lo}{low:g}, {high:g}{hi}"
    if low is not None:
        return f"{'>' if meta.get('exclusive_minimum') else '>='} {low:g}"
    if high is not None:
        return f"{'<' if meta.get('exclusive_maximum') else '<='} {high:g}"
    return ""


def _bounds_phrase(meta: Mapping[str, Any]) -> str:
    """`in [0, 1)` or `> 0`: what an error says is valid."""
    text = bounds_text(meta)
    return f"in {text}" if text.startswith(("[", "(")) else text


def _in_bounds(value: float, meta: Mapping[str, Any]) -> bool:
    low, high = meta.get("minimum"), meta.get("maximum")
    if low is not None and (value <= low if meta.get("exclusive_minimum") else value < low):
        return False
    return not (high is not None and (value >= high if meta.get("exclusive_maximum") else value > high))


# ---------------------------------------------------------------------------------------------
# The seed tutorials' spellings (verl's names; docs/from-verl.md). This is their one table:
# `from_dict` reads it (so `PPOUpdateOperator(ctx, clip_range=0.2)` works in Python) and the CRD
# renders it (`algorithm_schema`: each alias a deprecated, documented key of
# `spec.algorithm.params`, each moved setting a key refused naming where it lives), so that
# `rlhf validate` and the API server give one verdict.
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Alias:
    """A deprecated params key accepted for the params `fields` (snake_case), each set to its value."""

    fields: tuple[str, ...]
    origin: str
    """Where a user migrating from verl met the spelling."""


#: camelCase key -> the params it sets. Accepted by every algorithm that takes all its fields.
PARAM_ALIASES: dict[str, Alias] = {
    "clipRange": Alias(
        ("clip_ratio_low", "clip_ratio_high"),
        "the seeds' clip_range (verl's clip_ratio): one symmetric range",
    ),
    "klTarget": Alias(("target_kl",), "the seed's DynamicKLPPO(kl_target=...)"),
    "betaInit": Alias(("kl_coef",), "the seed's DynamicKLPPO(beta_init=...): the initial KL coefficient"),
    "klPenalty": Alias(("kl_estimator",), "verl's algorithm.kl_penalty (the seeds' kl_penalty: kl)"),
}

#: camelCase key -> where the setting lives in this project. Refused in params (by the API server
#: and `rlhf validate`, and by `from_dict`), the error naming the field to use instead.
MOVED_PARAMS: dict[str, str] = {
    "lr": "spec.training.learningRate (one optimizer per trained role, not per algorithm; the seeds' "
    "PPOUpdateOperator(lr=...), torch.optim.Adam(lr=...))",
    "learningRate": "spec.training.learningRate (one optimizer per trained role, not per algorithm; the "
    "seeds' config ppo.learning_rate)",
    "vfCoef": "spec.training.criticLearningRate (the critic is a model of its own with its own optimizer, so "
    "no value-loss weight enters the policy's loss; the seeds' config ppo.vf_coef)",
    "batchSize": "spec.training.promptsPerStep (prompts per step, each with rollout.samplesPerPrompt responses; "
    "the seeds' config ppo.batch_size)",
    "miniBatchSize": "spec.training.miniBatchSize (responses per optimizer step; the seeds' config "
    "ppo.mini_batch_size)",
}

#: param field -> {verl's value: this project's}. Accepted wherever the field is (and its aliases).
VALUE_ALIASES: dict[str, dict[str, str]] = {
    "kl_estimator": {"kl": "k1"},  # verl's kl_penalty "kl": log pi - log pi_ref, the k1 estimator
}


def _fields_of(cls: type[AlgorithmParams], key: str) -> tuple[str, ...]:
    """The fields of `cls` that the params key `key` (camelCase or snake_case) sets: itself, or
    an alias's fields (`PARAM_ALIASES`); a ValueError for a moved setting or an unknown key."""
    names = [f.name for f in dataclasses.fields(cls)]
    name = _snake(key)
    if name in names:
        return (name,)
    alias = PARAM_ALIASES.get(camel(name))
    if alias is not None and all(f in names for f in alias.fields):
        return alias.fields
    moved = MOVED_PARAMS.get(camel(name))
    if moved is not None:
        raise ValueError(f"param {key!r} is not a parameter of {cls.__name__}; the setting is {moved}")
    valid = ", ".join(f"{n} ({camel(n)})" if camel(n) != n else n for n in names)
    raise ValueError(f"unknown param {key!r} for {cls.__name__}; valid: {valid or '(none)'}")


def spelling_notes(params: Mapping[str, Any], path: str = "spec.algorithm.params") -> list[str]:
    """`rlhf validate`'s notes on the verl spellings a manifest's params use (accepted, deprecated)."""
    notes = [
        f"{path}.{key}: deprecated alias of {' and '.join(camel(f) for f in PARAM_ALIASES[key].fields)} "
        f"({PARAM_ALIASES[key].origin}); prefer that spelling"
        for key in params
        if key in PARAM_ALIASES
    ]
    for key, value in params.items():
        fields = PARAM_ALIASES[key].fields if key in PARAM_ALIASES else (_snake(str(key)),)
        for field in fields:
            if isinstance(value, str) and value in VALUE_ALIASES.get(field, {}):
                notes.append(
                    f"{path}.{key}: {value!r} is verl's name of {VALUE_ALIASES[field][value]!r}; prefer that"
                )
    return notes


def aliases_of(cls: type[AlgorithmParams]) -> dict[str, Alias]:
    """The `PARAM_ALIASES` that `cls` takes (it has every field they set)."""
    names = {f.name for f in dataclasses.fields(cls)}
    return {key: a for key, a in PARAM_ALIASES.items() if set(a.fields) <= names}


#: Whether `AlgorithmParams.validate` evaluates the rules (`from_dict(..., rules=False)` turns it off).
_CHECK_RULES: contextvars.ContextVar[bool] = contextvars.ContextVar("check_rules", default=True)


@dataclasses.dataclass(frozen=True)
class AlgorithmParams:
    """Base of every algorithm's hyperparameters.

    Fields are declared with `param(default, doc)`. Construction checks each value's type
    (ints are accepted for floats), its bounds, the `choices` of string fields, then `validate()`
    for cross-field rules. `from_dict` additionally accepts camelCase keys (as written in a
    manifest) and rejects unknown ones, naming them and listing the valid keys.
    """

    #: The algorithm trains a critic (value model), so the job runs the critic role. Declared
    #: here, torch-free, so that the operator, `rlhf validate` and `rlhf run` decide the roles a
    #: job runs the same way (`spec.unused_roles`); the algorithm classes read it.
    USES_CRITIC: ClassVar[bool] = False

    def uses_reference(self) -> bool:
        """The algorithm reads the reference policy's log-probs with these params (the job runs
        the reference role). The algorithm classes read it (`Algorithm.needs_reference`)."""
        return True

    def __post_init__(self) -> None:
        hints = typing.get_type_hints(type(self))
        for f in dataclasses.fields(self):
            value = _coerce(f.name, getattr(self, f.name), hints[f.name])
            if isinstance(value, str):  # verl's name of a value (`VALUE_ALIASES`): klEstimator kl is k1
                value = VALUE_ALIASES.get(f.name, {}).get(value, value)
            choices: Any = f.metadata.get("choices")
            if isinstance(value, str) and isinstance(choices, Choices) and choices.registry in _REGISTRIES:
                try:
                    _REGISTRIES[choices.registry].get(value)  # UnknownNameError listing the names
                except ValueError as err:
                    err.param = f.name  # type: ignore[attr-defined]  # the field, for check_params
                    raise
            elif isinstance(value, str) and isinstance(choices, Choices):
                if value not in choices.names and not (choices.open and re.match(IMPORT_PATH_RE, value)):
                    raise ValueError(f"param {f.name!r} must be one of {choices.describe()}; got {value!r}")
            elif isinstance(value, str) and hasattr(choices, "get") and hasattr(choices, "names"):
                choices.get(value)  # a Registry: raises UnknownNameError listing the registered names
            elif isinstance(value, str) and choices is not None and value not in choices:
                raise ValueError(f"param {f.name!r} must be one of {', '.join(choices)}; got {value!r}")
            if (
                isinstance(value, (int, float))
                and not isinstance(value, bool)
                and not _in_bounds(value, f.metadata)
            ):
                nullable = " (or null)" if type(None) in _options(hints[f.name]) else ""
                raise ValueError(
                    f"param {f.name!r}: {f.name} must be {_bounds_phrase(f.metadata)}{nullable}, got {value!r}"
                )
            object.__setattr__(self, f.name, value)
        self.validate()

    #: Params whose unset value comes from the job: {field: dotted path in the `JobSpec`}
    #: (`norm_length`: `rollout.max_new_tokens`, the generation budget). Filled by
    #: `build_algorithm(..., job=spec)` when the manifest leaves the param out.
    job_defaults: ClassVar[Mapping[str, str]] = {}

    def validate(self) -> None:
        """The cross-field rules: the class's `CEL_RULES` (with its bases'), evaluated as CEL over
        the params (camelCase names), the very expressions the CRD applies to a job's params
        (`cel_rules`). A rule naming a param whose default is None applies once it is set. A
        custom algorithm may add rules here or override this; built-ins declare CEL only."""
        if not _CHECK_RULES.get():
            return
        hints = typing.get_type_hints(type(self))
        values = {camel(f.name): getattr(self, f.name) for f in dataclasses.fields(self)}
        activation = {
            key: cel.to_cel({"type": "number"} if float in _options(hints[f.name]) else None, value)
            for f in dataclasses.fields(self)
            if (value := values[key := camel(f.name)]) is not None
        }
        for expr, message in class_rules(type(self)):
            used = _names_in(expr, values)
            if any(values[name] is None for name in used):
                continue
            if not cel.eval_cel(expr, activation):
                got = ", ".join(f"{name} {json.dumps(values[name])}" for name in used)
                raise ValueError(f"{message}; got {got}")

    @classmethod
    def from_dict(cls: type[P], values: Mapping[str, Any] | None = None, *, rules: bool = True) -> P:
        """Build from manifest params (camelCase or snake_case keys, or an alias of
        `PARAM_ALIASES`; a key of `MOVED_PARAMS` is refused naming its field). `rules=False`: the params
        of an admitted job, whose CEL rules were evaluated already (by the API server or by
        `admission`); types and bounds are still checked, the CEL interpreter is not loaded."""
        token = _CHECK_RULES.set(rules)
        try:
            return cls._from_dict(values)
        finally:
            _CHECK_RULES.reset(token)

    @classmethod
    def _from_dict(cls: type[P], values: Mapping[str, Any] | None) -> P:
        kwargs: dict[str, Any] = {}
        given: dict[str, str] = {}  # field -> the key that set it
        for key, value in (values or {}).items():
            for name in _fields_of(cls, str(key)):  # itself, or an alias's fields (PARAM_ALIASES)
                if name in kwargs:
                    raise ValueError(
                        f"param {name!r} given twice (as {given[name]!r} and {key!r}: snake_case and "
                        "camelCase, or an alias and its param); valid: one spelling"
                    )
                kwargs[name] = value
                given[name] = str(key)
        return cls(**kwargs)

    @classmethod
    def describe(cls) -> dict[str, tuple[Any, Any, str]]:
        """{field: (type, default, doc)}; a string field's doc lists its valid values."""
        hints = typing.get_type_hints(cls)
        out: dict[str, tuple[Any, Any, str]] = {}
        for f in dataclasses.fields(cls):
            doc = str(f.metadata.get("doc", ""))
            choices: Any = f.metadata.get("choices")
            if isinstance(choices, Choices):
                doc += f" One of: {choices.describe()}."
            elif hasattr(choices, "names") and callable(choices.names):
                doc += f" One of: {', '.join(choices.names())}, or an import path 'package.module:attribute'."
            elif choices is not None:
                doc += f" One of: {', '.join(choices)}."
            bounds = bounds_text(f.metadata)
            if bounds:
                doc += f" Valid: {bounds}."
            out[f.name] = (hints[f.name], f.default, doc)
        return out

    def as_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


# ---------------------------------------------------------------------------------------------
# The built-in algorithms' params. The names of registry entries are listed here (torch-free); a
# unit test keeps them equal to the registries' built-in entries.
# ---------------------------------------------------------------------------------------------

ADVANTAGE_ESTIMATOR_NAMES = Choices(
    "ADVANTAGE_ESTIMATORS",
    ("gae", "grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "remax"),
)
POLICY_LOSS_NAMES = Choices("POLICY_LOSSES", ("ppo", "gspo"))
LOSS_AGGREGATION_NAMES = Choices(
    "LOSS_AGGREGATIONS",
    ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"),
)
KL_ESTIMATOR_NAMES = Choices("KL_ESTIMATORS", ("k1", "k2", "k3", "abs", "low_var_kl", "mse"))
KL_CONTROLLER_NAMES = Choices("KL_CONTROLLERS", ("fixed", "adaptive"))
PREFERENCE_LOSS_NAMES = Choices("PREFERENCE_LOSSES", ("dpo", "ipo"))


def _like(base: type[AlgorithmParams], name: str, default: Any) -> Any:
    """Re-declare `base`'s field `name` with a new default, keeping its documentation and bounds."""
    inherited = base.__dataclass_fields__[name]  # type: ignore[attr-defined]
    return dataclasses.field(default=default, metadata=inherited.metadata)


@dataclasses.dataclass(frozen=True)
class PolicyGradientParams(AlgorithmParams):
    """Hyperparameters shared by PPO, GRPO, RLOO and REINFORCE++."""

    def uses_reference(self) -> bool:
        # Every built-in KL controller scales the coefficient multiplicatively, so 0 stays 0: no
        # KL term (in the reward or the loss), and nothing reads the reference policy.
        return self.kl_coef != 0

    advantage_estimator: str = param(
        "gae", "Advantage estimator (ADVANTAGE_ESTIMATORS).", choices=ADVANTAGE_ESTIMATOR_NAMES
    )
    policy_loss: str = param(
        "ppo",
        "Policy surrogate loss (POLICY_LOSSES): 'ppo' clipped per token or 'gspo' sequence-level. 'gspo' "
        "keeps this algorithm's clip range and lossAggMode (warning when the range is token-level wide); "
        "algorithm gspo has the paper's.",
        choices=POLICY_LOSS_NAMES,
    )
    clip_ratio_low: float = param(
        0.2,
        "Lower clip epsilon: the ratio is clipped at 1 - clip_ratio_low (the GSPO paper uses 3e-4 for gspo).",
        minimum=0.0,
        maximum=1.0,
        exclusive_maximum=True,
    )
    clip_ratio_high: float = param(
        0.2,
        "Upper clip epsilon: the ratio is clipped at 1 + clip_ratio_high (DAPO's clip-higher uses 0.28; GSPO 4e-4).",
        minimum=0.0,
    )
    clip_ratio_c: float | None = param(
        3.0,
        "Dual-clip constant c > 1 capping the loss at -c*A for negative advantages (ppo loss); null disables.",
        minimum=1.0,
        exclusive_minimum=True,
    )
    log_ratio_clamp: float = param(
        20.0,
        "The log importance ratio is clamped to +-this before exp().",
        minimum=0.0,
        exclusive_minimum=True,
    )
    loss_agg_mode: str = param(
        "token-mean",
        "How token losses become one scalar (LOSS_AGGREGATIONS).",
        choices=LOSS_AGGREGATION_NAMES,
    )
    norm_length: float | None = param(
        None,
        "Constant length divisor of lossAggMode seq-mean-token-sum-norm (Dr.GRPO's constant). Unset in a "
        "job: the generation budget rollout.maxNewTokens; null outside a job: the batch's padded length T "
        "(which follows the longest response, so it is not constant).",
        minimum=0.0,
        exclusive_minimum=True,
    )
    entropy_coef: float = param(0.0, "Weight of the entropy bonus (needs batch key 'entropy'); 0 disables.")
    kl_coef: float = param(
        0.001, "Initial coefficient beta of the KL to the reference policy; 0 disables.", minimum=0.0
    )
    kl_estimator: str = param("k1", "Per-token KL estimator (KL_ESTIMATORS).", choices=KL_ESTIMATOR_NAMES)
    kl_in_reward: bool = param(
        True, "true: subtract beta*KL from the rewards before advantages; false: add beta*KL to the loss."
    )
    kl_clamp: float | None = param(
        None,
        "Bound on each per-token KL estimate; null keeps the estimator's own (verl: only k3, at 10).",
        minimum=0.0,
        exclusive_minimum=True,
    )
    kl_controller: str = param(
        "fixed",
        "How beta evolves (KL_CONTROLLERS): 'fixed' or 'adaptive' (Ziegler et al. 2019).",
        choices=KL_CONTROLLER_NAMES,
    )
    target_kl: float = param(
        0.1,
        "Target KL of the adaptive controller (and of dynamic_kl_ppo).",
        minimum=0.0,
        exclusive_minimum=True,
    )
    horizon: float = param(
        10000.0, "Adaptive controller horizon, in samples.", minimum=0.0, exclusive_minimum=True
    )
    whiten_unbiased: bool = param(
        True, "Whitening uses the unbiased variance (n - 1, verl) instead of the biased one (n, OpenRLHF)."
    )
    overlong_buffer_length: int = param(
        0,
        "DAPO's overlong soft penalty (arXiv:2503.14476, eq. 13): a response longer than "
        "overlongMaxLength - this many tokens loses reward linearly, from 0 there to -overlongPenaltyFactor "
        "at overlongMaxLength; added to the score before the advantages. 0 disables.",
        minimum=0,
    )
    overlong_penalty_factor: float = param(
        1.0, "Penalty of the overlong soft penalty at the longest response (DAPO: 1).", minimum=0.0
    )
    overlong_max_length: int | None = param(
        None,
        "Longest response of the overlong soft penalty. Unset in a job: the generation budget "
        "rollout.maxNewTokens; outside a job it must be given when overlongBufferLength > 0.",
        minimum=1,
    )
    mask_truncated: bool = param(
        False,
        "DAPO's overlong filtering: responses cut at rollout.maxNewTokens without an end-of-sequence token "
        "(batch key 'truncated') are left out of the loss; they still count in their group's advantages.",
    )

    job_defaults: ClassVar[Mapping[str, str]] = {
        "norm_length": "rollout.max_new_tokens",
        "overlong_max_length": "rollout.max_new_tokens",
    }

    CEL_RULES: ClassVar[list[tuple[str, str]]] = [
        (
            "overlongBufferLength < overlongMaxLength",
            "overlongBufferLength must be < overlongMaxLength (rollout.maxNewTokens in a job)",
        ),
        (
            "klController != 'adaptive' || klCoef > 0.0",
            "klController: adaptive needs klCoef > 0 (the controller scales the coefficient, which stays 0 "
            "and has no KL to adapt to); valid: klCoef > 0, or klController: fixed",
        ),
    ]


@dataclasses.dataclass(frozen=True)
class PPOParams(PolicyGradientParams):
    """PPO with a critic and GAE (Ouyang et al. 2022 setup: KL penalty in the reward)."""

    USES_CRITIC: ClassVar[bool] = True

    gamma: float = param(1.0, "Discount factor.", minimum=0.0, maximum=1.0)
    lam: float = param(
        1.0,
        "GAE lambda (bias/variance trade-off; 1 = Monte Carlo returns minus values).",
        minimum=0.0,
        maximum=1.0,
    )
    gae_masking: str = param(
        "carry",
        "Masked positions in GAE: 'carry' skips them (verl), 'zero' zeroes rewards and values there (OpenRLHF).",
        choices=Choices("gae_masking", ("carry", "zero"), open=False),
    )
    whiten_advantages: bool = param(True, "Normalise GAE advantages over the batch's valid tokens.")
    clip_range_value: float | None = param(
        0.5,
        "Value clipping: the new value may move at most this far from the old one; null disables.",
        minimum=0.0,
    )


@dataclasses.dataclass(frozen=True)
class GRPOParams(PolicyGradientParams):
    """GRPO: group-normalised outcome advantages, KL as a loss term (k3) rather than in the reward."""

    advantage_estimator: str = _like(PolicyGradientParams, "advantage_estimator", "grpo")
    kl_estimator: str = _like(PolicyGradientParams, "kl_estimator", "k3")
    kl_in_reward: bool = _like(PolicyGradientParams, "kl_in_reward", False)
    epsilon: float = param(
        1e-6, "Added to the group std before dividing (verl 1e-6, OpenRLHF 1e-9).", minimum=0.0
    )
    norm_by_std: bool = param(True, "Divide by the group std; false gives Dr.GRPO (arXiv:2503.20783).")


@dataclasses.dataclass(frozen=True)
class GSPOParams(GRPOParams):
    """GSPO: GRPO's group advantages with the sequence-level ratio and the paper's settings."""

    policy_loss: str = _like(GRPOParams, "policy_loss", "gspo")
    clip_ratio_low: float = _like(GRPOParams, "clip_ratio_low", 3e-4)
    clip_ratio_high: float = _like(GRPOParams, "clip_ratio_high", 4e-4)
    loss_agg_mode: str = _like(GRPOParams, "loss_agg_mode", "seq-mean-token-mean")
    kl_coef: float = _like(GRPOParams, "kl_coef", 0.0)


@dataclasses.dataclass(frozen=True)
class DrGRPOParams(GRPOParams):
    """Dr.GRPO: GRPO without the std normalisation and with a constant length normaliser."""

    norm_by_std: bool = _like(GRPOParams, "norm_by_std", False)
    loss_agg_mode: str = _like(GRPOParams, "loss_agg_mode", "seq-mean-token-sum-norm")

    CEL_RULES: ClassVar[list[tuple[str, str]]] = [
        ("!normByStd", "dr_grpo: normByStd must be false (Dr.GRPO removes the std normalisation)"),
    ]


@dataclasses.dataclass(frozen=True)
class ReMaxParams(PolicyGradientParams):
    """ReMax: REINFORCE with the greedy response's reward as the baseline, KL penalty in the reward."""

    advantage_estimator: str = _like(PolicyGradientParams, "advantage_estimator", "remax")


@dataclasses.dataclass(frozen=True)
class RLOOParams(PolicyGradientParams):
    """RLOO: leave-one-out baseline within each prompt's group, KL penalty in the reward."""

    advantage_estimator: str = _like(PolicyGradientParams, "advantage_estimator", "rloo")


@dataclasses.dataclass(frozen=True)
class ReinforcePlusPlusParams(PolicyGradientParams):
    """REINFORCE++: discounted returns with the KL penalty in the reward, whitened over the batch."""

    advantage_estimator: str = _like(PolicyGradientParams, "advantage_estimator", "reinforce_plus_plus")
    gamma: float = param(1.0, "Discount factor of the returns.", minimum=0.0, maximum=1.0)


@dataclasses.dataclass(frozen=True)
class DynamicKLPPOParams(PPOParams):
    """PPO params plus the bounds of the KL coefficient schedule."""

    kl_coef: float = _like(PPOParams, "kl_coef", 0.05)
    beta_min: float = param(0.001, "Lower bound of the KL coefficient.", minimum=0.0, exclusive_minimum=True)
    beta_max: float = param(1.0, "Upper bound of the KL coefficient.", minimum=0.0, exclusive_minimum=True)

    #: Cross-field rules as CEL over the params (missing keys take their defaults); the CRD
    #: evaluates them when `spec.algorithm.name` is this algorithm.
    CEL_RULES: ClassVar[list[tuple[str, str]]] = [
        ("betaMin <= betaMax", "betaMin must be <= betaMax"),
        ("betaMin <= klCoef && klCoef <= betaMax", "klCoef must lie in [betaMin, betaMax]"),
        (
            "klController == 'fixed'",
            "dynamic_kl_ppo schedules the KL coefficient itself; klController must be 'fixed'",
        ),
    ]


@dataclasses.dataclass(frozen=True)
class OnlineDPOParams(AlgorithmParams):
    """Online DPO: samplesPerPrompt >= 2 per prompt, its best- and worst-scored samples make the pair
    (best vs worst of n; 4-8 is the usual recipe), a preference loss on the pair."""

    preference_loss: str = param(
        "dpo", "Pairwise loss (PREFERENCE_LOSSES): 'dpo' or 'ipo'.", choices=PREFERENCE_LOSS_NAMES
    )
    beta: float = param(
        0.1,
        "Strength of the implicit KL regularisation to the reference.",
        minimum=0.0,
        exclusive_minimum=True,
    )
    label_smoothing: float = param(
        0.0,
        "DPO only: assumed share of flipped preference labels, in [0, 0.5).",
        minimum=0.0,
        maximum=0.5,
        exclusive_maximum=True,
    )
    length_normalize: bool = param(
        False, "Use the mean instead of the sum of token log-probs per sequence (as TRL's IPO does)."
    )


#: Params of each built-in algorithm, by its `spec.algorithm.name`.
BUILTIN_PARAMS: dict[str, type[AlgorithmParams]] = {
    "ppo": PPOParams,
    "grpo": GRPOParams,
    "gspo": GSPOParams,
    "dr_grpo": DrGRPOParams,
    "rloo": RLOOParams,
    "reinforce_plus_plus": ReinforcePlusPlusParams,
    "remax": ReMaxParams,
    "online_dpo": OnlineDPOParams,
    "dynamic_kl_ppo": DynamicKLPPOParams,
}


def check_params(name: str, params: Mapping[str, Any], path: str = "spec.algorithm.params") -> list[str]:
    """Errors of a built-in algorithm's manifest params (camelCase keys), each naming the field, the
    value and what is valid; [] for a custom algorithm (its class checks its own)."""
    cls = BUILTIN_PARAMS.get(name)
    if cls is None:
        return []
    fields = {camel(f.name): f for f in dataclasses.fields(cls)}
    errs = [
        f"{path}.{key}: param {key!r} is not a parameter of {name}; the setting is {MOVED_PARAMS[key]}"
        if key in MOVED_PARAMS
        else f"{path}.{key}: unknown param {key!r} of algorithm {name} (value {json.dumps(value)}); valid: {', '.join(fields)}"
        for key, value in params.items()
        if key not in fields and key not in aliases_of(cls)
    ]
    if errs:
        return errs
    try:
        cls.from_dict(params)
    except ValueError as err:
        match = re.match(r"param '(\w+)'", str(err))
        field = getattr(err, "param", None) or (match.group(1) if match else None)
        where = f"{path}.{camel(field)}" if field else path
        errs.append(f"{where}: {err}")
    return errs


#: A key of a custom algorithm's params: `Params.from_dict` turns camelCase into snake_case and
#: looks for a dataclass field of that name, so anything else could never be a param.
PARAM_KEY_RE = r"^[A-Za-z_][A-Za-z0-9_]*$"


def check_custom_params(
    name: str,
    params: Mapping[str, Any],
    custom_params: Mapping[str, Any] | None,
    path: str = "spec.algorithm",
) -> list[str]:
    """Errors of a custom algorithm's params (`name` an import path) found without its class.

    The operator runs this before it creates any pod, and never imports the user's module (it
    is not in the operator's image, and importing it would run a manifest's code with the
    operator's credentials). So it checks what holds for every `AlgorithmParams.from_dict`:
    each key of `customParams` is a name a dataclass field can have, and no param is given twice
    (in `params` and `customParams`, or as `myCoef` and `my_coef`: the algorithm would be built
    with only one of them). The class checks the values (types, bounds) when the trainer builds it.
    [] for a built-in algorithm (its params are typed; `customParams` is refused by the CRD)."""
    if name in BUILTIN_PARAMS or not custom_params:
        return []
    errs = [
        f"{path}.customParams.{key}: {key!r} can never be a param of an algorithm (value "
        f"{json.dumps(value)}); valid: a name of letters, digits and '_', not starting with a digit, "
        "e.g. myCoef or my_coef"
        for key, value in custom_params.items()
        if not re.match(PARAM_KEY_RE, str(key))
    ]
    seen: dict[str, str] = {}
    for where, values in (("params", params), ("customParams", custom_params)):
        for key in values:
            field = _snake(str(key))
            if field in seen:
                errs.append(
                    f"{path}.{where}.{key}: param {field!r} is already given as {seen[field]}; valid: "
                    "each param once (a custom algorithm's typed keys in params, its own in customParams)"
                )
            seen.setdefault(field, f"{path}.{where}.{key}")
    return errs


def _names_in(expr: str, values: Mapping[str, Any]) -> list[str]:
    """The params (camelCase keys of `values`) that the CEL expression `expr` reads, in order."""
    return [key for key in values if re.search(rf"(?<![\w.']){key}(?![\w'])", expr)]


def class_rules(cls: type[AlgorithmParams]) -> list[tuple[str, str]]:
    """The cross-field `CEL_RULES` of `cls` and of its bases (a subclass's own rules add to its
    base's, as its `validate()` calls `super().validate()`), base first, each once."""
    out: list[tuple[str, str]] = []
    for klass in reversed(cls.__mro__):
        for rule in klass.__dict__.get("CEL_RULES", []):
            if rule not in out:
                out.append(rule)
    return out
