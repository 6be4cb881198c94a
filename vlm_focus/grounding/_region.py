"""Region scores: the attention a prediction's tokens put inside the box it claims (MTLA)."""

from __future__ import annotations

from typing import Any

from ..geometry import Frame, Size, as_frame, box_cover
from ._heatmap import HeatMap


def _check_box(box: Any, size: Size) -> Frame:
    """``box`` as a :class:`~vlm_focus.geometry.Frame` with a positive area inside the ``size``
    image (to a millionth of its side)."""
    rect = as_frame(box)
    if rect.width <= 0 or rect.height <= 0:
        raise ValueError(f"box {rect.xywh} has a non-positive width or height")
    tol = 1e-6 * max(size)
    if (
        rect.x0 < -tol
        or rect.y0 < -tol
        or rect.x1 > size.width + tol
        or rect.y1 > size.height + tol
    ):
        raise ValueError(
            f"box {rect.xywh} lies outside the {size.width}x{size.height} (W x H) image"
        )
    return rect


def box_share(heat: HeatMap, box: Any) -> float:
    """Share of the map's grid mass inside ``box`` (a :class:`~vlm_focus.geometry.Frame` or
    ``[x, y, w, h]``, in original pixels; cells weighted by the share of their area the box
    covers).

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
