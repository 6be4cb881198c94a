"""Pure-torch twin of the fused score-and-select kernel.

This is the CPU path and the reference the Triton kernel is tested against. It materialises one
``[B, H, Tq, S]`` slab of attention probabilities (never ``S x S``): ``Tq`` is the handful of
query rows that score the image, so the slab stays small.
"""

from __future__ import annotations

import torch

from ..core.attention import allowed_keys, attention_probs


def score_and_select_naive(
    q: torch.Tensor,
    k: torch.Tensor,
    visual: torch.Tensor,
    n_keep: int,
    *,
    scaling: float,
    key_mask: torch.Tensor,
    query_pos: torch.Tensor,
    query_weights: torch.Tensor,
    reduce: str,
    debias: torch.Tensor | None,
    allowed: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Score visual keys by the attention the query rows pay them, then keep the top ``n_keep``.

    ``scores[b, s] = debias[b, s] * sum_t w[b, t] * R_h(softmax_s'(q[b,h,t].k[b,h,s'] * c))[s]``
    with ``c = scaling``, the softmax over keys that are valid and at or before ``query_pos[b, t]``,
    ``R_h`` the mean or max over heads (GQA heads share their kv head) and 0 for non-visual keys.
    Ties at the cut are kept from the lowest positions.
    Arguments are already checked and defaulted by :func:`vlm_focus.kernels.score_and_select`.
    """
    per_query = per_query_attention(
        q,
        k,
        scaling=scaling,
        key_mask=key_mask,
        query_pos=query_pos,
        reduce=reduce,
        allowed=allowed,
    )  # [B, Tq, S]
    scores = torch.einsum("bt,bts->bs", query_weights.float(), per_query)
    if debias is not None:
        scores = scores * debias.float()
    scores = scores.masked_fill(~visual, 0.0)
    ranked = scores.masked_fill(~visual, float("-inf"))
    # A stable descending sort breaks ties towards the lower position, as the Triton kernel does;
    # topk's tie order is unspecified and differs between devices.
    order = ranked.sort(dim=-1, descending=True, stable=True).indices  # [B, S]
    kept = order[:, :n_keep].sort(dim=-1).values
    return scores, kept


def per_query_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    scaling: float,
    key_mask: torch.Tensor,
    query_pos: torch.Tensor,
    reduce: str,
    allowed: torch.Tensor | None = None,
) -> torch.Tensor:
    """``[B, Tq, S]``: ``R_h(softmax_s(q[b,h,t].k[b,h,s] * scaling))`` for every query row, over
    the keys that are valid and at or before ``query_pos[b, t]`` (a row with none gives 0), or,
    with ``allowed [B, Tq, S]`` (a layer's own mask rule), the valid keys it allows.

    The softmax is :func:`vlm_focus.core.attention.attention_probs`, the one the probes use; the
    largest intermediate is its ``[B, H, Tq, S]`` probability slab.
    """
    if allowed is None:
        allowed = allowed_keys(key_mask, query_pos)
    else:
        allowed = allowed & key_mask[:, None, :]
    probs = attention_probs(q, k, scaling, allowed)  # [B, H, Tq, S]
    return probs.mean(dim=1) if reduce == "mean" else probs.amax(dim=1)
