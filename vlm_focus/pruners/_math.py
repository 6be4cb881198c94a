"""Pure selection math on plain tensors: trend fitting, outliers, grid tiles and budget splits,
grid resampling and max-min diversity. Image geometry (which cells are padding) lives in
:mod:`vlm_focus.geometry`.

The pruner classes glue these to a :class:`~vlm_focus.pruners.StageContext`; tests call them
directly on constructed inputs whose right answer is known.
"""

from __future__ import annotations

import math

import torch

TRENDS = ("exp", "monotone")

_EPS = 1e-12


# --- positional trend ----------------------------------------------------------------------------
def _weighted_line(x: torch.Tensor, y: torch.Tensor, w: torch.Tensor) -> tuple[float, float]:
    """Weighted least squares ``y ~ a + b x``; ``(a, b)``."""
    sw = w.sum().clamp(min=_EPS)
    mx, my = (w * x).sum() / sw, (w * y).sum() / sw
    var = (w * (x - mx) ** 2).sum()
    b = (w * (x - mx) * (y - my)).sum() / var if float(var) > _EPS else torch.zeros(())
    return float(my - b * mx), float(b)


def _isotonic(y: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Weighted non-decreasing least-squares fit (pool adjacent violators)."""
    blocks: list[list[float]] = []  # [value, weight, count]
    for value, weight in zip(y.tolist(), w.tolist(), strict=True):
        blocks.append([value, max(weight, _EPS), 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            v2, w2, n2 = blocks.pop()
            v1, w1, n1 = blocks.pop()
            blocks.append([(v1 * w1 + v2 * w2) / (w1 + w2), w1 + w2, n1 + n2])
    return torch.tensor([v for v, _, n in blocks for _ in range(n)], dtype=y.dtype)


def fit_trend(
    scores: torch.Tensor,
    x: torch.Tensor,
    kind: str = "exp",
    *,
    trim: float = 0.2,
    fit_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Positional trend ``t(x) > 0`` of ``scores [n]`` against positions ``x [n]``.

    ``exp``: ``log s = a + b x`` by least squares, refitted once without the ``trim`` share of
    points lying furthest ABOVE the line (planted objects and sinks are positive outliers, so
    they do not bend the trend). ``monotone``: the median ``log s`` of each distinct ``x`` (one
    image row, or one bin of the 1-D order), fitted by weighted isotonic regression in the
    direction that fits best. ``fit_mask`` excludes points from the fit (they still get a trend).
    """
    if kind not in TRENDS:
        raise ValueError(f"kind={kind!r} is not one of {TRENDS}")
    x = x.detach().double()
    y = scores.detach().double().clamp(min=_EPS).log()
    use = torch.ones_like(y, dtype=torch.bool) if fit_mask is None else fit_mask.clone()
    if int(use.sum()) < 2:
        return torch.ones_like(scores, dtype=torch.float32)
    if kind == "exp":
        w = use.double()
        a, b = _weighted_line(x, y, w)
        n_trim = int(trim * int(use.sum()))
        if n_trim and int(use.sum()) - n_trim >= 2:
            resid = (y - (a + b * x)).masked_fill(~use, -math.inf)
            w = w.clone()
            w[resid.topk(n_trim).indices] = 0.0
            a, b = _weighted_line(x, y, w)
        return (a + b * x).exp().float()
    levels, inverse = torch.unique(x, return_inverse=True)
    medians = torch.zeros(levels.numel(), dtype=torch.float64)
    counts = torch.zeros(levels.numel(), dtype=torch.float64)
    for i in range(levels.numel()):
        member = (inverse == i) & use
        if member.any():
            medians[i] = y[member].median()
            counts[i] = float(member.sum())
    present = counts > 0
    med, cnt = medians[present], counts[present]
    up = _isotonic(med, cnt)
    down = -_isotonic(-med, cnt)
    err_up, err_down = (cnt * (med - up) ** 2).sum(), (cnt * (med - down) ** 2).sum()
    fitted = up if err_up <= err_down else down
    # Levels without fitted points take the nearest fitted level's value.
    idx = torch.nonzero(present).flatten()
    nearest = (torch.arange(levels.numel())[:, None] - idx[None, :]).abs().argmin(1)
    full = fitted[nearest]
    return full[inverse].exp().float()


# --- pad-to-square geometry ----------------------------------------------------------------------
def content_fraction(image_size: tuple[int, int], grid: tuple[int, int]) -> torch.Tensor:
    """``[rows, cols]`` share of each grid cell covered by an ``image_size = (height, width)``
    image after centred pad-to-square (LLaVA-1.5's ``expand2square``). The old call form of
    :func:`vlm_focus.geometry.content_fraction`, which takes any frame."""
    from ..geometry import Size, rule_frame
    from ..geometry import content_fraction as fraction

    height, width = (int(v) for v in image_size)
    if height <= 0 or width <= 0:
        raise ValueError(f"image_size={image_size!r} must be positive (height, width)")
    size = Size(width, height)
    return fraction(rule_frame(size, "pad"), grid, size)


# --- sinks ---------------------------------------------------------------------------------------
def ratio_outliers(values: torch.Tensor, ratio: float) -> torch.Tensor:
    """``values > ratio * median(values)``: tokens with outlying attention mass or massive
    activations (Sun et al., 2024) stand orders of magnitude above the typical token."""
    if values.numel() == 0:
        return torch.zeros(0, dtype=torch.bool)
    median = values.float().median()
    if float(median) <= 0:  # no typical scale to stand out from
        return torch.zeros(values.shape, dtype=torch.bool)
    return values.float() > ratio * median


# --- pyramid regions and budget ------------------------------------------------------------------
def tile_index(
    row: torch.Tensor,
    col: torch.Tensor,
    rows: torch.Tensor | int,
    cols: torch.Tensor | int,
    tiles: int,
) -> torch.Tensor:
    """Tile of each cell ``(row, col)`` of a ``rows x cols`` grid cut into ``tiles x tiles``
    tiles, numbered in raster order: ``(row * tiles // rows) * tiles + col * tiles // cols``
    (integer division; ``rows``/``cols`` may be one size per cell). A grid smaller than
    ``tiles`` on a side leaves some tiles without cells."""
    tile_row = torch.div(row * tiles, rows, rounding_mode="floor")
    tile_col = torch.div(col * tiles, cols, rounding_mode="floor")
    return tile_row * tiles + tile_col


def _largest_remainder(share: torch.Tensor, total: int, order_key: torch.Tensor) -> torch.Tensor:
    base = share.floor()
    left = total - int(base.sum())
    frac = share - base
    # ties: larger remainder, then larger key (saliency), then lower index
    rank = sorted(range(share.numel()), key=lambda i: (-float(frac[i]), -float(order_key[i]), i))
    out = base.long()
    for i in rank[:left]:
        out[i] += 1
    return out


def split_budget(
    saliency: torch.Tensor, sizes: torch.Tensor, total: int, minimum: int = 1
) -> torch.Tensor:
    """Tokens to keep per region: every region first gets ``min(minimum, size)``, the rest of
    ``total`` goes out in proportion to ``saliency`` (water-filling at each region's size, then
    largest remainders), so ``counts.sum() == total`` and ``counts <= sizes`` exactly.
    When the minimums alone exceed ``total``, the most salient regions get theirs first."""
    saliency = saliency.double().clamp(min=0.0)
    sizes = sizes.long()
    if total > int(sizes.sum()) or total < 0:
        raise ValueError(f"total={total} must lie in [0, {int(sizes.sum())}] (sum of sizes)")
    floor = sizes.clamp(max=minimum)
    if int(floor.sum()) > total:
        counts = torch.zeros_like(sizes)
        order = sorted(range(sizes.numel()), key=lambda i: (-float(saliency[i]), i))
        left = total
        for i in order:
            take = min(int(floor[i]), left)
            counts[i], left = take, left - take
        return counts
    caps = (sizes - floor).double()
    left = float(total - int(floor.sum()))
    share = torch.zeros_like(caps)
    active = caps > 0
    weights = torch.where(saliency.sum() > 0, saliency, sizes.double())
    while left > 1e-9 and active.any():
        w = weights * active
        if float(w.sum()) <= 0:
            w = caps * active
        part = left * w / w.sum()
        over = active & (share + part >= caps)
        if over.any():
            left -= float((caps - share)[over].sum())
            share[over] = caps[over]
            active &= ~over
            continue
        share += part
        left = 0.0
    extra = _largest_remainder(share, total - int(floor.sum()), saliency)
    return floor + extra


# --- grid resampling -----------------------------------------------------------------------------
def _box_matrix(n_out: int, n_in: int) -> torch.Tensor:
    """``[n_out, n_in]``: share of each output cell covered by each input cell."""
    out_edges = torch.arange(n_out + 1, dtype=torch.float64) / n_out
    in_edges = torch.arange(n_in + 1, dtype=torch.float64) / n_in
    lo = torch.maximum(out_edges[:-1, None], in_edges[None, :-1])
    hi = torch.minimum(out_edges[1:, None], in_edges[None, 1:])
    return ((hi - lo).clamp(min=0.0) * n_out).float()


def resample_map(grid_map: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """Area (box-filter) resampling of a ``[rows, cols]`` map onto ``shape``, for any ratio:
    each output cell is the area-weighted mean of the input cells it overlaps. Both grids
    span the same image."""
    rows, cols = shape
    ay = _box_matrix(rows, grid_map.shape[0])  # [rows, r_in]
    ax = _box_matrix(cols, grid_map.shape[1])  # [cols, c_in]
    return ay @ grid_map.float() @ ax.T


# --- max-min diversity ---------------------------------------------------------------------------
def maxmin_orders(features: torch.Tensor, candidates: torch.Tensor, count: int) -> torch.Tensor:
    """Greedy max-min diversity (DivPrune) per row: start from the candidate farthest (cosine)
    from the candidates' mean feature, then repeatedly take the candidate whose nearest chosen
    token is farthest. ``features [B, S, D]``, ``candidates [B, S]`` bool; returns ``[B, count]``
    indices in pick order (every prefix is the greedy answer for its size; a row with fewer
    candidates than ``count`` repeats its last pick). Stays on the features' device: one
    ``[B, S]`` distance update per pick, O(S * count * D) per row, no S x S matrix."""
    if count < 1:
        raise ValueError(f"count={count} must be >= 1")
    unit = torch.nn.functional.normalize(features.detach().float(), dim=-1)  # [B, S, D]
    weights = candidates.float()[..., None]
    centre = (unit * weights).sum(1) / weights.sum(1).clamp(min=1)  # [B, D]
    centre = torch.nn.functional.normalize(centre, dim=-1)
    gone = float("-inf")
    start = (1.0 - torch.einsum("bsd,bd->bs", unit, centre)).masked_fill(~candidates, gone)
    pick = start.argmax(1)  # [B]
    picks = [pick]
    nearest = torch.full_like(start, float("inf")).masked_fill(~candidates, gone)
    for _ in range(count - 1):
        chosen = unit.gather(1, pick[:, None, None].expand(-1, 1, unit.shape[-1]))  # [B, 1, D]
        distance = 1.0 - torch.einsum("bsd,bd->bs", unit, chosen[:, 0])
        nearest = torch.minimum(nearest, distance).scatter(1, pick[:, None], gone)
        best = nearest.argmax(1)
        # a row out of candidates (all -inf) repeats its last pick
        pick = torch.where(nearest.gather(1, best[:, None])[:, 0] > gone, best, pick)
        picks.append(pick)
    return torch.stack(picks, 1)
