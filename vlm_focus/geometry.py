"""Image geometry: where each view's grid cells sit in the original image, in pixels.

This module is the one place that maps grid cells to original pixels. Grounding maps, boxes and
region scores, COCO evaluation, the demo's overlays, the debiased pruner's padding weights and
the zoom's crops all call it; it also reads the encoder's input side (:func:`native_side`).

Coordinates are ``(x, y)`` throughout, and sizes are named: :class:`Size` is
``(width, height)``, as PIL's ``image.size`` is. :class:`Frame` is the one rectangle type of the
package, ``(x0, y0, width, height)`` in original pixels (COCO's ``[x, y, w, h]`` order), checked
in one place (its constructor; :func:`as_frame` reads one from ``[x, y, w, h]``). A view's grid
spans a frame, the rectangle the vision encoder's input covers; the part of the photo the model
saw is one (:func:`seen_region`), as are a zoom crop and a grounding box (a frame with a score).
A view's frame may reach outside the image (padding) or cover only part of it (a centre crop). Cell
``(r, c)`` of a ``rows x cols`` grid covers ``[x0 + c * width / cols, x0 + (c + 1) * width / cols)``
by ``[y0 + r * height / rows, y0 + (r + 1) * height / rows)``.

The frame depends on the *processor* that made the inputs, and on each image's original size.
:func:`view_frames` reads the image processor's own settings and replays its arithmetic on the
rectangle (per axis, processed = ``a * original + b``):

* single-view processors (CLIP, ``LlavaImageProcessor``): ``do_pad`` pads to a square first
  (the image pasted at ``((m - w) // 2, (m - h) // 2)`` on an ``m = max(w, h)`` square), then
  ``do_resize`` resizes to ``size`` (``shortest_edge``: the short side to that length and the long
  side to ``int(s * long / short)``; ``height``/``width``: squashed), then ``do_center_crop``
  takes ``crop_size`` from the centre (offset ``floor((n - c) / 2)``). A CLIP-style processor's
  frame is therefore the central region of side ``crop / scale``, not always the whole short side;
* anyres processors (``image_grid_pinpoints``; LLaVA-NeXT and LLaVA-OneVision): the base view is
  the whole image squashed to ``size`` (then ``size`` and ``crop_size`` as above); the
  high-resolution view is the best pinpoint resolution, the image resized into it keeping its
  aspect and centred, cut into ``crop``-pixel crops, with the rows (or columns) the model's
  ``unpad_image`` drops removed: it spans the image up to a fraction of a token. Here ``do_pad``
  means batch padding, not padding to a square. An image the processor does not tile (a
  LLaVA-OneVision prompt with several images) has one view, padded to a square first;
* dynamic-resolution processors (``merge_size`` and ``patch_size``; Qwen2-VL, Qwen2.5-VL,
  Qwen3-VL): the whole image squashed to the ``smart_resize`` size, whose merged grid follows the
  image's aspect ratio, so a size given as ``(height, width)`` instead of ``(width, height)`` is
  caught;
* video frames are squashed to the grid (the frame is the whole frame).

Which of these three the processor follows is the model adapter's declaration
(``ModelAdapter.processor_rule``, one of :data:`PROCESSOR_RULES`); the processor's settings give
the numbers. Without a processor the model adapter's fallback rule applies
(``ModelAdapter.fallback_geometry``; one of :data:`RULES` per view). A fallback is a guess about
the processor; pass ``processor=`` for exact frames. ``ModelAdapter.frames`` is the one entry
that reads both declarations.

When the original size is unknown (LLaVA's and Qwen's processor outputs do not carry it, while
LLaVA-NeXT's and LLaVA-OneVision's ``image_sizes`` do), pixel maps raise and say what to pass;
grid-cell maps stay available.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

#: Simple placement rules, for ``geometry=`` and the adapters' fallbacks: ``"resize"`` (the whole
#: image squashed to the grid), ``"crop"`` (the central ``min(w, h)`` square: shortest side
#: resized, then centre-cropped), ``"pad"`` (padded to a ``max(w, h)`` square, as LLaVA-1.5's
#: ``expand2square`` and ``LlavaImageProcessor(do_pad=True)``).
RULES = ("resize", "crop", "pad")

#: The arithmetic an image processor family places the image by, as a model adapter declares
#: it (``ModelAdapter.processor_rule``): ``"single"`` (one view: pad to a square, resize,
#: centre crop, as CLIP's and ``LlavaImageProcessor`` do), ``"anyres"`` (a base view and a
#: tiled high-resolution view from ``image_grid_pinpoints``), ``"dynamic"`` (the whole image
#: squashed to the ``smart_resize`` size, Qwen-VL's).
PROCESSOR_RULES = ("single", "anyres", "dynamic")


class Size(NamedTuple):
    """An image size in pixels, named: ``Size(width, height)`` (PIL's ``image.size`` order)."""

    width: int
    height: int


@dataclass(frozen=True)
class Frame:
    """A rectangle in original image pixels: top-left corner ``(x0, y0)``, ``width`` and
    ``height`` (COCO's ``[x, y, w, h]`` order); the bottom-right corner is ``(x1, y1)``.

    The one rectangle type: a view's grid frame (floats, may reach outside the image), the seen
    region, a zoom crop (whole pixels) and, with a score, a grounding
    :class:`~vlm_focus.grounding.Box`. The fields are named after what they hold: ``x0``/``y0``
    say "corner" (``x1``/``y1`` are the other one), ``width``/``height`` are spelled as in
    :class:`Size`. Every value must be a finite number, ``width`` and ``height`` at least 0;
    anything else raises when the frame is built.
    """

    x0: float
    y0: float
    width: float
    height: float

    def __post_init__(self) -> None:
        for name in ("x0", "y0", "width", "height"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise TypeError(
                    f"{type(self).__name__}: {name}={value!r} must be a number (image pixels)"
                )
            if not math.isfinite(value):
                raise ValueError(f"{type(self).__name__}: {name}={value!r} must be finite")
        if self.width < 0 or self.height < 0:
            raise ValueError(
                f"{type(self).__name__}: width={self.width!r} and height={self.height!r} must "
                "be >= 0"
            )

    @property
    def x1(self) -> float:
        """The right edge, ``x0 + width``."""
        return self.x0 + self.width

    @property
    def y1(self) -> float:
        """The bottom edge, ``y0 + height``."""
        return self.y0 + self.height

    @property
    def xywh(self) -> list[float]:
        """``[x0, y0, width, height]`` (COCO's ``bbox``)."""
        return [self.x0, self.y0, self.width, self.height]

    @property
    def xyxy(self) -> tuple[float, float, float, float]:
        """``(x0, y0, x1, y1)``: the corners, what ``PIL.Image.crop`` takes."""
        return self.x0, self.y0, self.x1, self.y1

    @property
    def area(self) -> float:
        return self.width * self.height

    def contains(self, x: float, y: float) -> bool:
        """Whether the point ``(x, y)`` lies inside the rectangle (edges included)."""
        return self.x0 <= x <= self.x1 and self.y0 <= y <= self.y1

    def covers(self, other: Any) -> bool:
        """Whether the whole rectangle ``other`` (a frame or ``[x, y, w, h]``) lies inside."""
        other = as_frame(other)
        return (
            self.x0 <= other.x0
            and self.y0 <= other.y0
            and other.x1 <= self.x1
            and other.y1 <= self.y1
        )

    def is_whole(self, size: Size) -> bool:
        """Whether the rectangle is exactly the whole ``size`` image."""
        return self.xywh == [0, 0, size.width, size.height]

    def cells(self, grid: tuple[int, int]) -> torch.Tensor:
        """``[rows, cols, 4]`` float64 pixel rectangles ``(x_lo, y_lo, x_hi, y_hi)`` of a
        ``(rows, cols)`` grid's cells."""
        rows, cols = _grid(grid)
        xs = self.x0 + torch.arange(cols + 1, dtype=torch.float64) * self.width / cols
        ys = self.y0 + torch.arange(rows + 1, dtype=torch.float64) * self.height / rows
        lo_x, hi_x = xs[None, :-1].expand(rows, cols), xs[None, 1:].expand(rows, cols)
        lo_y, hi_y = ys[:-1, None].expand(rows, cols), ys[1:, None].expand(rows, cols)
        return torch.stack([lo_x, lo_y, hi_x, hi_y], dim=-1)

    def cell_centre(self, row: int, col: int, grid: tuple[int, int]) -> tuple[float, float]:
        """``(x, y)`` in original pixels of the centre of cell ``(row, col)``."""
        rows, cols = _grid(grid)
        return (
            self.x0 + (col + 0.5) * self.width / cols,
            self.y0 + (row + 0.5) * self.height / rows,
        )

    def cell_at(self, x: float, y: float, grid: tuple[int, int]) -> tuple[int, int] | None:
        """``(row, col)`` of the cell holding original pixel point ``(x, y)``, or ``None``
        outside the frame."""
        rows, cols = _grid(grid)
        u, v = (x - self.x0) / self.width, (y - self.y0) / self.height
        if not (0 <= u < 1 and 0 <= v < 1):
            return None
        return int(v * rows), int(u * cols)


def _grid(grid: Any) -> tuple[int, int]:
    rows, cols = (int(v) for v in grid)
    if rows < 1 or cols < 1:
        raise ValueError(f"a grid is (rows, cols) >= 1, got {grid!r}")
    return rows, cols


def as_frame(value: Any, *, name: str = "box") -> Frame:
    """``value`` as a :class:`Frame`: a frame (or a grounding ``Box``) as it is, else four
    numbers ``[x, y, w, h]`` in image pixels (a sequence, a tensor or an array), checked by the
    frame's constructor. ``TypeError`` names ``name`` and what was given."""
    if isinstance(value, Frame):
        return value
    if hasattr(value, "tolist") and not isinstance(value, list | tuple):
        value = value.tolist()
    if (
        isinstance(value, str)
        or not isinstance(value, Sequence)
        or len(value) != 4
        or not all(isinstance(v, numbers.Real) and not isinstance(v, bool) for v in value)
    ):
        raise TypeError(
            f"{name} must be [x, y, w, h] in image pixels or a vlm_focus.geometry.Frame, got "
            f"{value!r}"
        )
    try:
        return Frame(*(float(v) for v in value))
    except ValueError as err:
        raise ValueError(f"{name}={list(value)!r}: {err}") from None


# --- sizes -----------------------------------------------------------------------------------
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


# --- frames ----------------------------------------------------------------------------------
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


@dataclass
class _Axis:
    """One axis of the processing chain: processed = ``scale * original + offset`` over a
    processed extent ``n`` (pixels)."""

    scale: float
    offset: float
    n: float

    def pad(self, before: float, n: float) -> None:
        self.offset += before
        self.n = n

    def resize(self, n: float) -> None:
        factor = n / self.n
        self.scale *= factor
        self.offset *= factor
        self.n = n

    def crop(self, start: float, n: float) -> None:
        self.offset -= start
        self.n = n

    def span(self) -> tuple[float, float]:
        """``(start, length)`` of the processed extent in original pixels."""
        return -self.offset / self.scale, self.n / self.scale


class _Chain:
    """The original image's rectangle through pads, resizes and crops (``x`` then ``y``)."""

    def __init__(self, size: Size) -> None:
        self.x = _Axis(1.0, 0.0, float(size.width))
        self.y = _Axis(1.0, 0.0, float(size.height))

    @property
    def hw(self) -> tuple[int, int]:
        return round(self.y.n), round(self.x.n)

    def pad_square(self) -> None:
        h, w = self.hw
        side = max(h, w)
        self.x.pad((side - w) // 2, side)
        self.y.pad((side - h) // 2, side)

    def resize(self, h: int, w: int) -> None:
        self.y.resize(h)
        self.x.resize(w)

    def centre_crop(self, h: int, w: int, torch_backend: bool) -> None:
        for axis, c in ((self.y, h), (self.x, w)):
            n = round(axis.n)
            # PIL backend: floor((n - c) / 2); torchvision pads a too-small image by
            # floor((c - n) / 2) before the crop.
            start = (n - c) // 2 if c <= n or not torch_backend else -((c - n) // 2)
            axis.crop(start, c)

    def frame(self) -> Frame:
        x0, width = self.x.span()
        y0, height = self.y.span()
        return Frame(x0, y0, width, height)


def _get(settings: Any, key: str) -> Any:
    if settings is None:
        return None
    if isinstance(settings, Mapping):
        return settings.get(key)
    return getattr(settings, key, None)


def image_processor_of(processor: Any) -> Any:
    """The image processor inside ``processor`` (or ``processor`` itself when it is one), or
    ``None`` (a bare tokenizer, ``None``)."""
    if processor is None:
        return None
    inner = getattr(processor, "image_processor", None)
    if inner is not None:
        return inner
    if hasattr(processor, "do_resize") and hasattr(processor, "size"):
        return processor
    return None


def _resized(h: int, w: int, size: Any) -> tuple[int, int]:
    """The ``(height, width)`` a processor's ``resize`` gives an ``h x w`` image."""
    short_edge, height, width = (_get(size, k) for k in ("shortest_edge", "height", "width"))
    if _get(size, "longest_edge") is None and short_edge:
        short, long = (w, h) if w <= h else (h, w)
        new_short, new_long = int(short_edge), int(short_edge * long / short)
        return (new_long, new_short) if w <= h else (new_short, new_long)
    if height and width and not short_edge:
        return int(height), int(width)
    raise ValueError(f"image processor size={size!r}: only shortest_edge or height/width resizes")


def _torch_backend(image_processor: Any) -> bool:
    return any(c.__name__ == "TorchvisionBackend" for c in type(image_processor).__mro__)


def _resize_and_crop(chain: _Chain, ip: Any) -> None:
    """The processor's ``do_resize`` (to ``size``) and ``do_center_crop`` (to ``crop_size``)."""
    if _get(ip, "do_resize"):
        chain.resize(*_resized(*chain.hw, ip.size))
    crop = _get(ip, "crop_size")
    height, width = _get(crop, "height"), _get(crop, "width")
    if _get(ip, "do_center_crop") and height and width:
        chain.centre_crop(int(height), int(width), _torch_backend(ip))


def check_processor_rule(processor_rule: Any) -> str:
    """``processor_rule`` if it is one of :data:`PROCESSOR_RULES`, else ``ValueError``."""
    if processor_rule not in PROCESSOR_RULES:
        raise ValueError(
            f"processor_rule={processor_rule!r}; allowed: {PROCESSOR_RULES} (the model "
            "adapter declares its processor's: ModelAdapter.processor_rule)"
        )
    return processor_rule


def _anyres_base(size: Size, ip: Any) -> Frame:
    chain = _Chain(size)
    settings = ip.size
    if _get(settings, "height") and _get(settings, "width"):
        chain.resize(int(_get(settings, "height")), int(_get(settings, "width")))
    else:
        side = int(_get(settings, "shortest_edge"))
        chain.resize(side, side)
    _resize_and_crop(chain, ip)
    return chain.frame()


def best_resolution(size: Size, pinpoints: Sequence[Sequence[int]]) -> tuple[int, int]:
    """The anyres ``(height, width)`` an image is tiled at: the pinpoint that keeps the most of
    the image's pixels after an aspect-preserving downscale, then the least wasted area."""
    best, most, waste = None, 0, math.inf
    for height, width in pinpoints:
        scale = min(width / size.width, height / size.height)
        kept = min(int(size.width * scale) * int(size.height * scale), size.width * size.height)
        wasted = width * height - kept
        if kept > most or (kept == most and wasted < waste):
            best, most, waste = (int(height), int(width)), kept, wasted
    if best is None:
        raise ValueError(f"image_grid_pinpoints={pinpoints!r} holds no resolution")
    return best


def _anyres_composite(size: Size, ip: Any, side: int) -> Frame:
    """The unpadded crop grid: the image resized into the best resolution (aspect kept,
    centred), cut into crops of ``crop`` pixels (``side`` tokens each), minus the token rows or
    columns ``unpad_image`` drops."""
    best_h, best_w = best_resolution(size, ip.image_grid_pinpoints)
    scale_w, scale_h = best_w / size.width, best_h / size.height
    if scale_w < scale_h:
        new_w, new_h = best_w, min(math.ceil(size.height * scale_w), best_h)
    else:
        new_h, new_w = best_h, min(math.ceil(size.width * scale_h), best_w)
    chain = _Chain(size)
    chain.resize(new_h, new_w)
    chain.y.pad((best_h - new_h) // 2, best_h)
    chain.x.pad((best_w - new_w) // 2, best_w)
    crop = _get(ip, "crop_size")
    settings = ip.size
    patch = _get(crop, "height") or _get(settings, "height") or _get(settings, "shortest_edge")
    rows, cols = best_h // int(patch) * side, best_w // int(patch) * side  # padded token grid
    cell_y, cell_x = best_h / rows, best_w / cols
    if size.width / size.height > cols / rows:
        kept = int(round(size.height * cols / size.width, 7))
        pad = (rows - kept) // 2
        chain.y.crop(pad * cell_y, (rows - 2 * pad) * cell_y)
    else:
        kept = int(round(size.width * rows / size.height, 7))
        pad = (cols - kept) // 2
        chain.x.crop(pad * cell_x, (cols - 2 * pad) * cell_x)
    return chain.frame()


def smart_resize_grid(size: Size, ip: Any) -> tuple[int, int]:
    """``(rows, cols)`` of the merged grid a dynamic-resolution processor gives a ``size``
    image: each side rounded to a multiple of ``f = patch_size * merge_size``, then the area
    brought inside ``[min_pixels, max_pixels]`` (``size.shortest_edge`` / ``longest_edge``)
    by one common factor."""
    factor = int(ip.patch_size) * int(ip.merge_size)
    low = _get(ip.size, "shortest_edge") or _get(ip, "min_pixels")
    high = _get(ip.size, "longest_edge") or _get(ip, "max_pixels")
    h, w = size.height, size.width
    h_bar, w_bar = round(h / factor) * factor, round(w / factor) * factor
    if high and h_bar * w_bar > high:
        beta = math.sqrt(h * w / high)
        h_bar = max(factor, math.floor(h / beta / factor) * factor)
        w_bar = max(factor, math.floor(w / beta / factor) * factor)
    elif low and h_bar * w_bar < low:
        beta = math.sqrt(low / (h * w))
        h_bar = math.ceil(h * beta / factor) * factor
        w_bar = math.ceil(w * beta / factor) * factor
    return h_bar // factor, w_bar // factor


def processor_frames(
    image_processor: Any, layout: Any, size: Size, *, processor_rule: str
) -> list[Frame]:
    """Per view of ``layout``, the frame the image processor's own settings give a ``size``
    image by the arithmetic of its family, ``processor_rule`` (one of :data:`PROCESSOR_RULES`;
    see the module docstring for the rules)."""
    ip = image_processor
    n_views = len(layout.grids)
    whole = Frame(0.0, 0.0, float(size.width), float(size.height))
    if layout.kind == "video" or check_processor_rule(processor_rule) == "dynamic":
        return [whole] * n_views
    if processor_rule == "anyres":
        if n_views == 1:  # an image the processor did not tile
            chain = _Chain(size)
            if callable(getattr(ip, "pad_to_square", None)):
                chain.pad_square()
                _resize_and_crop(chain, ip)
                return [chain.frame()]
            return [_anyres_base(size, ip)]
        side = int(layout.grids[0][0])  # the base view is side x side tokens, as is each crop
        return [_anyres_base(size, ip)] + [_anyres_composite(size, ip, side)] * (n_views - 1)
    chain = _Chain(size)
    if _get(ip, "do_pad"):
        chain.pad_square()
    _resize_and_crop(chain, ip)
    return [chain.frame()] * n_views


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
    fit it. The message says when width and height look swapped."""
    if layout.kind == "video":
        return
    grid = tuple(int(v) for v in layout.grids[0])
    swapped = Size(size.height, size.width)
    if processor_rule is not None:
        check_processor_rule(processor_rule)
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
    rules = list(fallback) or ["resize"]
    return [rule_frame(size, rules[min(v, len(rules) - 1)]) for v in range(n_views)]


# --- maps ------------------------------------------------------------------------------------
def upsample(grid_map: torch.Tensor, size: Size, frame: Frame) -> torch.Tensor:
    """``[height, width]`` density of a ``[rows, cols]`` mass map on a ``size`` image: bilinear
    between cell centres (edge cells held constant to the frame border), divided by the cell
    area in pixels, 0 outside the frame. It integrates to the mass of the cells inside the
    image."""
    width, height = as_size(size)
    rows, cols = grid_map.shape
    x0, y0, fw, fh = frame.xywh
    xs = (torch.arange(width, dtype=torch.float32) + 0.5 - x0) / fw  # frame units in [0, 1]
    ys = (torch.arange(height, dtype=torch.float32) + 0.5 - y0) / fh
    sample_at = torch.empty(1, height, width, 2)
    sample_at[..., 0] = (xs * 2 - 1)[None, :]  # x in [-1, 1]
    sample_at[..., 1] = (ys * 2 - 1)[:, None]  # y in [-1, 1]
    src = grid_map.float()[None, None]  # [1, 1, rows, cols]
    values = F.grid_sample(
        src, sample_at, mode="bilinear", padding_mode="border", align_corners=False
    )[0, 0]
    values = values / ((fh / rows) * (fw / cols))
    x_in = (xs >= 0) & (xs <= 1)
    y_in = (ys >= 0) & (ys <= 1)
    if not (bool(y_in.all()) and bool(x_in.all())):
        values = values * (y_in[:, None] & x_in[None, :])
    return values


def coverage(size: Size, frames: Sequence[Frame]) -> torch.Tensor:
    """``[height, width]`` bool: the pixels whose centre lies inside at least one frame (the
    part of the image the encoder saw; a centre crop leaves the sides out)."""
    width, height = as_size(size)
    xs = torch.arange(width, dtype=torch.float64) + 0.5
    ys = torch.arange(height, dtype=torch.float64) + 0.5
    seen = torch.zeros(height, width, dtype=torch.bool)
    for frame in frames:
        inside_x = (xs >= frame.x0) & (xs <= frame.x1)
        inside_y = (ys >= frame.y0) & (ys <= frame.y1)
        seen |= inside_y[:, None] & inside_x[None, :]
    return seen


def _covered(start: float, length: float, n: int) -> tuple[int, int]:
    """``[lo, hi)``: the pixels of an ``n``-pixel axis whose centre ``i + 0.5`` lies in
    ``[start, start + length]`` (as :func:`coverage` counts them)."""
    lo = max(0, math.ceil(start - 0.5))
    hi = min(n, math.floor(start + length - 0.5) + 1)
    return lo, max(lo, hi)


def seen_region(size: Size, frames: Sequence[Frame]) -> tuple[Frame, float]:
    """The part of a ``size`` image the vision encoder saw through ``frames``: the bounding
    rectangle, in whole pixels, of :func:`coverage` (``Frame(0, 0, 0, 0)`` when it covers
    nothing), and the share of the image's pixels covered, ``|coverage| / (width * height)``.
    A CLIP-style centre crop of a wide photo gives the central square and a share below 1."""
    width, height = as_size(size)
    spans = [(_covered(f.x0, f.width, width), _covered(f.y0, f.height, height)) for f in frames]
    spans = [(x, y) for x, y in spans if x[1] > x[0] and y[1] > y[0]]
    if not spans:
        return Frame(0.0, 0.0, 0.0, 0.0), 0.0
    x0, x1 = min(x[0] for x, _ in spans), max(x[1] for x, _ in spans)
    y0, y1 = min(y[0] for _, y in spans), max(y[1] for _, y in spans)
    if len(set(spans)) == 1:  # one rectangle (every single-view processor): its area
        share = (x1 - x0) * (y1 - y0) / (width * height)
    else:  # several views: the area of their union
        share = float(coverage(size, frames).double().mean())
    return Frame(float(x0), float(y0), float(x1 - x0), float(y1 - y0)), share


def describe_seen(size: Size, region: Frame, share: float) -> str:
    """``"x 96-288, y 0-192 of the 384x192 image (50%)"``: a seen region, in words."""
    width, height = as_size(size)
    x0, y0, w, h = (round(v) for v in region.xywh)
    return f"x {x0}-{x0 + w}, y {y0}-{y0 + h} of the {width}x{height} image ({100 * share:.0f}%)"


def content_fraction(frame: Frame, grid: tuple[int, int], size: Size) -> torch.Tensor:
    """``[rows, cols]`` share of each cell's area that the ``size`` image covers, for a grid
    spanning ``frame``: 1 inside the image, 0 for pure padding (a padded frame reaches outside
    ``[0, width) x [0, height)``)."""
    width, height = as_size(size)
    rect = frame.cells(grid)  # [rows, cols, 4] x_lo y_lo x_hi y_hi
    dx = (rect[..., 2].clamp(max=width) - rect[..., 0].clamp(min=0)).clamp(min=0)
    dy = (rect[..., 3].clamp(max=height) - rect[..., 1].clamp(min=0)).clamp(min=0)
    area = (rect[..., 2] - rect[..., 0]) * (rect[..., 3] - rect[..., 1])
    return (dx * dy / area).float()


def box_cover(frame: Frame, grid: tuple[int, int], box: Any) -> torch.Tensor:
    """``[rows, cols]`` float64 share of each cell's area inside ``box`` (a :class:`Frame` or
    ``[x, y, w, h]``)."""
    box = as_frame(box)
    rect = frame.cells(grid)
    dx = (rect[..., 2].clamp(max=box.x1) - rect[..., 0].clamp(min=box.x0)).clamp(min=0)
    dy = (rect[..., 3].clamp(max=box.y1) - rect[..., 1].clamp(min=box.y0)).clamp(min=0)
    area = (rect[..., 2] - rect[..., 0]) * (rect[..., 3] - rect[..., 1])
    return dx * dy / area


def frame_aspect(frame: Frame) -> float:
    """``width / height`` of a view's frame: the shape a crop needs to fill that view exactly
    (1 for a CLIP-style centre crop or a pad to a square; the image's own for a plain resize or
    dynamic resolution)."""
    return float(frame.width) / float(frame.height)


def native_side(processor: Any) -> int:
    """The side, in pixels, of the largest square the image processor shows without shrinking
    it: a crop at least this large reaches the vision encoder at no more than 1:1 scale.

    Read from the processor's settings: ``crop_size`` after a centre crop, else ``size``
    (``shortest_edge``, or the smaller of ``height``/``width``); anyres
    (``image_grid_pinpoints``): the largest pinpoint's ``sqrt(h * w)``; dynamic resolution
    (``merge_size`` and ``patch_size``): ``sqrt(max_pixels)``.
    """
    ip = image_processor_of(processor)
    if ip is None:
        raise ValueError(
            "native_side needs the processor: its image processor's settings give the "
            "encoder's input size"
        )

    size = getattr(ip, "size", None)
    if _get(ip, "merge_size") is not None and _get(ip, "patch_size") is not None:
        high = _get(size, "longest_edge") or _get(ip, "max_pixels")
        if high:
            return max(1, int(math.isqrt(int(high))))
    pinpoints = getattr(ip, "image_grid_pinpoints", None)
    if pinpoints:
        return max(int(math.isqrt(int(h) * int(w))) for h, w in pinpoints)
    crop = getattr(ip, "crop_size", None)
    if getattr(ip, "do_center_crop", False) and crop is not None:
        return int(min(_get(crop, "height"), _get(crop, "width")))
    if _get(size, "shortest_edge"):
        return int(_get(size, "shortest_edge"))
    if _get(size, "height") and _get(size, "width"):
        return int(min(_get(size, "height"), _get(size, "width")))
    raise ValueError(
        f"cannot read the encoder's input size from {type(ip).__name__} (size={size!r})"
    )


__all__ = [
    "PROCESSOR_RULES",
    "RULES",
    "Frame",
    "Size",
    "as_frame",
    "as_size",
    "as_sizes",
    "best_resolution",
    "box_cover",
    "check_processor_rule",
    "check_size",
    "content_fraction",
    "coverage",
    "describe_seen",
    "frame_aspect",
    "image_processor_of",
    "layout_sizes",
    "native_side",
    "processor_frames",
    "rule_frame",
    "seen_region",
    "smart_resize_grid",
    "upsample",
    "view_frames",
]
