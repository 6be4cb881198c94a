"""Glue between a :class:`StageContext` and the plain-tensor math in ``_math``."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..core.pruner import StageContext
from ..kernels import per_query_attention
from ..model_adapters import ImageLayout


@dataclass
class ImageTokens:
    """The tokens of one image that are still present at this stage.

    ``local``: their indices in the current sequence; ``cells``: their ``(view, row, col)``;
    ``member``: their indices within ``layout.positions``.
    """

    row: int
    image: int  # index of the image in the whole batch (row-major)
    layout: ImageLayout
    local: torch.Tensor
    cells: torch.Tensor
    member: torch.Tensor


def image_tokens(ctx: StageContext) -> list[list[ImageTokens]]:
    """Per row, per image: which of its tokens the current sequence still holds, and where."""
    out = []
    positions = ctx.positions.cpu()
    n_seq = positions.shape[1]
    count = 0
    for b, images in enumerate(ctx.layout):
        row = []
        for layout in images:
            where = torch.searchsorted(positions[b], layout.positions)
            clamped = where.clamp(max=n_seq - 1)
            present = positions[b][clamped] == layout.positions
            member = torch.nonzero(present).flatten()
            row.append(
                ImageTokens(b, count, layout, clamped[present], layout.cells[present], member)
            )
            count += 1
        out.append(row)
    return out


def row_counts(ctx: StageContext, n_keep: int) -> list[int]:
    """Visual tokens row b keeps at this stage: the engine drops the same number from every
    row, so rows with more visual tokens keep more than ``n_keep``."""
    n_visual = ctx.visual_counts
    if n_visual is None:
        n_visual = ctx.visual.sum(1).tolist()
    drop = min(n_visual) - n_keep
    return [n - drop for n in n_visual]


def rank_scores(ctx: StageContext, chosen: list[torch.Tensor], base: torch.Tensor) -> torch.Tensor:
    """Scores that make the engine keep exactly ``chosen[b]`` (local indices) in row b; see
    :func:`mask_scores`."""
    mask = torch.zeros(ctx.visual.shape, dtype=torch.bool)
    for b, index in enumerate(chosen):
        mask[b, index.cpu()] = True
    return mask_scores(ctx, mask.to(ctx.hidden.device), base.to(ctx.hidden.device))


def mask_scores(ctx: StageContext, chosen: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
    """Scores that make the engine keep exactly the ``chosen [B, S]`` tokens: chosen tokens
    score ``2 + base`` and the others ``base``, with ``base`` scaled into ``[0, 1)``."""
    base = base.float()
    span = base.masked_fill(~ctx.visual, 0.0).abs().amax(1, keepdim=True).clamp(min=1e-12)
    return (base / span).clamp(-1.0, 0.999) + 2.0 * chosen.float()


def per_query_scores(
    ctx: StageContext,
    q: torch.Tensor,
    k: torch.Tensor,
    rows: torch.Tensor,
    candidates: torch.Tensor,
    reduce: str | None = None,
) -> torch.Tensor:
    """``[B, Tq, S]``: the attention each query row pays each candidate key (0 elsewhere).
    Peak memory is the ``[B, H, Tq, S]`` probability slab; the keys are never copied per row."""
    per_query = per_query_attention(
        q,
        k,
        scaling=ctx.attention.scaling,
        key_mask=ctx.valid,
        query_pos=rows,
        reduce=reduce or ctx.config.reduce,
        allowed=ctx.allowed(rows),
    )
    return per_query.masked_fill(~candidates[:, None, :], 0.0)


def fill_cellless(values: torch.Tensor, cells: torch.Tensor) -> torch.Tensor:
    """Tokens without a grid cell (row newlines, CLS) take the value of the token before them
    (the first one takes the mean of those with a cell)."""
    values = values.clone()
    has = cells[:, 1] >= 0
    if bool(has.all()) or not bool(has.any()):
        return values
    fallback = values[has].mean()
    for i in torch.nonzero(~has).flatten().tolist():
        values[i] = values[i - 1] if i > 0 else fallback
    return values
