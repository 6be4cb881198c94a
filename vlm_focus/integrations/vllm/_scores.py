"""Pre-LLM keep sets on one image's merged grid, in plain torch (no vLLM, no transformers).

These are the selections ``vf.wrap(model, layer=0, budget="frame")`` makes for one image when
the score comes from before the language model:

- ``pool``: spatially uniform cells, ranked in greedy farthest-point order from the cell
  nearest the grid's centre (the ``pool`` pruner);
- ``pyramid``: PTP with only its bottom-up half (``alpha=0``): the image's budget is split over
  ``tiles x tiles`` regions in proportion to their saliency mass, and each region keeps its most
  salient tokens (the ``pyramid`` pruner's region and token levels). Saliency is the L2 norm of
  each visual embedding as the LLM receives it, the ``pyramid`` proxy for encoders without a
  [CLS] token (Qwen2.5-VL).

Every function returns the kept indices in raster order of the merged grid (sorted), which is
also the order the image's tokens take in the prompt.
"""

from __future__ import annotations

from functools import lru_cache

import torch

from ...pruners import split_budget, spread_order, tile_index

PRUNERS = ("pool", "pyramid")  # the pre-LLM scores: select() takes one of these


#: ``[rows * cols]`` step at which each cell is taken by the ``pool`` pruner's farthest-point
#: order (cached: vLLM asks for the same grids again and again).
spread_rank = lru_cache(maxsize=128)(spread_order)


def pool_keep(rows: int, cols: int, n_keep: int) -> torch.Tensor:
    """The ``n_keep`` cells taken first in :func:`spread_rank` order, sorted."""
    return torch.nonzero(spread_rank(rows, cols) < n_keep).flatten()


def region_of_cells(rows: int, cols: int, tiles: int) -> torch.Tensor:
    """``[rows * cols]`` region of each cell (raster order): its tile
    (:func:`~vlm_focus.pruners.tile_index`), renumbered 0.. in increasing order (tiles without
    cells are dropped), as the ``pyramid`` pruner numbers the regions of one view."""
    r = torch.arange(rows).repeat_interleave(cols)
    c = torch.arange(cols).repeat(rows)
    return torch.unique(tile_index(r, c, rows, cols, tiles), return_inverse=True)[1]


def pyramid_keep(
    saliency: torch.Tensor,
    rows: int,
    cols: int,
    n_keep: int,
    *,
    tiles: int = 2,
    min_per_region: int = 1,
) -> torch.Tensor:
    """PTP's bottom-up selection on one grid: ``saliency [rows * cols]`` (raster order).

    Region ``r`` (a tile) gets ``n_r`` tokens from :func:`~vlm_focus.pruners.split_budget`
    with its saliency mass ``S_r = sum b``; inside the region the ``n_r`` tokens of largest
    ``b / S_r`` survive (ties: the lower index)."""
    saliency = saliency.detach().float().cpu()
    if saliency.numel() != rows * cols:
        raise ValueError(f"saliency has {saliency.numel()} values for a {rows}x{cols} grid")
    region = region_of_cells(rows, cols, tiles)
    n_regions = int(region.max()) + 1
    sizes = torch.bincount(region, minlength=n_regions)
    mass = torch.zeros(n_regions, dtype=torch.float64).index_add_(0, region, saliency.double())
    budget = split_budget(mass, sizes, n_keep, min_per_region)
    picks = []
    for r in range(n_regions):
        members = torch.nonzero(region == r).flatten()
        # b / S_r orders a region's tokens as b does (S_r > 0 is one constant per region)
        order = torch.sort(saliency[members], descending=True, stable=True).indices
        picks.append(members[order[: int(budget[r])]])
    return torch.sort(torch.cat(picks)).values


def select(
    pruner: str,
    embeddings: torch.Tensor,
    rows: int,
    cols: int,
    n_keep: int,
    *,
    tiles: int = 2,
    min_per_region: int = 1,
) -> torch.Tensor:
    """Kept indices (sorted) of one image's ``embeddings [rows * cols, D]`` under ``pruner``."""
    n = rows * cols
    if embeddings.shape[0] != n:
        raise ValueError(f"{embeddings.shape[0]} embeddings for a {rows}x{cols} grid")
    if n_keep >= n:
        return torch.arange(n)
    if pruner == "pool":
        return pool_keep(rows, cols, n_keep)
    if pruner == "pyramid":
        saliency = embeddings.detach().float().norm(dim=-1)  # [n] the norm proxy
        return pyramid_keep(
            saliency, rows, cols, n_keep, tiles=tiles, min_per_region=min_per_region
        )
    raise ValueError(f"pruner={pruner!r} is not one of {PRUNERS}")


def frame_counts(sizes: list[int], total: int) -> list[int]:
    """Tokens each image of one prompt keeps when the prompt keeps ``total`` of its
    ``sum(sizes)``: ``vf.wrap(..., budget="frame")``'s rule. Every token of an image of ``n``
    tokens is worth its share ``-(rank + 0.5) / n`` (rank 0: the image's best) and the prompt
    keeps its ``total`` largest shares, ties to the earlier image; so the counts depend on the
    sizes alone, never on the scores. One image keeps ``total``."""
    shares = torch.cat(
        [-(torch.arange(n, dtype=torch.float32) + 0.5) / float(n) for n in sizes]
    )  # float32, as the engine computes them
    owner = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes))
    order = torch.sort(shares, descending=True, stable=True).indices[:total]
    return torch.bincount(owner[order], minlength=len(sizes)).tolist()
