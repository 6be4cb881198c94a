"""Pruner registry.

Adding a method takes one subclass and one call::

    @dataclass
    class MyOptions:
        temperature: float = 1.0

    class MyPruner(Pruner):
        name, Options = "mine", MyOptions
        def select(self, ctx, n_keep):
            return ctx.attention_scores(n_keep)

    register_pruner(MyPruner)
    vf.wrap(model, pruner="mine", temperature=0.5)
"""

from __future__ import annotations

import re

from .base import NoOptions, Pruner, Selection, StageContext, apply_rope
from .baselines import PoolPruner, RandomPruner, TemporalPruner
from .debiased import DebiasedPruner
from .diverse import DiversePruner
from .fastv import FastVPruner
from .fixation import FixationPruner
from .guided import GuidedPruner, guided_generate
from .pyramid import PyramidPruner
from .text import TextPruner

__all__ = [
    "NoOptions",
    "Pruner",
    "Selection",
    "StageContext",
    "apply_rope",
    "get_pruner",
    "guided_generate",
    "pruners",
    "register_pruner",
]

_PRUNERS: dict[str, type[Pruner]] = {}


def register_pruner(cls: type[Pruner], *, replace: bool = False) -> type[Pruner]:
    """Register a :class:`Pruner` subclass under ``cls.name`` (a lowercase identifier)."""
    if not (isinstance(cls, type) and issubclass(cls, Pruner)):
        raise TypeError(f"register_pruner expects a Pruner subclass, got {cls!r}")
    if not isinstance(cls.name, str) or not re.fullmatch(r"[a-z][a-z0-9_]*", cls.name):
        raise ValueError(f"pruner name {cls.name!r} must be a lowercase identifier")
    if cls.name in _PRUNERS and not replace:
        raise ValueError(f"a pruner named '{cls.name}' is already registered (replace=True)")
    _PRUNERS[cls.name] = cls
    return cls


def pruners() -> list[str]:
    """Names of the registered pruners."""
    return sorted(_PRUNERS)


def get_pruner(name: str) -> type[Pruner]:
    if name not in _PRUNERS:
        raise ValueError(f"unknown pruner {name!r}; registered: {', '.join(pruners())}")
    return _PRUNERS[name]


for _cls in (
    FastVPruner,
    FixationPruner,
    TextPruner,
    DebiasedPruner,
    PyramidPruner,
    GuidedPruner,
    DiversePruner,
    RandomPruner,
    PoolPruner,
    TemporalPruner,
):
    register_pruner(_cls)
