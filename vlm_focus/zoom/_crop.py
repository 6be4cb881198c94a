"""Crop arithmetic on :mod:`vlm_focus.geometry` sizes: from an attention box to the region that
is cropped at full resolution and asked about again.

All coordinates are original image pixels, ``(x, y)`` with ``x`` to the right; boxes and crops
are :class:`~vlm_focus.geometry.Frame` values (``[x, y, w, h]`` lists are read with
:func:`~vlm_focus.geometry.as_frame`). A crop is a frame in whole pixels inside its image:
``image.crop(crop.xyxy)`` cuts it. Nothing here reads a model: the rules are pure functions of
the box, the image :class:`~vlm_focus.geometry.Size` and the options, so they are tested on
constructed boxes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from ..geometry import Frame, as_frame, as_size


def crop_box(
    box: Any,
    size: Any,
    *,
    margin: float = 0.25,
    min_size: float = 0.0,
    aspect: float | None = None,
) -> Frame:
    """The crop, in whole pixels, for an attention ``box`` (a frame or ``[x, y, w, h]``) on a
    ``size`` image.

    With the box (clipped to the image) centred at ``(cx, cy)``:

    1. margin: ``w' = w (1 + 2 margin)``, ``h' = h (1 + 2 margin)`` (``margin`` of the box's
       side on each side);
    2. minimum size: each side at least ``min_size`` pixels;
    3. aspect: the shorter side grown until ``width / height = aspect`` (``None``: keep);
    4. fit: when the crop exceeds the image it shrinks, aspect kept, to the largest such crop
       inside the image, but never below the margin box (clipped to the image): the box wins
       over the aspect, the aspect over the minimum size;
    5. placement: centred on the box, then shifted (not shrunk) to lie inside the image, and
       rounded outwards to whole pixels.

    The crop therefore always lies inside the image and contains the box, and it meets the
    margin and the minimum size wherever the image is large enough.
    """
    size = as_size(size)
    for name, value in (("margin", margin), ("min_size", min_size)):
        if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0:
            raise ValueError(f"{name}={value!r} must be a number >= 0")
    if aspect is not None and (isinstance(aspect, bool) or not float(aspect) > 0):
        raise ValueError(f"aspect={aspect!r} must be a width/height ratio > 0, or None")
    width, height = float(size.width), float(size.height)
    x, y, w, h = as_frame(box).xywh
    x0, y0 = min(max(x, 0.0), width), min(max(y, 0.0), height)  # clip to the image
    x1, y1 = min(max(x + w, 0.0), width), min(max(y + h, 0.0), height)
    cx, cy = (x0 + x1) / 2, (y0 + y1) / 2
    need_w = min((x1 - x0) * (1 + 2 * margin), width)  # the margin box, inside the image
    need_h = min((y1 - y0) * (1 + 2 * margin), height)
    cw, ch = max(need_w, float(min_size)), max(need_h, float(min_size))
    if aspect is not None:
        a = float(aspect)
        if cw / max(ch, 1e-9) < a:
            cw = ch * a
        else:
            ch = cw / a
        if cw > width or ch > height:
            scale = min(width / cw, height / ch)
            cw, ch = cw * scale, ch * scale
    cw, ch = max(min(cw, width), need_w, 1.0), max(min(ch, height), need_h, 1.0)
    left = min(max(cx - cw / 2, 0.0), width - cw)
    top = min(max(cy - ch / 2, 0.0), height - ch)
    ix0, iy0 = max(math.floor(left + 1e-9), 0), max(math.floor(top + 1e-9), 0)
    ix1 = min(math.ceil(left + cw - 1e-9), size.width)
    iy1 = min(math.ceil(top + ch - 1e-9), size.height)
    return Frame(ix0, iy0, max(ix1 - ix0, 1), max(iy1 - iy0, 1))


def union_box(boxes: Sequence[Any]) -> Frame:
    """The smallest rectangle holding every box (frames or ``[x, y, w, h]``)."""
    if not boxes:
        raise ValueError("union_box needs at least one box")
    parts = [as_frame(b, name=f"boxes[{i}]") for i, b in enumerate(boxes)]
    x0, y0 = min(p.x0 for p in parts), min(p.y0 for p in parts)
    x1, y1 = max(p.x1 for p in parts), max(p.y1 for p in parts)
    return Frame(x0, y0, x1 - x0, y1 - y0)
