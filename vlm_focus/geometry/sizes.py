"""Image sizes from what callers hold (PIL images, arrays, mappings), and each image's size in a
batch, checked against the processor's own ``image_sizes``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .shapes import Size


def as_size(value: Any, *, name: str = "size") -> Size:
    """A :class:`Size` from a PIL image, a ``Size``, a ``{"width", "height"}`` mapping or an
    ``[H, W]`` / ``[H, W, C]`` numpy array.

    A bare pair such as ``(640, 480)`` is refused: it could be ``(width, height)`` or
    ``(height, width)``.
    """
    if isinstance(value, Size):
        width, height = value
    elif isinstance(value, Mapping):
        if set(value) != {"width", "height"}:
            raise ValueError(f"{name}={value!r}: a size mapping has exactly 'width' and 'height'")
        width, height = value["width"], value["height"]
    elif isinstance(value, tuple | list):
        raise TypeError(
            f"{name}={value!r} is ambiguous: a bare pair may be (width, height) or (height, "
            "width). Pass the PIL image, vlm_focus.geometry.Size(width=..., height=...) or "
            "{'width': ..., 'height': ...}"
        )
    elif hasattr(value, "ndim") and hasattr(value, "shape") and not hasattr(value, "width"):
        if value.ndim not in (2, 3) or (value.ndim == 3 and value.shape[2] not in (1, 3, 4)):
            raise ValueError(
                f"{name}: an image array is [H, W] or [H, W, C], got shape {list(value.shape)}"
            )
        height, width = int(value.shape[0]), int(value.shape[1])
    elif hasattr(value, "width") and hasattr(value, "height"):  # a PIL image
        width, height = value.width, value.height
    else:
        raise TypeError(
            f"{name}={value!r}: expected a PIL image, a Size(width, height) or a "
            "{'width', 'height'} mapping"
        )
    for axis, v in (("width", width), ("height", height)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name}: {axis}={v!r} must be a positive int (pixels)")
    return Size(int(width), int(height))


#: A batch's sizes: one for every image, one per image in batch order, or per row per image.
Sizes = Size | list[Size] | list[list[Size]]


def as_sizes(value: Any, *, name: str = "images") -> Sizes | None:
    """``value`` (one image/size, a flat list in batch order, or a list per row) as sizes."""
    if value is None:
        return None
    if isinstance(value, list | tuple) and not isinstance(value, Size):
        if not value:
            raise ValueError(f"{name} is empty")
        if all(isinstance(v, int) for v in value):
            return as_size(value, name=name)  # a bare pair: refused as ambiguous
        if all(isinstance(v, list | tuple) and not isinstance(v, Size) for v in value):
            return [
                [as_size(x, name=f"{name}[{b}][{i}]") for i, x in enumerate(row)]
                for b, row in enumerate(value)
            ]
        return [as_size(v, name=f"{name}[{i}]") for i, v in enumerate(value)]
    return as_size(value, name=name)


def images_per_row(given: Sizes | None, blocks: list[int]) -> list[int] | None:
    """How many images each row holds, as ``given`` (the sizes a caller passed, see
    :func:`layout_sizes`) counts them, for rows of ``blocks`` image blocks each: one list per
    row counts its own; a flat list of one size per row (and not one per block) is one image
    per row. ``None`` when the sizes do not tell (none, one for every image, one per block)."""
    if given is None or isinstance(given, Size):
        return None
    if given and isinstance(given[0], list):
        return [len(row) for row in given]
    if len(given) == len(blocks) and len(given) != sum(blocks):
        return [1] * len(blocks)
    return None


def layout_sizes(layouts: list[list[Any]], given: Sizes | None) -> list[list[Size | None]]:
    """Each image's original size, per row: the layout's own (from the processor's
    ``image_sizes``) checked against ``given``, else ``given``'s, else ``None``.

    ``given`` is one size for every image, a flat list (one per row when every row holds one
    image, else one per image in batch order) or a list per row. A given size that contradicts
    the layout's raises, and says so when width and height look swapped.
    """
    counts = [len(row) for row in layouts]
    if given is None:
        per_row: list[list[Size | None]] = [[None] * n for n in counts]
    elif isinstance(given, Size):
        per_row = [[given] * n for n in counts]
    elif given and isinstance(given[0], list):
        if [len(r) for r in given] != counts:
            raise ValueError(
                f"sizes per row {[len(r) for r in given]} do not match the images per row {counts}"
            )
        per_row = [list(r) for r in given]
    elif len(given) == len(counts) and all(n == 1 for n in counts):
        per_row = [[s] for s in given]
    elif len(given) == sum(counts):
        it = iter(given)
        per_row = [[next(it) for _ in range(n)] for n in counts]
    else:
        raise ValueError(
            f"got {len(given)} image sizes for {len(counts)} rows holding {sum(counts)} images "
            f"({counts} per row): pass one per image, in batch order"
        )
    out = []
    for b, (row, sizes) in enumerate(zip(layouts, per_row, strict=True)):
        resolved = []
        for i, (layout, size) in enumerate(zip(row, sizes, strict=True)):
            known = layout.image_size
            if known is not None and size is not None and size != known:
                swapped = Size(known.height, known.width) == size
                raise ValueError(
                    f"row {b}, image {i}: the given size {size} contradicts the processor's "
                    f"image_sizes {known}"
                    + (
                        ": width and height look swapped (Size is (width, height))"
                        if swapped
                        else ""
                    )
                )
            resolved.append(known if known is not None else size)
        out.append(resolved)
    return out


def unknown_size_message(model_type: str | None, row: int, image: int) -> str:
    return (
        f"the original size of image {image} in row {row} is unknown ({model_type!r} processor "
        "outputs do not carry it), so pixel coordinates cannot be given. Pass images= (the PIL "
        "images given to the processor) or sizes=Size(width=..., height=...); grid-cell maps "
        "(.grid, .views) need neither"
    )
