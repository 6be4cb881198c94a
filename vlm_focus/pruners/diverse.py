"""Max-min diversity baseline (DivPrune / STS-like), optionally filtered by the instruction."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..core.options import option
from ..core.pruner import Pruner, Selection, StageContext
from ..core.registry import register_pruner
from ._common import mask_scores, row_counts
from ._math import maxmin_orders


@dataclass
class DiverseOptions:
    pool: float = option(
        1.0,
        "max-min picks pool x keep candidates (repulsion), then the instruction's "
        "attention filters them down to keep; 1.0 = pure max-min",
    )

    def __post_init__(self) -> None:
        if isinstance(self.pool, bool) or not isinstance(self.pool, (int, float)) or self.pool < 1:
            raise ValueError(f"pool={self.pool!r} must be a number >= 1")


def diverse_keep(
    features: torch.Tensor, count: int, pool: float = 1.0, relevance: torch.Tensor | None = None
) -> torch.Tensor:
    """Indices of ``count`` of ``n`` tokens (``features [n, D]``): the first
    ``min(n, round(pool * count))`` of the max-min order, of which the ``count`` most
    ``relevant`` survive (the whole prefix when pool=1)."""
    n = features.shape[0]
    everything = torch.ones(1, n, dtype=torch.bool, device=features.device)
    rel = None if relevance is None else relevance[None]
    chosen = diverse_mask(features[None], everything, [count], [n], pool, rel)[0]
    return torch.nonzero(chosen).flatten()


def diverse_mask(
    features: torch.Tensor,
    candidates: torch.Tensor,
    counts: list[int],
    n_candidates: list[int],
    pool: float,
    relevance: torch.Tensor | None,
) -> torch.Tensor:
    """``[B, S]`` bool: per row, ``counts[b]`` candidates chosen as in :func:`diverse_keep`,
    on the features' device (``counts`` and ``n_candidates`` are host ints)."""
    sizes = [min(n, max(c, round(pool * c))) for c, n in zip(counts, n_candidates, strict=True)]
    order = maxmin_orders(features, candidates, max(sizes))  # [B, size]
    device = features.device
    rank = torch.arange(order.shape[1], device=device)[None]  # pick rank
    wanted = torch.tensor(counts, device=device)[:, None]
    if relevance is None or sizes == counts:
        picked = rank < wanted
    else:  # the counts[b] most relevant of each row's first sizes[b] picks
        rel = relevance.float().gather(1, order)
        rel = rel.masked_fill(rank >= torch.tensor(sizes, device=device)[:, None], float("-inf"))
        by_relevance = torch.sort(rel, dim=1, descending=True, stable=True).indices
        picked = torch.zeros_like(rank < wanted).scatter(1, by_relevance, rank < wanted)
    chosen = torch.zeros(candidates.shape, dtype=torch.long, device=device)
    return chosen.scatter_add(1, order, picked.long()) > 0  # repeated picks count once


@register_pruner
class DiversePruner(Pruner):
    """Max-min diversity (DivPrune, Alvar et al., 2025; STS-like repulsion then filtering).

    Greedy max-min dispersion over the visual tokens' hidden states at layer K under cosine
    distance: ``s_{j+1} = argmax_s min_{i <= j} (1 - cos(h_s, h_{s_i}))``, keeping the first
    ``keep``. With ``pool > 1`` the dispersion step picks ``pool x keep`` candidates and the
    instruction's text-to-vision attention at layer K keeps the ``keep`` most relevant.
    Runs on the hidden states' device in ``O(S * keep * D)`` per row.
    """

    name = "diverse"
    Options = DiverseOptions
    summary = "max-min (cosine) dispersion of hidden states; optional instruction filter"
    # Before the LLM: max-min over the LLM-input embeddings (the instruction filter reads
    # attention inside the LLM). One max-min order spans all the row's images.
    before_llm = reads_whole_prompt = serves_video = True
    before_llm_options = {"pool": 1.0}

    def select(self, ctx: StageContext, n_keep: int) -> Selection:
        relevance = None
        if self.options.pool > 1:
            relevance = ctx.attention_scores(n_keep).scores.float()
        counts = row_counts(ctx, n_keep)
        n_visual = ctx.visual_counts or ctx.visual.sum(1).tolist()
        chosen = diverse_mask(
            ctx.hidden, ctx.visual, counts, n_visual, self.options.pool, relevance
        )
        base = relevance if relevance is not None else torch.zeros(ctx.visual.shape)
        return Selection(scores=mask_scores(ctx, chosen, base.to(ctx.hidden.device)))
