"""Max-min diversity baseline (DivPrune / STS-like), optionally filtered by the instruction."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ._common import rank_scores, row_counts
from ._math import maxmin_order
from .base import Pruner, Selection, StageContext


@dataclass
class DiverseOptions:
    pool: float = field(
        default=1.0,
        metadata={
            "help": "max-min picks pool x keep candidates (repulsion), then the instruction's "
            "attention filters them down to keep; 1.0 = pure max-min"
        },
    )

    def __post_init__(self) -> None:
        if isinstance(self.pool, bool) or not isinstance(self.pool, (int, float)) or self.pool < 1:
            raise ValueError(f"pool={self.pool!r} must be a number >= 1")


def diverse_keep(
    features: torch.Tensor, count: int, pool: float = 1.0, relevance: torch.Tensor | None = None
) -> torch.Tensor:
    """Indices of ``count`` tokens: the first ``min(n, round(pool * count))`` of the max-min
    order, of which the ``count`` most ``relevant`` survive (the whole prefix when pool=1)."""
    n = features.shape[0]
    size = min(n, max(count, round(pool * count)))
    order = maxmin_order(features, size)
    if size == count or relevance is None:
        return order[:count]
    best = relevance[order].topk(count).indices
    return order[best]


class DiversePruner(Pruner):
    """Max-min diversity (DivPrune, Alvar et al., 2025; STS-like repulsion then filtering).

    Greedy max-min dispersion over the visual tokens' hidden states at layer K under cosine
    distance: ``s_{j+1} = argmax_s min_{i <= j} (1 - cos(h_s, h_{s_i}))``, keeping the first
    ``keep``. With ``pool > 1`` the dispersion step picks ``pool x keep`` candidates and the
    instruction's text-to-vision attention at layer K keeps the ``keep`` most relevant.
    """

    name = "diverse"
    Options = DiverseOptions
    summary = "max-min (cosine) dispersion of hidden states; optional instruction filter"

    def select(self, ctx: StageContext, n_keep: int) -> Selection:
        relevance = None
        if self.options.pool > 1:
            relevance = ctx.attention_scores(n_keep).scores.float().cpu()
        hidden = ctx.hidden.detach().float().cpu()
        visual = ctx.visual.cpu()
        chosen = []
        for b, count in enumerate(row_counts(ctx, n_keep)):
            local = torch.nonzero(visual[b]).flatten()
            rel = relevance[b, local] if relevance is not None else None
            chosen.append(local[diverse_keep(hidden[b, local], count, self.options.pool, rel)])
        base = relevance if relevance is not None else torch.zeros(visual.shape)
        return Selection(scores=rank_scores(ctx, chosen, base))
