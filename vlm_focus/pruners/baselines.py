"""Honest baselines: a seeded random keep and a spatially uniform keep on the 2-D grid."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

from .base import Pruner, Selection, StageContext


@dataclass
class RandomOptions:
    seed: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"seed={self.seed!r} must be an int")


class RandomPruner(Pruner):
    """Uniformly random visual tokens, reproducible from ``seed`` (per call, per row)."""

    name = "random"
    Options = RandomOptions
    summary = "uniform random scores (seeded)"

    def select(self, ctx: StageContext, n_keep: int) -> Selection:
        gen = torch.Generator().manual_seed(self.options.seed + ctx.stage_index)
        scores = torch.rand(ctx.visual.shape, generator=gen).to(ctx.hidden.device)
        return Selection(scores=scores)


@lru_cache(maxsize=64)
def _spread_order(rows: int, cols: int) -> torch.Tensor:
    """Rank of each cell of a ``rows x cols`` grid in greedy farthest-point order, so that the
    first ``n`` cells of the order are spread evenly over the grid for every ``n``."""
    r, c = torch.meshgrid(torch.arange(rows), torch.arange(cols), indexing="ij")
    points = torch.stack([r.flatten(), c.flatten()], -1).float() + 0.5
    centre = torch.tensor([rows / 2, cols / 2])
    dist = torch.full((rows * cols,), float("inf"))
    rank = torch.empty(rows * cols, dtype=torch.long)
    current = int(((points - centre) ** 2).sum(-1).argmin())
    for step in range(rows * cols):
        rank[current] = step
        dist = torch.minimum(dist, ((points - points[current]) ** 2).sum(-1))
        dist[current] = -1.0  # taken cells never win again (their distance is already 0)
        current = int(dist.argmax())
    return rank


class PoolPruner(Pruner):
    """Spatially uniform keep: each image's grid cells are ranked in farthest-point order and
    every image keeps the same share of its tokens; tokens with no cell (newlines) go last."""

    name = "pool"
    summary = "spatially uniform cells on each image's 2-D grid"

    def select(self, ctx: StageContext, n_keep: int) -> Selection:
        scores = torch.zeros(ctx.visual.shape)
        positions = ctx.positions.cpu()
        for b, images in enumerate(ctx.layout):
            for image in images:
                rank = torch.full((image.positions.numel(),), -1.0)
                for view, (rows, cols) in enumerate(image.grids):
                    in_view = (image.cells[:, 0] == view) & (image.cells[:, 1] >= 0)
                    cells = image.cells[in_view]
                    order = _spread_order(rows, cols)[cells[:, 1] * cols + cells[:, 2]]
                    rank[in_view] = 1.0 - (order.float() + 0.5) / max(1, cells.shape[0])
                # Map this image's original positions to the current (maybe pruned) sequence.
                where = torch.searchsorted(positions[b], image.positions)
                present = positions[b][where.clamp(max=positions.shape[1] - 1)] == image.positions
                scores[b, where[present]] = rank[present]
        return Selection(scores=scores.to(ctx.hidden.device))
