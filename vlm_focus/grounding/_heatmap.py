"""An image's attention map, in grid cells and in the image's pixels (TAG).

:func:`build_map` scatters per-token values of one image onto its views' grid cells. Where each
view's grid sits in the original image is :mod:`vlm_focus.geometry`'s job
(:meth:`~vlm_focus.model_adapters.ModelAdapter.frames`). The pixel map is the attention
*density* (mass per pixel), bilinearly interpolated between cell centres and summed over views,
so it integrates to the mass the grid cells hold.

Views that are pieces of the image (InternVL's tiles, Gemma 3's pan-and-scan crops) combine the
same way: each piece's cells land on its own part of the image, the whole-image view (thumbnail,
global view) on all of it, and a pixel's density is the sum over the views covering it. The sum
keeps a map's total equal to the attention mass on the image, which box scores and region
scores count; every pixel of a tiled or pan-and-scanned image is covered by exactly two views
(its piece and the whole-image view), so a per-pixel mean of the covering views would be the
same map halved, with the same peak and boxes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from ..geometry import (
    Frame,
    Size,
    coverage,
    piece_grid,
    regrid,
    seen_region,
    unknown_size_message,
    upsample,
)
from ..model_adapters import ImageLayout


@dataclass
class HeatMap:
    """One image's attention map.

    Attributes:
        grid: ``[rows, cols]`` mass per cell of the finest view (LLaVA-NeXT: the unpadded
            anyres composite; Qwen: the merged grid, summed over frames of a video). With
            views that are pieces of the image (InternVL's tiles, Gemma 3's pan-and-scan
            crops) and a known size: one grid over the whole image at the pieces' cell pitch
            (``rows * side`` by ``cols * side`` for InternVL's tiles), every view's mass moved
            onto it by area (:func:`vlm_focus.geometry.regrid`).
        views: every view's ``[rows, cols]`` map (LLaVA-NeXT: base grid, then anyres grid; a
            video: one per frame, see :attr:`frame_maps`).
        size: the original image's :class:`~vlm_focus.geometry.Size` ``(width, height)``, or
            ``None`` when it is unknown (then only the grid maps are available).
        frames: per view, the :class:`~vlm_focus.geometry.Frame` its grid spans in original
            pixels (``None`` with the size).
        other: mass on the image's tokens without a cell (newline, CLS tokens).
        row, image: batch row and image index within the row.
        pixels: ``[height, width]`` attention density in original image pixels (computed on
            first use; raises when the size is unknown).
    """

    grid: torch.Tensor
    views: list[torch.Tensor]
    size: Size | None
    frames: list[Frame] | None
    other: float = 0.0
    row: int = 0
    image: int = 0
    layout: ImageLayout | None = field(default=None, repr=False)
    model_type: str | None = field(default=None, repr=False)
    _pixels: torch.Tensor | None = field(default=None, repr=False, compare=False)

    @property
    def mass(self) -> float:
        """Total attention mass on the image's grid cells."""
        return float(sum(v.sum() for v in self.views))

    def require_pixels(self) -> tuple[Size, list[Frame]]:
        """``(size, frames)``; ``ValueError`` saying what to pass when the size is unknown."""
        if self.size is None or self.frames is None:
            raise ValueError(unknown_size_message(self.model_type, self.row, self.image))
        return self.size, self.frames

    @property
    def pixels(self) -> torch.Tensor:
        if self._pixels is None:
            size, frames = self.require_pixels()
            pixels = torch.zeros(size.height, size.width)
            for grid, frame in zip(self.views, frames, strict=True):
                pixels += upsample(grid, size, frame)
            self._pixels = pixels
        return self._pixels

    @property
    def support(self) -> torch.Tensor:
        """``[height, width]`` bool: the pixels some view's grid covers (the encoder saw)."""
        size, frames = self.require_pixels()
        return coverage(size, frames)

    @property
    def seen(self) -> Frame:
        """The part of the image the model saw, in image pixels: the bounding rectangle of
        :attr:`support` (:func:`vlm_focus.geometry.seen_region`). Outside it the map is 0 and
        no box can reach: a CLIP-style centre crop of a wide photo leaves its sides out."""
        size, frames = self.require_pixels()
        return seen_region(size, frames)[0]

    @property
    def seen_share(self) -> float:
        """Share of the image's pixels the model saw (1.0 for the whole image)."""
        size, frames = self.require_pixels()
        return seen_region(size, frames)[1]

    @property
    def frame_maps(self) -> list[HeatMap]:
        """A video's map as one :class:`HeatMap` per frame, in frame order (each frame's view,
        upsampled on its own); an image gives ``[self]``."""
        if self.layout is None or self.layout.kind != "video":
            return [self]
        frames = self.frames or [None] * len(self.views)
        return [
            HeatMap(
                view,
                [view],
                self.size,
                None if frame is None else [frame],
                0.0,
                self.row,
                self.image,
                self.layout,
                self.model_type,
            )
            for view, frame in zip(self.views, frames, strict=True)
        ]


def build_map(
    values: torch.Tensor,
    layout: ImageLayout,
    size: Size | None,
    frames: Sequence[Frame] | None,
    row: int = 0,
    image: int = 0,
    model_type: str | None = None,
) -> HeatMap:
    """Scatter per-token values ``[n]`` of one image onto its views (grid cells); the pixel map
    follows from ``size`` and the views' ``frames`` (:mod:`vlm_focus.geometry`)."""
    values = values.detach().float().cpu()
    cells = layout.cells.cpu()
    views = []
    has_cell = cells[:, 1] >= 0
    for v, (rows, cols) in enumerate(layout.grids):
        grid = torch.zeros(rows, cols)
        sel = has_cell & (cells[:, 0] == v)
        grid.index_put_((cells[sel, 1], cells[sel, 2]), values[sel], accumulate=True)
        views.append(grid)
    if frames is not None and len(frames) != len(views):
        raise ValueError(f"{len(frames)} frames for {len(views)} views")
    frames = None if frames is None or size is None else list(frames)
    size = size if frames else None
    pieces = None if size is None else piece_grid(size, frames, layout.grids)
    shapes = {tuple(g.shape) for g in views}
    if pieces is not None:  # tiles or crops and the whole image: one grid over the image
        whole = Frame(0.0, 0.0, float(size.width), float(size.height))
        finest = sum(regrid(g, f, whole, pieces) for g, f in zip(views, frames, strict=True))
    elif len(shapes) == 1:
        finest = torch.stack(views).sum(0)  # frames of a video share one grid
    else:
        finest = max(views, key=lambda g: g.numel())
    other = float(values[~has_cell].sum())
    return HeatMap(finest, views, size, frames, other, row, image, layout, model_type)
