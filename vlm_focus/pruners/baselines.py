"""Honest baselines: a seeded random keep, a spatially uniform keep on the 2-D grid, and a
temporal keep of whole video frames."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

from ..core.options import option
from ..core.pruner import Pruner, Selection, StageContext
from ..core.registry import register_pruner
from ._common import image_tokens


@dataclass
class RandomOptions:
    seed: int = option(0, "seed of the random scores (each stage adds its index)")

    def __post_init__(self) -> None:
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"seed={self.seed!r} must be an int")


@register_pruner
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
def spread_order(rows: int, cols: int) -> torch.Tensor:
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


@register_pruner
class PoolPruner(Pruner):
    """Spatially uniform keep: each image's grid cells are ranked in farthest-point order and
    every image keeps the same share of its tokens; tokens with no cell (newlines) go last."""

    name = "pool"
    summary = "spatially uniform cells on each image's 2-D grid"
    before_llm = serves_video = True  # the grid alone: each image by itself

    def select(self, ctx: StageContext, n_keep: int) -> Selection:
        scores = torch.zeros(ctx.visual.shape)
        positions = ctx.positions.cpu()
        for b, images in enumerate(ctx.layout):
            for image in images:
                rank = torch.full((image.positions.numel(),), -1.0)
                for view, (rows, cols) in enumerate(image.grids):
                    in_view = (image.cells[:, 0] == view) & (image.cells[:, 1] >= 0)
                    cells = image.cells[in_view]
                    order = spread_order(rows, cols)[cells[:, 1] * cols + cells[:, 2]]
                    rank[in_view] = 1.0 - (order.float() + 0.5) / max(1, cells.shape[0])
                # Map this image's original positions to the current (maybe pruned) sequence.
                where = torch.searchsorted(positions[b], image.positions)
                present = positions[b][where.clamp(max=positions.shape[1] - 1)] == image.positions
                scores[b, where[present]] = rank[present]
        return Selection(scores=scores.to(ctx.hidden.device))


@dataclass
class TemporalOptions:
    mode: str = option(
        "uniform",
        "'uniform': whole frames evenly spaced in time; 'dedup': frames least "
        "like the frame before them (cosine of mean hidden states) first",
    )

    def __post_init__(self) -> None:
        if self.mode not in ("uniform", "dedup"):
            raise ValueError(f"mode={self.mode!r} must be 'uniform' or 'dedup'")


@register_pruner
class TemporalPruner(Pruner):
    """Temporal baseline for videos: keeps whole frames, chosen evenly over time (``uniform``) or
    by novelty against the previous frame (``dedup``, cosine of the frames' mean hidden states,
    as near-duplicate frame dropping does). The last frame kept only in part keeps spatially
    uniform cells. An image counts as one frame, so on images this is ``pool``."""

    name = "temporal"
    Options = TemporalOptions
    summary = "whole video frames: evenly spaced in time, or near-duplicates dropped (cosine)"

    def select(self, ctx: StageContext, n_keep: int) -> Selection:
        scores = torch.full(ctx.visual.shape, -1.0)
        hidden = ctx.hidden.float()
        for row in image_tokens(ctx):
            for tokens in row:
                views = tokens.cells[:, 0].clamp(min=0)
                n_views = len(tokens.layout.grids) if tokens.layout.kind == "video" else 1
                frame = views if n_views > 1 else torch.zeros_like(views)
                frame_rank = self._frame_ranks(hidden[tokens.row], tokens.local, frame, n_views)
                spatial = torch.zeros(tokens.cells.shape[0])
                for view, (rows, cols) in enumerate(tokens.layout.grids):
                    here = (views == view) & (tokens.cells[:, 1] >= 0)
                    cells = tokens.cells[here]
                    order = spread_order(rows, cols)[cells[:, 1] * cols + cells[:, 2]]
                    spatial[here] = 1.0 - (order.float() + 0.5) / max(1, rows * cols)
                # Frame rank dominates; inside a frame, spatially uniform cells first.
                value = (n_views - frame_rank[frame]).float() + spatial
                scores[tokens.row, tokens.local] = value
        return Selection(scores=scores.to(ctx.hidden.device))

    def _frame_ranks(
        self, hidden: torch.Tensor, local: torch.Tensor, frame: torch.Tensor, n_frames: int
    ) -> torch.Tensor:
        """``[n_frames]`` rank of each frame, 0 = kept first (ties go to the earlier frame)."""
        if self.options.mode == "uniform":
            return spread_order(1, n_frames)
        feats = torch.stack(
            [
                hidden[local[frame == f].to(hidden.device)].mean(0)
                if bool((frame == f).any())
                else torch.zeros(hidden.shape[-1], device=hidden.device)
                for f in range(n_frames)
            ]
        ).cpu()  # [T, D] mean hidden state per frame
        novelty = torch.ones(n_frames) * 2.0  # the first frame has no predecessor
        if n_frames > 1:
            novelty[1:] = 1.0 - torch.nn.functional.cosine_similarity(feats[1:], feats[:-1], -1)
        order = torch.sort(novelty, descending=True, stable=True).indices
        ranks = torch.empty(n_frames, dtype=torch.long)
        ranks[order] = torch.arange(n_frames)
        return ranks
