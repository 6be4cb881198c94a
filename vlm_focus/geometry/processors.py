"""Each image processor family's arithmetic, replayed on the image's rectangle: where its views'
grids sit, read from the processor's own settings. Which family a model's processor belongs to
is the model adapter's declaration (``ModelAdapter.processor_rule``, one of
:data:`PROCESSOR_RULES`); this module only does the arithmetic it names."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .shapes import Frame, Size

#: The arithmetic an image processor family places the image by, as a model adapter declares
#: it (``ModelAdapter.processor_rule``): ``"single"`` (one view: pad to a square, resize,
#: centre crop, as CLIP's and ``LlavaImageProcessor`` do), ``"anyres"`` (a base view and a
#: tiled high-resolution view from ``image_grid_pinpoints``), ``"dynamic"`` (the whole image
#: squashed to the ``smart_resize`` size, Qwen-VL's), ``"tiled"`` (the image squashed onto a
#: ``rows x cols`` canvas of square tiles whose shape follows its aspect ratio, each tile one
#: view, then a thumbnail of the whole image; InternVL's ``GotOcr2ImageProcessor``),
#: ``"pan_and_scan"`` (the whole image as ``"single"`` places it, then, with pan-and-scan on,
#: its crops along the long side, each written as an image of its own right after it; Gemma 3's
#: ``Gemma3ImageProcessor``).
PROCESSOR_RULES = ("single", "anyres", "dynamic", "tiled", "pan_and_scan")


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


def tile_grid(
    size: Size, image_processor: Any = None, *, tiles: int | None = None
) -> tuple[int, int]:
    """``(rows, cols)`` of the tiles a tiling processor (``processor_rule="tiled"``) cuts a
    ``size`` image into: of the canvases of ``min_patches`` to ``max_patches`` tiles, the one
    whose ``cols / rows`` is closest to ``width / height``, as the processor's own
    ``get_optimal_tiled_canvas`` picks it from its settings (``size`` is the tile).

    Without ``image_processor``, the canvases of exactly ``tiles`` tiles compete (the count the
    visual tokens show), and a tie between two goes to the wider one: the processor's own choice
    whenever its limits allow that count and the image covers at least half the tiles' area.
    """
    from transformers.models.got_ocr2.image_processing_got_ocr2 import (  # heavy: import on use
        get_optimal_tiled_canvas,
    )

    if image_processor is None:
        if tiles is None or tiles < 1:
            raise ValueError(f"tile_grid needs the image processor or tiles >= 1, got {tiles!r}")
        # a 1-pixel tile makes every image "large", so ties go to the later (wider) canvas
        cols, rows = get_optimal_tiled_canvas((size.height, size.width), (1, 1), tiles, tiles)
        return rows, cols
    low, high = _get(image_processor, "min_patches"), _get(image_processor, "max_patches")
    tile = image_processor.size
    if low is None or high is None or not _get(tile, "height") or not _get(tile, "width"):
        raise ValueError(
            f"{type(image_processor).__name__} has no min_patches, max_patches and size "
            "height/width: it is not a tiling image processor"
        )
    if int(high) <= 1:
        return 1, 1
    cols, rows = get_optimal_tiled_canvas(
        (size.height, size.width),
        (int(_get(tile, "height")), int(_get(tile, "width"))),
        int(low),
        int(high),
    )
    return rows, cols


def tile_frames(size: Size, grid: tuple[int, int], views: int) -> list[Frame]:
    """The frames of a tiled image's ``views`` views: the ``rows x cols`` tiles of ``grid`` in
    row-major order (tile ``(r, c)`` covers ``[c * width / cols, (c + 1) * width / cols)`` by
    ``[r * height / rows, (r + 1) * height / rows)``: the canvas squashes the image), then the
    thumbnail, the whole image. One view is an untiled image: the whole image."""
    width, height = float(size.width), float(size.height)
    whole = Frame(0.0, 0.0, width, height)
    if views == 1:
        return [whole]
    rows, cols = grid
    if rows * cols != views - 1:
        raise ValueError(
            f"a {rows}x{cols} tile grid gives {rows * cols} tiles plus a thumbnail, but the "
            f"image has {views} views"
        )
    tw, th = width / cols, height / rows
    tiles = [Frame(c * tw, r * th, tw, th) for r in range(rows) for c in range(cols)]
    return [*tiles, whole]


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
    if processor_rule == "tiled":
        return tile_frames(size, tile_grid(size, ip), n_views)
    if processor_rule == "pan_and_scan" and n_views > 1:  # the image, then its crops
        return processor_frames(ip, layout, size, processor_rule="single")[:1] + (
            pan_and_scan_crops(size, n_views - 1)
        )
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


def pan_and_scan_frames(size: Size, settings: Any, **overrides: Any) -> list[Frame]:
    """The crops pan-and-scan (Gemma 3's image processor, ``do_pan_and_scan``) adds after an
    image, in prompt order, as frames on the ``size`` image; ``[]`` when it adds none.

    An image whose long side exceeds ``pan_and_scan_min_ratio_to_activate`` times its short
    side is cut along the long side into ``n`` equal crops: ``n`` is the aspect ratio rounded
    half up, at most ``long // pan_and_scan_min_crop_size``, then clamped to
    ``[2, pan_and_scan_max_num_crops]``; a crop's side is ``ceil(long / n)`` (the last one ends
    at the image's edge) and none is made when a crop would be shorter than the minimum on
    either side. Each crop is then resized to the square side like the image itself.
    ``settings`` is the image processor (or its settings); ``overrides`` are the call's own
    values (``processor(..., do_pan_and_scan=True, pan_and_scan_min_crop_size=...)``)."""
    size = Size(*size)

    def setting(key: str) -> Any:
        return overrides[key] if key in overrides else _get(settings, key)

    if not setting("do_pan_and_scan"):
        return []
    ratio = setting("pan_and_scan_min_ratio_to_activate")
    min_crop = setting("pan_and_scan_min_crop_size")
    max_crops = setting("pan_and_scan_max_num_crops")
    if None in (ratio, min_crop, max_crops):
        raise ValueError(
            "pan-and-scan needs pan_and_scan_min_ratio_to_activate, pan_and_scan_min_crop_size "
            "and pan_and_scan_max_num_crops (pass them as keyword overrides)"
        )
    long, short = max(size), min(size)
    if long / short < ratio:
        return []
    n = min(math.floor(long / short + 0.5), math.floor(long / min_crop))
    n = min(max(2, n), max_crops)
    if min(math.ceil(long / n), short) < min_crop:
        return []
    return pan_and_scan_crops(size, n)


def most_crops(size: Size) -> int:
    """The most crops pan-and-scan cuts a ``size`` image into, whatever its settings:
    ``max(2, round(long / short))`` (the aspect ratio rounded half up, at least 2)."""
    return max(2, math.floor(max(size) / min(size) + 0.5))


def pan_and_scan_crops(size: Size, n: int) -> list[Frame]:
    """The frames of the ``n`` crops pan-and-scan cuts a ``size`` image into, in prompt order:
    along the long side (the width when it equals the height), each ``ceil(long / n)`` pixels
    long, the last one ending at the image's edge. The count alone fixes them, so a prompt's
    crop blocks place without the settings of the call that made them. ``ValueError`` for a
    count pan-and-scan never gives (1, more than :func:`most_crops`, or a crop left empty)."""
    size = Size(*size)
    wide = size.width >= size.height
    long, short = (size.width, size.height) if wide else (size.height, size.width)
    side = math.ceil(long / n) if n >= 1 else 0
    if n < 2 or n > most_crops(size) or side * (n - 1) >= long:
        raise ValueError(
            f"{n} pan-and-scan crops cannot come from a {size.width}x{size.height} image: "
            f"pan-and-scan cuts it into 2 to {most_crops(size)} crops along its long side"
        )
    frames = []
    for i in range(n):
        start = side * i
        extent = min(side, long - start)
        if wide:
            frames.append(Frame(float(start), 0.0, float(extent), float(short)))
        else:
            frames.append(Frame(0.0, float(start), float(short), float(extent)))
    return frames
