"""Instruction-aware scoring: the instruction tokens that look at the image rate its tokens."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..core.options import option
from ..core.pruner import Pruner, Selection, StageContext
from ..core.registry import register_pruner
from ..kernels import score_and_select
from ._common import per_query_scores


@dataclass
class TextOptions:
    prior: bool = option(
        False, "weight each rater by the attention the last token pays it (AdaptInfer)"
    )

    def __post_init__(self) -> None:
        if not isinstance(self.prior, bool):
            raise ValueError(f"prior={self.prior!r} must be True or False")


def select_raters(mass: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """SparseVLM's raters: ``[B, Tq]`` bool, the valid instruction rows whose attention mass on
    the image is above the mean over the row's valid instruction rows (all valid rows when
    none is above, e.g. a one-token instruction)."""
    count = valid.sum(1, keepdim=True).clamp(min=1)
    mean = (mass * valid).sum(1, keepdim=True) / count
    raters = valid & (mass > mean)
    return torch.where(raters.any(1, keepdim=True), raters, valid)


def rater_weights(raters: torch.Tensor, prior: torch.Tensor | None = None) -> torch.Tensor:
    """``[B, Tq]`` weights summing to 1 over each row's raters: uniform, or proportional to a
    text-to-text attention ``prior`` (rows whose prior is all zero fall back to uniform)."""
    weights = raters.float()
    if prior is not None:
        weighted = weights * prior.float()
        has = weighted.sum(1, keepdim=True) > 0
        weights = torch.where(has, weighted, weights)
    return weights / weights.sum(1, keepdim=True).clamp(min=1e-12)


@register_pruner
class TextPruner(Pruner):
    """Instruction-aware text raters (SparseVLM, Zhang et al., 2024; optional AdaptInfer prior).

    With ``a[t, s]`` the head-reduced attention of instruction token ``t`` (every valid token
    after the image) to visual token ``s`` at layer K, a token is a *rater* when its image mass
    ``m_t = sum_s a[t, s]`` exceeds the mean of ``m`` over the instruction; then
    ``score[s] = sum_{t in raters} w_t a[t, s]`` with ``w`` uniform over the raters or, with
    ``prior=True``, ``w_t`` proportional to the attention the last prompt token pays ``t``
    (AdaptInfer's text-to-text prior). The per-row attention is one ``[B, H, Tq, S]`` slab
    (``kernels.per_query_attention``, the twin's math), the prior comes from score-and-select.
    """

    name = "text"
    Options = TextOptions
    summary = "attention from the instruction tokens that look at the image (raters), layer K"
    attention_based = True
    before_llm = reads_layer_attention = reads_whole_prompt = serves_video = True
    needs_instruction = True

    def select(self, ctx: StageContext, n_keep: int) -> Selection:
        rows, filler = ctx.query_rows("text", strict=True)  # [B, Tq]; weight 0: filler rows
        valid_rows = filler > 0
        q, k = ctx.query_key(rows)
        per_row = per_query_scores(ctx, q, k, rows, ctx.visual)  # [B, Tq, S]
        raters = select_raters(per_row.sum(-1), valid_rows)
        prior = None
        if self.options.prior:
            instruction = torch.zeros_like(ctx.visual)
            instruction.scatter_(1, rows, valid_rows)
            last = rows[:, -1:]
            to_text, _ = score_and_select(
                q[:, :, -1:],
                k,
                instruction,
                1,
                scaling=ctx.attention.scaling,
                key_mask=ctx.valid,
                query_pos=last,
                query_weights=torch.ones_like(last, dtype=torch.float32),
                reduce=ctx.config.reduce,
                allowed=ctx.allowed(last),
            )  # [B, S]: last token's attention to each instruction token
            prior = to_text.gather(1, rows)
        weights = rater_weights(raters, prior)
        scores = torch.einsum("bt,bts->bs", weights, per_row)
        return Selection(scores=scores)
