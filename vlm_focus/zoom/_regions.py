"""Where the zoom looks: the crops grown from a question's attention map."""

from __future__ import annotations

from typing import Any

from ..geometry import Frame, Size, as_size, frame_aspect, native_side
from ..grounding import Box, HeatMap, boxes, point
from ._crop import crop_box, union_box
from ._options import ZoomOptions, merged
from ._reask import MODES


def _min_side(options: ZoomOptions, size: Size, processor: Any) -> float:
    m = options.min_size
    if m == "view":
        try:
            return float(native_side(processor))
        except ValueError as error:
            raise ValueError(f"min_size='view': {error}; pass min_size in pixels") from None
    if isinstance(m, float):
        return m * min(size.width, size.height)
    return float(m)


def _aspect(options: ZoomOptions, heat: HeatMap, size: Size) -> float | None:
    a = options.aspect
    if a == "view":
        _, frames = heat.require_pixels()
        return frame_aspect(frames[0])  # the base view: the model's view of the whole image
    if a == "image":
        return size.width / size.height
    if a == "box":
        return None
    return float(a)


def choose_crops(
    heat: HeatMap,
    options: ZoomOptions | None = None,
    *,
    processor: Any = None,
    mode: str = "crop",
    **overrides: Any,
) -> tuple[list[Box], list[Frame]]:
    """The attention boxes of ``heat`` and the crops grown from them (``options`` as in
    :class:`ZoomOptions`; keywords override it).

    ``anchor="box"``: the map's top ``regions`` boxes (:func:`vlm_focus.grounding.boxes`);
    ``"peak"``: a 1-pixel box at its peak (:func:`vlm_focus.grounding.point`). A map without
    mass anchors at the image's centre. Each box becomes :func:`crop_box` with the margin, the
    minimum side and the aspect; with ``mode="crop"`` several crops merge into one, the crop of
    their union (a one-image prompt has room for one).
    """
    options = merged(options, overrides)
    if mode not in MODES:
        raise ValueError(f"mode={mode!r}; allowed: {MODES}")
    size, _ = heat.require_pixels()
    size = as_size(size)
    found: list[Box] = []
    if heat.mass > 0 and options.anchor == "box":
        found = boxes(heat, threshold=options.box_threshold, max_boxes=options.regions)
    if not found:
        if heat.mass > 0:
            x, y = point(heat)
        else:
            x, y = size.width / 2, size.height / 2
        found = [Box(x - 0.5, y - 0.5, 1.0, 1.0, 0.0)]
    min_side = _min_side(options, size, processor)
    aspect = _aspect(options, heat, size)
    crops = [
        crop_box(b, size, margin=options.margin, min_size=min_side, aspect=aspect) for b in found
    ]
    if mode == "crop" and len(crops) > 1:
        crops = [crop_box(union_box(crops), size, margin=0.0, min_size=min_side, aspect=aspect)]
    return found, crops


def can_crop(options: ZoomOptions, size: Size, processor: Any) -> bool:
    """Whether the zoom can crop the image: its smallest allowed crop is smaller than the image
    (with ``min_size="view"``: the processor shrinks the image)."""
    return _min_side(options, size, processor) < max(size)
