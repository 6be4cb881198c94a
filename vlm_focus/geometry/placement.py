"""Where each view's grid sits on the original image: a simple placement rule, the processor's
own arithmetic, or the model adapter's fallback; and the check that a size can be the image's."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .processors import (
    PROCESSOR_RULES,
    check_processor_rule,
    image_processor_of,
    pan_and_scan_crops,
    processor_frames,
    smart_resize_grid,
    tile_frames,
    tile_grid,
)
from .shapes import Frame, Size
from .sizes import as_size

#: Simple placement rules, for ``geometry=`` and the adapters' fallbacks: ``"resize"`` (the whole
#: image squashed to the grid), ``"crop"`` (the central ``min(w, h)`` square: shortest side
#: resized, then centre-cropped), ``"pad"`` (padded to a ``max(w, h)`` square, as LLaVA-1.5's
#: ``expand2square`` and ``LlavaImageProcessor(do_pad=True)``).
RULES = ("resize", "crop", "pad")


def rule_frame(size: Size, rule: str) -> Frame:
    """The frame of a simple placement rule (:data:`RULES`) on a ``size`` image."""
    if rule not in RULES:
        raise ValueError(f"geometry={rule!r}; allowed: {RULES}")
    width, height = size
    if rule == "resize":
        return Frame(0.0, 0.0, float(width), float(height))
    if rule == "crop":
        side = float(min(width, height))
        return Frame((width - side) / 2, (height - side) / 2, side, side)
    side = max(width, height)  # pasted at integer offsets, as pad_to_square does
    return Frame(
        -float((side - width) // 2), -float((side - height) // 2), float(side), float(side)
    )


def _consistent(grid: tuple[int, int], size: Size) -> bool:
    """Whether a grid that follows the image's aspect ratio can come from ``size``: some scale
    ``s`` puts both ``rows`` and ``cols`` within one cell of ``height * s`` and ``width * s``."""
    rows, cols = grid
    lo = max((rows - 1) / size.height, (cols - 1) / size.width)
    hi = min((rows + 1) / size.height, (cols + 1) / size.width)
    return lo < hi


def check_size(
    layout: Any,
    size: Size,
    *,
    image_processor: Any = None,
    processor_rule: str | None = None,
    aspect: bool = False,
    where: str = "",
) -> None:
    """Raise when ``size`` cannot be the original size of ``layout``'s image: a
    dynamic-resolution processor's (``processor_rule="dynamic"``) grid must equal its
    ``smart_resize`` grid, and (``aspect``) a grid that follows the image's aspect ratio must
    fit it; a tiling processor's (``"tiled"``) tile count must be the layout's. The message
    says when width and height look swapped."""
    if layout.kind == "video":
        return
    grid = tuple(int(v) for v in layout.grids[0])
    swapped = Size(size.height, size.width)
    if processor_rule is not None:
        check_processor_rule(processor_rule)
    if processor_rule == "tiled":
        _check_tiles(layout, size, image_processor, where)
        return
    if processor_rule == "pan_and_scan" and len(layout.grids) > 1:
        try:
            pan_and_scan_crops(size, len(layout.grids) - 1)
        except ValueError as err:
            raise ValueError(f"{where}size {size} cannot be this image's: {err}") from None
        return
    dynamic = image_processor is not None and processor_rule == "dynamic"
    if dynamic and smart_resize_grid(size, image_processor) == grid:
        return
    if dynamic and smart_resize_grid(swapped, image_processor) == grid:
        swapped_fits = True  # the processor's own arithmetic gives this grid to the swap
    elif (dynamic or aspect) and not _consistent(grid, size):
        swapped_fits = _consistent(grid, swapped)
    else:  # consistent (a processor called with other pixel limits), or nothing to check
        return
    hint = (
        "; width and height look swapped (Size is (width, height), PIL's image.size order)"
        if swapped_fits
        else ""
    )
    raise ValueError(
        f"{where}size {size} cannot be this image's: its grid is {grid} (rows, cols), which "
        f"does not follow that aspect ratio{hint}"
    )


def _check_tiles(layout: Any, size: Size, image_processor: Any, where: str) -> None:
    """A tiled image's tile count must be the one the processor gives ``size`` (width and
    height swapped give the same count, so a swap goes unseen here). An image of
    one view may be any size: the processor shows every image whole when called with
    ``crop_to_patches=False``, and without the processor any count is possible."""
    tiles = len(layout.grids) - 1
    if image_processor is None or tiles < 1:
        return
    rows, cols = tile_grid(size, image_processor)
    if rows * cols != tiles:  # a swapped size gives the transposed canvas: the same count
        raise ValueError(
            f"{where}size {size} cannot be this image's: the processor cuts it into "
            f"{rows}x{cols} tiles, but the image has {tiles}"
        )


def view_frames(
    layout: Any,
    size: Size,
    *,
    processor: Any = None,
    processor_rule: str | None = None,
    rule: str | None = None,
    fallback: Sequence[str] = ("resize",),
) -> list[Frame]:
    """Per view of ``layout`` (an :class:`~vlm_focus.model_adapters.ImageLayout`), the frame its
    grid spans on the ``size`` original image.

    ``rule`` (one of :data:`RULES`) forces one placement for every view; else the processor's
    settings decide, by its family's arithmetic ``processor_rule`` (:func:`processor_frames`);
    else ``fallback``, one rule per view (the last one repeats). Both come from the model
    adapter, whose :meth:`~vlm_focus.model_adapters.ModelAdapter.frames` is the usual entry.
    """
    size = as_size(size)
    n_views = len(layout.grids)
    if rule is not None:
        return [rule_frame(size, rule)] * n_views
    image_processor = image_processor_of(processor)
    if image_processor is not None:
        if processor_rule is None:
            raise ValueError(
                f"processor={type(processor).__name__} needs processor_rule= (one of "
                f"{PROCESSOR_RULES}): the model adapter declares it; call "
                "get_adapter(model).frames(layout, size, processor=processor)"
            )
        return processor_frames(image_processor, layout, size, processor_rule=processor_rule)
    if layout.kind == "video":
        return [rule_frame(size, "resize")] * n_views
    if processor_rule == "tiled" and n_views > 1:  # the view count tells the tile count
        return tile_frames(size, tile_grid(size, tiles=n_views - 1), n_views)
    rules = list(fallback) or ["resize"]
    if processor_rule == "pan_and_scan" and n_views > 1:  # the view count tells the crops
        return [rule_frame(size, rules[0]), *pan_and_scan_crops(size, n_views - 1)]
    return [rule_frame(size, rules[min(v, len(rules) - 1)]) for v in range(n_views)]
