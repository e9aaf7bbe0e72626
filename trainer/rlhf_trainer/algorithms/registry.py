"""Name -> object registries for every pluggable piece of the algorithm library.

Each family (advantage estimators, policy losses, KL estimators, ...) has one `Registry`.
Entries are added with a decorator::

    @ADVANTAGE_ESTIMATORS.register("grpo")
    def grpo(scores, group_index, response_mask, *, epsilon=1e-6, norm_by_std=True): ...

and looked up with `REGISTRY.get(name)`. `get` also accepts an import path
``"package.module:attribute"`` so users plug in their own estimator, loss or algorithm without
touching this package (``spec.algorithm.name: my_pkg.algos:MyAlgo``). An unknown name raises
`UnknownNameError`, whose message names the bad value and lists every valid name.

Callers dispatch only through `get`; no family special-cases one of its entries.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar

T = TypeVar("T")

#: ``package.module:attribute`` (the attribute may be dotted: ``pkg.mod:Outer.inner``).
IMPORT_PATH_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_.]*:[A-Za-z_][A-Za-z0-9_.]*$")


class UnknownNameError(ValueError, KeyError):
    """A name that is neither registered nor an importable ``package.module:attribute`` path.

    A `ValueError` (it is a bad configuration value) that is also a `KeyError` (it is a failed
    lookup), so either ``except`` clause catches it.
    """

    def __init__(self, kind: str, name: object, valid: list[str], reason: str = "") -> None:
        self.kind = kind
        self.name = name
        self.valid = valid
        detail = f" ({reason})" if reason else ""
        self.message = (
            f"unknown {kind} {name!r}{detail}; valid: {', '.join(valid) if valid else '(none registered)'}, "
            "or an import path 'package.module:attribute'"
        )
        super().__init__(self.message)

    def __str__(self) -> str:  # KeyError would repr() the message; keep it readable.
        return self.message


class Registry(Generic[T]):
    """A named collection of objects of one kind (functions or classes).

    `kind` is the human-readable family name used in error messages ("advantage estimator").
    """

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._entries: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator adding the decorated object under `name`; re-registering a name is an error."""

        def decorator(obj: T) -> T:
            self.add(name, obj)
            return obj

        return decorator

    def add(self, name: str, obj: T) -> None:
        """Add `obj` under `name`. Names are plain identifiers (no ``:``, which marks import paths)."""
        if not isinstance(name, str) or not name or ":" in name:
            raise ValueError(f"{self.kind} name must be a non-empty string without ':', got {name!r}")
        existing = self._entries.get(name)
        if existing is not None and existing is not obj:
            raise ValueError(f"{self.kind} {name!r} is already registered to {existing!r}")
        self._entries[name] = obj

    def get(self, name: str) -> T:
        """The object registered as `name`, or the attribute an import path ``pkg.mod:attr`` names."""
        if isinstance(name, str) and name in self._entries:
            return self._entries[name]
        if isinstance(name, str) and IMPORT_PATH_RE.match(name):
            return self._import(name)
        raise UnknownNameError(self.kind, name, self.names())

    def _import(self, path: str) -> T:
        from rlhf_trainer.user_code import ImportPathError, import_object

        try:
            return import_object(path)  # type: ignore[no-any-return]
        except ImportPathError as err:
            raise UnknownNameError(self.kind, path, self.names(), str(err)) from err

    def names(self) -> list[str]:
        """Registered names, sorted."""
        return sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, {self.names()})"


ADVANTAGE_ESTIMATORS: Registry[Callable[..., Any]] = Registry("advantage estimator")
POLICY_LOSSES: Registry[Callable[..., Any]] = Registry("policy loss")
KL_ESTIMATORS: Registry[Callable[..., Any]] = Registry("KL estimator")
KL_CONTROLLERS: Registry[Callable[..., Any]] = Registry("KL controller")
LOSS_AGGREGATIONS: Registry[Callable[..., Any]] = Registry("loss aggregation mode")
PREFERENCE_LOSSES: Registry[Callable[..., Any]] = Registry("preference loss")
ALGORITHMS: Registry[Any] = Registry("algorithm")
