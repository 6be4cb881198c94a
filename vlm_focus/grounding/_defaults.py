"""The grounding defaults of a model: which decoder layers its maps average, and the threshold
above which its presence score says "present". One home: every caller that grounds without
``layers=`` (``vf.ground``, ``GroundingPass``, ``heatmap``, the demo, ``vlm-focus eval coco``)
asks :func:`default_layers`.

A model carries its measured choice as data in its own ``config.json``::

    "vlm_focus_grounding": {"layers": [0], "presence_threshold": 0.5}

(the embedded organisms do; ``benchmarks/grounding_layers.py`` and
``benchmarks/grounding_presence.py`` measure the values). transformers keeps the key on
``model.config`` and writes it back with ``save_pretrained``. A model without it gets the rule
:data:`LAYER_SHARE`: the first quarter of its decoder layers. On a hybrid decoder (Qwen3.5) the
rule counts its full-attention layers only, the ones with attention rows to read.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from torch import nn

from ..core.probe import attention_layers

#: The ``config.json`` key holding a model's measured grounding defaults.
CONFIG_KEY = "vlm_focus_grounding"
#: Without a stored choice, maps average the first ``ceil(LAYER_SHARE * n_layers)`` decoder
#: layers. Measured on the three organisms only (``benchmarks/results/grounding_layers.md``):
#: the best window of layers on calibration scenes is layer 0 of 4 (organism-default), 0-1 of
#: 8 (organism-deep) and 0 of 3 (organism-guide), which this rule gives; held-out pointing
#: 0.814 / 0.910 / 0.631 against 0.541 / 0.517 / 0.614 for every layer. No real checkpoint was
#: measured: a model that reads its image later than the organisms needs its own stored choice.
LAYER_SHARE = 0.25
#: Without a stored threshold a phrase counts as present when the model's own answer is yes:
#: ``P(yes) > P(no)``. The organisms' thresholds, chosen on calibration scenes, are 0.699
#: (organism-default) and 0.505 (organism-deep) (``benchmarks/results/grounding_presence.md``).
PRESENCE_THRESHOLD = 0.5


def _stored(model: nn.Module) -> Mapping[str, Any]:
    value = getattr(getattr(model, "config", None), CONFIG_KEY, None)
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ValueError(
            f"config.{CONFIG_KEY}={value!r} must be a mapping such as "
            '{"layers": [0], "presence_threshold": 0.5}'
        )
    return value


def rule_layers(n_layers: int) -> list[int]:
    """The rule for a model without a stored choice: layers ``[0, ceil(LAYER_SHARE * n))``."""
    if isinstance(n_layers, bool) or not isinstance(n_layers, int) or n_layers < 1:
        raise ValueError(f"n_layers={n_layers!r} must be a positive int")
    return list(range(max(1, math.ceil(LAYER_SHARE * n_layers))))


def default_layers(model: nn.Module) -> list[int]:
    """The decoder layers whose attention a map averages when no ``layers=`` (nor ``heads=``)
    is given: ``config.vlm_focus_grounding["layers"]`` when the model stores them (measured on
    that model), else :func:`rule_layers` of its layer count. On a hybrid decoder the rule
    picks among the full-attention layers (:func:`~vlm_focus.core.probe.attention_layers`):
    the first ``ceil(LAYER_SHARE * n_full)`` of them."""
    usable = attention_layers(model)
    stored = _stored(model).get("layers")
    if stored is None:
        return [usable[i] for i in rule_layers(len(usable))]
    try:
        return attention_layers(model, list(stored))
    except (TypeError, ValueError) as err:
        raise ValueError(
            f"config.{CONFIG_KEY}['layers']={stored!r} does not fit this model: {err}"
        ) from None


def presence_threshold(model: nn.Module) -> float:
    """The presence score above which a phrase counts as present:
    ``config.vlm_focus_grounding["presence_threshold"]`` (chosen on calibration scenes) or
    :data:`PRESENCE_THRESHOLD` (the model's own yes/no decision)."""
    value = _stored(model).get("presence_threshold", PRESENCE_THRESHOLD)
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < 1:
        raise ValueError(
            f"config.{CONFIG_KEY}['presence_threshold']={value!r} must be a number in (0, 1)"
        )
    return float(value)
