"""Points and boxes from attention maps: Gaussian smoothing, a threshold, connected components.

OpenCV is imported on first use, so that ``import vlm_focus`` stays fast.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..geometry import Frame, as_frame
from ._heatmap import HeatMap

MapLike = HeatMap | torch.Tensor | np.ndarray


@dataclass(frozen=True)
class Box(Frame):
    """A :class:`~vlm_focus.geometry.Frame` in image pixels (``x0, y0, width, height``, COCO's
    ``[x, y, w, h]`` order; ``xywh``, ``xyxy`` and the corners as on every frame) and the score
    of the blob it bounds."""

    score: float


Region = tuple[slice, slice]


def _pixels(source: MapLike) -> tuple[np.ndarray, float, Region | None]:
    """(``[H, W]`` float64 map, default smoothing sigma in pixels, the ``(rows, cols)`` slices
    of the rectangle the map's grids cover, or ``None`` for all of it)."""
    if isinstance(source, HeatMap):
        (width, height), _ = source.require_pixels()
        rows, cols = source.grid.shape
        cell = min(height / rows, width / cols)
        pixels = source.pixels.numpy().astype(np.float64)
        x0, y0, w, h = (int(v) for v in source.seen.xywh)  # whole pixels
        if w == 0 or h == 0:
            return pixels, 0.5 * cell, None
        return pixels, 0.5 * cell, (slice(y0, y0 + h), slice(x0, x0 + w))
    if isinstance(source, torch.Tensor):
        source = source.detach().cpu().double().numpy()
    if not isinstance(source, np.ndarray):
        raise TypeError(f"expected a HeatMap, tensor or array, got {type(source).__name__}")
    if source.ndim != 2 or min(source.shape) < 1:
        raise ValueError(f"a map must be 2-D [H, W], got shape {list(source.shape)}")
    if not np.isfinite(source).all():
        raise ValueError("the map holds NaN or infinite values")
    return source.astype(np.float64), 1.0, None


def smooth(pixels: np.ndarray, sigma: float, region: Region | None = None) -> np.ndarray:
    """Gaussian smoothing (``cv2.GaussianBlur``, kernel ``2*ceil(3 sigma)+1``, mirrored at the
    border) of ``region`` (default: the whole map; 0 outside it). For a :class:`HeatMap` the
    region is the rectangle its grids cover, so a scene padded to another aspect ratio and
    centre-cropped back smooths exactly as the scene itself. ``sigma = 0``: none."""
    if sigma < 0:
        raise ValueError(f"sigma must be >= 0, got {sigma}")
    if region is not None:
        out = np.zeros_like(pixels)
        out[region] = smooth(pixels[region], sigma)
        return out
    if sigma == 0:
        return pixels
    import cv2

    size = 2 * int(np.ceil(3 * sigma)) + 1
    return cv2.GaussianBlur(pixels, (size, size), sigmaX=sigma, sigmaY=sigma)


def point(source: MapLike, *, sigma: float | None = None) -> tuple[float, float]:
    """The map's peak ``(x, y)`` in image pixels (centre of the maximal pixel after smoothing;
    default sigma: half a grid cell for a :class:`HeatMap`, 1 pixel for an array).

    Pointing game: a hit when this point lies inside a box of the queried object.
    """
    pixels, default, region = _pixels(source)
    smoothed = smooth(pixels, default if sigma is None else sigma, region)
    row, col = np.unravel_index(int(np.argmax(smoothed)), smoothed.shape)
    return float(col) + 0.5, float(row) + 0.5


def boxes(
    source: MapLike,
    *,
    threshold: float | str = "otsu",
    sigma: float | None = None,
    max_boxes: int | None = None,
    min_area: int = 1,
) -> list[Box]:
    """Boxes around the map's high-attention blobs, best first.

    The map is smoothed (:func:`smooth`, Gaussian, ``sigma`` pixels; default half a grid cell
    for a :class:`HeatMap`, over the rectangle its grids cover), scaled to ``[0, 1]`` by its
    maximum and thresholded: a float ``t`` in ``(0, 1)`` keeps pixels ``>= t * max``
    (relative), ``"otsu"`` picks Otsu's threshold on the 8-bit map's covered pixels. Each
    8-connected component (``cv2.connectedComponentsWithStats``) of at least ``min_area``
    pixels gives a :class:`Box` (its bounding rectangle) scored by the map's mass inside the
    component, ``score = sum_{p in component} map[p]`` (unsmoothed map).
    """
    pixels, default, region = _pixels(source)
    if max_boxes is not None and (not isinstance(max_boxes, int) or max_boxes < 1):
        raise ValueError(f"max_boxes must be a positive int or None, got {max_boxes!r}")
    smoothed = smooth(pixels, default if sigma is None else sigma, region)
    peak = float(smoothed.max())
    if peak <= 0:
        return []
    scaled = np.clip(smoothed / peak, 0.0, 1.0)
    import cv2

    if isinstance(threshold, str):
        if threshold != "otsu":
            raise ValueError(f"threshold={threshold!r}: use 'otsu' or a float in (0, 1)")
        image = np.round(scaled * 255).astype(np.uint8)
        seen = image if region is None else image[region]  # Otsu over the covered pixels
        level, _ = cv2.threshold(seen.reshape(-1, 1), 0, 1, cv2.THRESH_BINARY + cv2.THRESH_OTSU)
        binary = (image > level).astype(np.uint8)
    else:
        if not 0 < float(threshold) < 1:
            raise ValueError(f"a relative threshold must lie in (0, 1), got {threshold}")
        binary = (scaled >= float(threshold)).astype(np.uint8)
    count, labels, stats, _ = cv2.connectedComponentsWithStats(binary, connectivity=8)
    mass = np.bincount(labels.ravel(), weights=pixels.ravel(), minlength=count)
    found = []
    for label in range(1, count):
        x, y, w, h, area = (int(v) for v in stats[label])
        if area >= min_area:
            found.append(Box(float(x), float(y), float(w), float(h), float(mass[label])))
    found.sort(key=lambda b: -b.score)
    return found[:max_boxes] if max_boxes is not None else found


def iou(a: Any, b: Any) -> float:
    """Intersection over union of two rectangles (:class:`~vlm_focus.geometry.Frame`, a
    :class:`Box`, or ``[x, y, w, h]``)."""
    a, b = as_frame(a, name="a"), as_frame(b, name="b")
    ix = max(0.0, min(a.x1, b.x1) - max(a.x0, b.x0))
    iy = max(0.0, min(a.y1, b.y1) - max(a.y0, b.y0))
    inter = ix * iy
    union = a.area + b.area - inter
    return inter / union if union > 0 else 0.0
