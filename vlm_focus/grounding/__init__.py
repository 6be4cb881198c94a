"""Grounding from a VLM's own attention: maps, points, boxes, region scores, localization heads.

    from vlm_focus import grounding
    maps = grounding.heatmap(model, inputs, "red_circle", tokenizer=processor)
    x, y = grounding.point(maps[0][0])
    best = grounding.boxes(maps[0][0])[0]            # Box(x, y, w, h, score) in image pixels
    grounding.region_score(model, inputs, best.xywh, "red_circle", tokenizer=processor)

Everything runs under SDPA: attention rows are recomputed from each layer's q/k through hooks.
"""

from ._boxes import Box, boxes, iou, point
from ._describe import Described, GroundedPhrase, describe_and_ground
from ._heads import LocalizationHeads, load_heads, save_heads, select_localization_heads
from ._maps import GENERIC_PROMPT, GEOMETRIES, HeatMap, heatmap
from ._region import box_share, region_score

__all__ = [
    "GENERIC_PROMPT",
    "GEOMETRIES",
    "Box",
    "Described",
    "GroundedPhrase",
    "HeatMap",
    "LocalizationHeads",
    "box_share",
    "boxes",
    "describe_and_ground",
    "heatmap",
    "iou",
    "load_heads",
    "point",
    "region_score",
    "save_heads",
    "select_localization_heads",
]
