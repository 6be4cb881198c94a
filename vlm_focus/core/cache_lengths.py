"""A pruned layer's cache reports its length in ORIGINAL positions.

A layer at or after a pruning stage holds fewer prompt tokens than the sequence it stands for.
transformers reads a cache's length to decide which tokens of a continued prompt are new
(``generate()`` on a returned cache: a later chat turn), to place the next positions and to
size the attention masks. So each pruned layer of a dynamic cache reports what the unpruned
layer would hold (what it holds, plus the prompt tokens it dropped), and the engine reads what
it physically holds with :func:`held_length`. Relative crops (``crop(-n)``, which assisted
decoding uses to take back rejected tokens) remove the newest tokens, which every layer holds.

The layer object's class is swapped for a subclass that adds the count, so nothing else about
the layer changes; a layer that empties (``reset()``) reports 0 again.
"""

from __future__ import annotations

from typing import Any

_SUBCLASSES: dict[type, type] = {}


def _held_length(self: Any) -> int:
    return type(self).__mro__[1].get_seq_length(self)


def _reported_length(self: Any) -> int:
    held = _held_length(self)
    return held + self._vf_dropped if held else 0


def report_original_length(layer: Any, dropped: int) -> None:
    """Make ``layer`` (a cache layer that dropped ``dropped`` prompt tokens) report the length
    of the unpruned layer."""
    cls = type(layer)
    if not getattr(cls, "_vf_reports_original", False):
        sub = _SUBCLASSES.get(cls)
        if sub is None:
            body = {
                "_vf_reports_original": True,
                "held_length": _held_length,
                "get_seq_length": _reported_length,
            }
            sub = _SUBCLASSES[cls] = type(f"Pruned{cls.__name__}", (cls,), body)
        layer.__class__ = sub
    layer._vf_dropped = int(dropped)


def held_length(cache: Any, index: int) -> int:
    """How many tokens layer ``index`` of ``cache`` physically holds (0 without a cache)."""
    if cache is None:
        return 0
    layers = getattr(cache, "layers", None)
    if layers is not None and index < len(layers):
        layer = layers[index]
        if getattr(layer, "_vf_reports_original", False):
            return int(layer.held_length())
    return int(cache.get_seq_length(index))
