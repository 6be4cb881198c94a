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

``vf.pruners()`` lists the names and ``vf.pruner_options(name)`` each option's name, type,
default and help (``vlm-focus pruners`` prints them all; so does the README's table).
``vf.pruners.get_pruner(name)`` and the other names of this module are reachable from
``vf.pruners`` too.
"""

from __future__ import annotations

import re
import sys
from typing import Any

from .._options import OptionInfo, options, options_markdown
from ._math import split_budget
from .base import NoOptions, Pruner, Selection, StageContext, apply_rope
from .baselines import PoolPruner, RandomPruner, TemporalPruner, spread_order
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
    "OptionInfo",
    "get_pruner",
    "guided_generate",
    "pruner_options",
    "pruner_options_markdown",
    "pruners",
    "register_pruner",
    "split_budget",
    "spread_order",
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


class _PrunerNames:
    """``pruners()``: the names of the registered pruners. Because ``vf.pruners`` is this
    callable rather than the module, attribute access reaches the module's names:
    ``vf.pruners.get_pruner("debiased")``, ``vf.pruners.pruner_options("text")``."""

    def __call__(self) -> list[str]:
        return sorted(_PRUNERS)

    def __getattr__(self, name: str) -> Any:
        try:
            return getattr(sys.modules[__name__], name)
        except AttributeError:
            raise AttributeError(
                f"vlm_focus.pruners has no {name!r}; it has: {', '.join(__all__)}"
            ) from None

    def __dir__(self) -> list[str]:
        return list(__all__)

    def __repr__(self) -> str:
        return "<vlm_focus.pruners(): names of the registered pruners>"


pruners = _PrunerNames()


def get_pruner(name: str) -> type[Pruner]:
    """The registered :class:`Pruner` class of ``name``."""
    if not isinstance(name, str) or name not in _PRUNERS:
        raise ValueError(f"unknown pruner {name!r}; registered: {', '.join(pruners())}")
    return _PRUNERS[name]


def pruner_options(name: str) -> list[OptionInfo]:
    """The options of pruner ``name`` (its ``Options`` dataclass), each with its name, type,
    default and help, in field order; pass them to ``vf.wrap`` as keywords. The options every
    pruner takes (``keep``, ``layer``, ...) are :class:`~vlm_focus.FocusConfig`'s."""
    return options(get_pruner(name).Options)


def pruner_options_markdown() -> str:
    """The README's pruner-options table: one row per option of every registered pruner."""
    rows = [(name, info) for name in pruners() for info in pruner_options(name)]
    return options_markdown(rows, first="pruner")


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
