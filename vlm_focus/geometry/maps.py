"""Grid maps on the image: a cell map rasterised to pixels, what the encoder saw, and each
cell's share of the image or of a box."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from .shapes import Frame, Size, as_frame
from .sizes import as_size


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


def _overlaps(start: float, length: float, n: int, to: tuple[float, float, int]) -> torch.Tensor:
    """``[n, m]`` float64: the share of each of ``n`` equal cells over ``[start, start +
    length)`` that lies in each of ``m`` equal cells over ``to = (start, length, m)``."""
    src = start + torch.arange(n + 1, dtype=torch.float64) * length / n
    dst = to[0] + torch.arange(to[2] + 1, dtype=torch.float64) * to[1] / to[2]
    lo = torch.maximum(src[:-1, None], dst[None, :-1])
    hi = torch.minimum(src[1:, None], dst[None, 1:])
    return (hi - lo).clamp(min=0) / (length / n)


def regrid(
    grid_map: torch.Tensor, frame: Frame, target: Frame, grid: tuple[int, int]
) -> torch.Tensor:
    """A ``[rows, cols]`` mass map spanning ``frame``, moved onto a ``grid`` of cells spanning
    ``target``: each cell's mass is split by the share of its area inside each target cell
    (``out = W_y^T map W_x``), so the mass inside ``target`` is kept and none is invented."""
    rows, cols = grid_map.shape
    wy = _overlaps(frame.y0, frame.height, rows, (target.y0, target.height, grid[0]))
    wx = _overlaps(frame.x0, frame.width, cols, (target.x0, target.width, grid[1]))
    return (wy.T @ grid_map.double() @ wx).float()


def piece_grid(
    size: Size, frames: Sequence[Frame], grids: Sequence[tuple[int, int]]
) -> tuple[int, int] | None:
    """``(rows, cols)`` of one grid over the whole ``size`` image at the cell pitch of its
    pieces, when two or more views are pieces of it that do not overlap (InternVL's tiles,
    Gemma 3's pan-and-scan crops): the pitch of the largest piece (the first of equals, so a
    last crop cut short does not set it). ``None`` for any other layout (one view, a base and
    an anyres view, the frames of a video)."""
    width, height = as_size(size)
    whole = width * height
    pieces = [(f, g) for f, g in zip(frames, grids, strict=True) if f.area < whole * (1 - 1e-6)]
    if len(pieces) < 2:
        return None
    for i, (a, _) in enumerate(pieces):
        for b, _ in pieces[i + 1 :]:
            dx = min(a.x1, b.x1) - max(a.x0, b.x0)
            dy = min(a.y1, b.y1) - max(a.y0, b.y0)
            if dx > 1e-6 * width and dy > 1e-6 * height:
                return None
    frame, (rows, cols) = max(pieces, key=lambda p: p[0].area)
    return max(1, round(height * rows / frame.height)), max(1, round(width * cols / frame.width))


def frame_aspect(frame: Frame) -> float:
    """``width / height`` of a view's frame: the shape a crop needs to fill that view exactly
    (1 for a CLIP-style centre crop or a pad to a square; the image's own for a plain resize or
    dynamic resolution)."""
    return float(frame.width) / float(frame.height)
