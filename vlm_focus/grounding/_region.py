"""Region scores: the attention a prediction's tokens put inside the box it claims (MTLA)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..geometry import Size, box_cover
from ._boxes import Box
from ._maps import HeatMap


def _check_box(box: Any, size: Size) -> list[float]:
    if isinstance(box, Box):
        box = box.xywh
    if isinstance(box, torch.Tensor):
        box = box.tolist()
    if not isinstance(box, Sequence) or len(box) != 4:
        raise TypeError(f"a box is [x, y, w, h] in image pixels, got {box!r}")
    x, y, w, h = (float(v) for v in box)
    if w <= 0 or h <= 0:
        raise ValueError(f"box {box} has a non-positive width or height")
    tol = 1e-6 * max(size)
    if x < -tol or y < -tol or x + w > size.width + tol or y + h > size.height + tol:
        raise ValueError(f"box {box} lies outside the {size.width}x{size.height} (W x H) image")
    return [x, y, w, h]


def box_share(heat: HeatMap, box: Any) -> float:
    """Share of the map's grid mass inside ``box`` (``[x, y, w, h]`` in original pixels; cells
    weighted by the share of their area the box covers).

    ``share = sum_v sum_c a_c * |cell_c & box| / |cell_c|  /  sum_v sum_c a_c``
    """
    size, frames = heat.require_pixels()
    box = _check_box(box, size)
    inside = total = 0.0
    for grid, frame in zip(heat.views, frames, strict=True):
        cover = box_cover(frame, tuple(grid.shape), box)  # [rows, cols]
        inside += float((grid.double() * cover).sum())
        total += float(grid.double().sum())
    return inside / total if total > 0 else 0.0
