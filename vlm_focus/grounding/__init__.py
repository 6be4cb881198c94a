"""Grounding from a VLM's own attention: maps, points, boxes, region scores, localization heads.

    import vlm_focus as vf
    found = vf.ground(model, processor, image, "red_circle")   # one call, the image's pixels
    found.present, found.presence          # the model's own P(yes), against its threshold
    found.point, found.boxes[0], found.map.pixels      # None and [] when it is not there
    found.seen                             # the part of the photo the model saw
    found.unknown_words                    # words its tokenizer cannot spell (warned)

    from vlm_focus import grounding
    gp = grounding.GroundingPass(model, inputs, processor=processor, images=[image])
    heat = gp.map("red_circle")                     # HeatMap: .grid cells, .pixels [H, W]
    x, y = gp.point("red_circle")                   # peak in image pixels
    best = gp.boxes("red_circle")[0]                # Box(x0, y0, width, height, score), pixels
    gp.region_score("red_circle", best)             # MTLA share, one per batch row

Maps average the model's default layers (:func:`default_layers`: the measured choice its
``config.json`` stores, else the first quarter of its layers) unless ``layers=`` or ``heads=``
say otherwise. One forward pass serves every phrase of the prompt and of a generated
``answer=``. Where the grid cells sit in the photo comes from :mod:`vlm_focus.geometry`, which
reads the processor's own settings; pass ``images=`` (or ``sizes=``) where the inputs do not
carry the original size. A :class:`Box` is a :class:`vlm_focus.geometry.Frame` (the package's
one rectangle type) with a score.
Everything runs under SDPA: attention rows are recomputed from each layer's q/k through hooks.
"""

from ._boxes import Box, boxes, iou, point
from ._defaults import (
    CONFIG_KEY,
    LAYER_SHARE,
    PRESENCE_THRESHOLD,
    default_layers,
    presence_threshold,
    rule_layers,
)
from ._describe import Described, GroundedPhrase, describe_and_ground
from ._heads import LocalizationHeads, load_heads, save_heads, select_localization_heads
from ._heatmap import HeatMap
from ._pass import GENERIC_PROMPT, GroundingPass, Mention, UnseenRegionWarning
from ._presence import PRESENCE_PROMPT, presence
from ._region import box_share
from ._token_masks import unknown_words
from ._words import STOP_WORDS
from ._wrappers import Grounding, UnknownWordWarning, ground, heatmap, region_score

__all__ = [
    "CONFIG_KEY",
    "LAYER_SHARE",
    "PRESENCE_PROMPT",
    "PRESENCE_THRESHOLD",
    "GENERIC_PROMPT",
    "STOP_WORDS",
    "Box",
    "Described",
    "GroundedPhrase",
    "Grounding",
    "GroundingPass",
    "HeatMap",
    "LocalizationHeads",
    "Mention",
    "UnknownWordWarning",
    "UnseenRegionWarning",
    "box_share",
    "boxes",
    "default_layers",
    "describe_and_ground",
    "ground",
    "heatmap",
    "iou",
    "load_heads",
    "point",
    "presence",
    "presence_threshold",
    "region_score",
    "rule_layers",
    "save_heads",
    "select_localization_heads",
    "unknown_words",
]
