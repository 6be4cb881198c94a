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
default and help (``vlm-focus pruners`` prints them all; so does the table in docs/pruners.md).
``vf.pruners.get_pruner(name)`` and the other names of this module are reachable from
``vf.pruners`` too.
"""

from __future__ import annotations

from ..core.options import OptionInfo
from ..core.pruner import NoOptions, Pruner, Selection, StageContext, apply_rope
from ..core.registry import (
    get_pruner,
    pruner_options,
    pruner_options_markdown,
    pruners,
    pruners_with,
    read_pruner_options,
    register_pruner,
    video_pruner_class,
)

# Importing each built-in registers it (``@register_pruner`` on its class).
from . import baselines, debiased, diverse, fastv, fixation, guided, pyramid, text  # noqa: F401
from ._math import split_budget, tile_index
from .baselines import spread_order
from .guided import guided_generate

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
    "pruners_with",
    "read_pruner_options",
    "register_pruner",
    "split_budget",
    "spread_order",
    "tile_index",
    "video_pruner_class",
]
