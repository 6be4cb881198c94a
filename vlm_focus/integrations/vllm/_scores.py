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

PRUNERS = ("pool", "pyramid")


def keep_count(keep: float | int, n_visual: int) -> int:
    """Tokens an image of ``n_visual`` tokens keeps: ``round(keep * n)`` clipped to ``[1, n]``
    for a ratio, or the count itself (clipped to ``n``) for an int."""
    if isinstance(keep, bool) or not isinstance(keep, (int, float)):
        raise ValueError(f"keep={keep!r} must be a ratio in (0, 1] or an int count >= 1")
    if isinstance(keep, float):
        if not 0.0 < keep <= 1.0:
            raise ValueError(f"keep={keep!r}: a ratio must lie in (0, 1]")
        return max(1, min(n_visual, round(keep * n_visual)))
    if keep < 1:
        raise ValueError(f"keep={keep!r}: a count must be >= 1")
    return min(keep, n_visual)


@lru_cache(maxsize=128)
def spread_rank(rows: int, cols: int) -> torch.Tensor:
    """``[rows * cols]``: the step at which each cell (raster order) is taken by greedy
    farthest-point sampling. Cell ``(r, c)`` sits at ``(r + 0.5, c + 0.5)``; the first pick is
    the cell nearest ``(rows / 2, cols / 2)``, each next pick the cell farthest (squared
    Euclidean) from all picks so far; ties go to the lower raster index."""
    ys = torch.arange(rows, dtype=torch.float32).repeat_interleave(cols) + 0.5  # [n]
    xs = torch.arange(cols, dtype=torch.float32).repeat(rows) + 0.5  # [n]
    n = rows * cols
    taken_at = torch.empty(n, dtype=torch.long)
    nearest = torch.full((n,), float("inf"))  # squared distance to the closest pick
    pick = int(((ys - rows / 2) ** 2 + (xs - cols / 2) ** 2).argmin())
    for step in range(n):
        taken_at[pick] = step
        nearest = torch.minimum(nearest, (ys - ys[pick]) ** 2 + (xs - xs[pick]) ** 2)
        nearest[pick] = -1.0
        pick = int(nearest.argmax())
    return taken_at


def pool_keep(rows: int, cols: int, n_keep: int) -> torch.Tensor:
    """The ``n_keep`` cells taken first in :func:`spread_rank` order, sorted."""
    return torch.nonzero(spread_rank(rows, cols) < n_keep).flatten()


def region_of_cells(rows: int, cols: int, tiles: int) -> torch.Tensor:
    """``[rows * cols]`` tile index of each cell: ``(r * tiles // rows) * tiles + c * tiles //
    cols``, renumbered 0.. in increasing order (tiles without cells are dropped)."""
    r = torch.arange(rows).repeat_interleave(cols)
    c = torch.arange(cols).repeat(rows)
    ids = torch.div(r * tiles, rows, rounding_mode="floor") * tiles + torch.div(
        c * tiles, cols, rounding_mode="floor"
    )
    return torch.unique(ids, return_inverse=True)[1]


def share_budget(
    mass: torch.Tensor, sizes: torch.Tensor, total: int, minimum: int = 1
) -> torch.Tensor:
    """Integer budget per region, ``counts.sum() == total`` and ``counts <= sizes``.

    Each region first gets ``min(minimum, size)`` (when those floors exceed ``total``, the
    regions with the most mass get theirs first). The rest is shared in proportion to ``mass``
    with water-filling: a region whose share would pass its free room gets exactly its room and
    the remainder is re-shared among the others. Fractional shares are rounded by largest
    remainder (ties: larger mass, then lower index)."""
    mass = mass.double().clamp(min=0.0)
    sizes = sizes.long()
    if not 0 <= total <= int(sizes.sum()):
        raise ValueError(f"total={total} must lie in [0, {int(sizes.sum())}]")
    floors = torch.minimum(sizes, torch.full_like(sizes, minimum))
    if int(floors.sum()) > total:
        counts = torch.zeros_like(sizes)
        left = total
        for i in sorted(range(sizes.numel()), key=lambda i: (-float(mass[i]), i)):
            give = min(int(floors[i]), left)
            counts[i] = give
            left -= give
        return counts
    room = (sizes - floors).double()
    rest = float(total - int(floors.sum()))
    share = torch.zeros_like(room)
    open_ = room > 0
    weight = mass if float(mass.sum()) > 0 else sizes.double()
    while rest > 1e-9 and bool(open_.any()):
        w = weight * open_
        if float(w.sum()) <= 0:
            w = room * open_
        part = rest * w / w.sum()
        full = open_ & (share + part >= room)
        if bool(full.any()):
            rest -= float((room - share)[full].sum())
            share[full] = room[full]
            open_ &= ~full
        else:
            share += part
            rest = 0.0
    whole = share.floor()
    missing = total - int(floors.sum()) - int(whole.sum())
    frac = share - whole
    order = sorted(range(share.numel()), key=lambda i: (-float(frac[i]), -float(mass[i]), i))
    counts = floors + whole.long()
    for i in order[:missing]:
        counts[i] += 1
    return counts


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

    Region ``r`` (a tile) gets ``n_r`` tokens from :func:`share_budget` with its saliency mass
    ``S_r = sum b``; inside the region the ``n_r`` tokens of largest ``b / S_r`` survive (ties:
    the lower index)."""
    saliency = saliency.detach().float().cpu()
    if saliency.numel() != rows * cols:
        raise ValueError(f"saliency has {saliency.numel()} values for a {rows}x{cols} grid")
    region = region_of_cells(rows, cols, tiles)
    n_regions = int(region.max()) + 1
    sizes = torch.bincount(region, minlength=n_regions)
    mass = torch.zeros(n_regions, dtype=torch.float64).index_add_(0, region, saliency.double())
    budget = share_budget(mass, sizes, n_keep, min_per_region)
    picks = []
    for r in range(n_regions):
        members = torch.nonzero(region == r).flatten()
        values = saliency[members]
        normed = values / values.sum().clamp(min=1e-12)
        order = torch.sort(normed, descending=True, stable=True).indices
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
