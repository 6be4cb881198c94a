"""FastV: keep the visual tokens that receive the most attention at layer K."""

from __future__ import annotations

from ..core.pruner import Pruner, Selection, StageContext
from ..core.registry import register_pruner


@register_pruner
class FastVPruner(Pruner):
    """FastV (Chen et al., 2024, "An Image is Worth 1/2 Tokens After Layer 2").

    ``score[s] = sum_t w_t * R_h softmax(q_t k^T / sqrt(d))[s]`` with the query rows ``t`` from
    ``query`` (``last`` token, or all ``text`` tokens after the image) and ``R_h`` the head
    mean or max, computed from layer K's own q/k. The top ``keep`` visual tokens survive.
    """

    name = "fastv"
    summary = "attention from the last prompt token (or the instruction) at layer K"
    attention_based = True
    before_llm = reads_layer_attention = reads_whole_prompt = serves_video = True

    def select(self, ctx: StageContext, n_keep: int) -> Selection:
        return ctx.attention_scores(n_keep)
