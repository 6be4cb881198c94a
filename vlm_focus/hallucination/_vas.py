"""VAS: the visual attention score, the share of attention that text rows pay to the image."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..core.probe import AttentionProbe, QuerySpec, attention_layers


@dataclass
class VisualAttention:
    """``per_layer [B, L]`` share of attention on visual tokens at each probed layer (mean over
    heads and query rows), ``overall [B]`` its mean over layers, ``per_head [B, L, H]``."""

    per_layer: torch.Tensor
    overall: torch.Tensor
    per_head: torch.Tensor
    layers: list[int]


def visual_share(probs: torch.Tensor, visual: torch.Tensor, row_mask: torch.Tensor) -> torch.Tensor:
    """``[B, H]``: mean over valid query rows of ``sum_{s visual} probs[b, h, t, s]``."""
    keys = probs.shape[-1]
    vis = torch.zeros(visual.shape[0], keys, dtype=probs.dtype, device=probs.device)
    vis[:, : visual.shape[1]] = visual.to(probs.dtype)
    per_row = torch.einsum("bhts,bs->bht", probs, vis)  # [B, H, Tq]
    w = row_mask.to(probs.dtype)
    return (per_row * w[:, None]).sum(-1) / w.sum(-1, keepdim=True).clamp(min=1)


def vas(
    model: nn.Module,
    inputs: Mapping[str, Any],
    *,
    query_rows: QuerySpec = "last",
    layers: Sequence[int] | None = None,
) -> VisualAttention:
    """Visual attention score (VAS) of a prompt.

    For query rows ``T`` (``query_rows``: default the last prompt token; ``"text"`` for the
    instruction, as in :class:`~vlm_focus.FocusConfig`) and the visual tokens ``V`` of the
    row::

        VAS_l = 1/(H |T|) sum_h sum_{t in T} sum_{v in V} A^{l,h}[t, v]      VAS = mean_l VAS_l

    A low VAS marks answers produced with little look at the image, a known correlate of object
    hallucination. One forward pass, attention recomputed from q/k (SDPA-safe).
    """
    if not isinstance(inputs, Mapping) or "input_ids" not in inputs:
        raise TypeError("inputs must be the processor's output mapping with input_ids")
    layers = attention_layers(model, layers)  # default: every layer with attention rows
    with torch.no_grad(), AttentionProbe(model, layers, rows=query_rows) as probe:
        model(**{k: v for k, v in inputs.items() if k != "labels"}, use_cache=False)
        visual = probe.prefill.visual
    if not bool(visual.any(1).all()):
        raise ValueError("every row needs an image for VAS")
    per_head = torch.stack(
        [visual_share(r.probs, visual, r.mask) for r in probe.records], dim=1
    )  # [B, L, H]
    per_layer = per_head.mean(-1)
    return VisualAttention(per_layer, per_layer.mean(-1), per_head, layers)
