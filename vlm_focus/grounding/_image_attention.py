"""The attention a pass's query rows pay to each image's tokens.

:func:`probe_forward` runs one forward pass through the unmodified model while an
:class:`~vlm_focus.core.probe.AttentionProbe` recomputes the chosen rows at the chosen layers
from each layer's own q/k (SDPA, eager and flash all fine). A generated answer is read the same
way, teacher-forced after its prompt: the rows are exactly those the decode steps computed (same
tokens, same causal prefix), and one batched pass serves every phrase of the answer. The rest
reads those rows per image: per (layer, head) for localization-head selection
(:func:`token_attention`), or averaged over chosen (layer, head) pairs (:func:`image_rows`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..core.probe import AttentionProbe, Prefill, Rows, attention_layers
from ..model_adapters import ImageLayout, get_adapter

HeadSpec = Any  # LocalizationHeads | Mapping[int, Sequence[int]] | None


@dataclass
class Probed:
    """Attention rows of one forward pass and what is needed to read them."""

    records: list[Rows]
    prefill: Prefill
    layout: list[list[ImageLayout]]
    layers: list[int]
    n_heads: int
    logits: torch.Tensor | None = None  # [B, V] next-token logits after the last input token


def probe_forward(
    model: nn.Module,
    inputs: Mapping[str, Any],
    rows: torch.Tensor,
    layers: Sequence[int] | None,
    prompt_end: int | None = None,
) -> Probed:
    """One forward pass recording the attention rows ``rows [B, S]`` at ``layers``.

    ``prompt_end``: the inputs are a prompt of that many tokens plus a teacher-forced answer;
    on a pruned model the pruner then scores with the prompt's rows, as generation did.
    """
    adapter = get_adapter(model)
    layers = attention_layers(model, layers)  # default: every layer with attention rows
    inputs = dict(inputs)
    inputs.pop("labels", None)
    with torch.no_grad(), AttentionProbe(model, layers, rows=rows) as probe:
        scoring = probe.tracker.scoring_prompt(prompt_end) if prompt_end else nullcontext()
        with scoring:
            out = model(**inputs, use_cache=False)
        prefill = probe.prefill
    logits = getattr(out, "logits", None)
    logits = None if logits is None else logits[:, -1]  # on the device: read only if needed
    layout = prefill.layout(model, adapter)
    attn = getattr(adapter.decoder_layers(model)[layers[0]], adapter.attention)
    n_heads = probe.records[0].probs.shape[1] if probe.records else attn.config.num_attention_heads
    return Probed(probe.records, prefill, layout, layers, n_heads, logits)


def head_pairs(heads: HeadSpec) -> list[tuple[int, int]]:
    """``(layer, head)`` pairs of localization heads or a ``{layer: [heads]}`` mapping."""
    pairs = getattr(heads, "heads", heads)
    if isinstance(pairs, Mapping):
        return [(int(layer), int(h)) for layer, hs in pairs.items() for h in hs]
    return [(int(layer), int(h)) for layer, h in pairs]


def head_weights(heads: HeadSpec, layers: list[int], n_heads: int) -> torch.Tensor:
    """``[len(layers), n_heads]`` weights that average over the selected (layer, head) pairs."""
    weights = torch.zeros(len(layers), n_heads)
    if heads is None:
        weights[:] = 1.0
    else:
        for layer, head in head_pairs(heads):
            if layer not in layers:
                raise ValueError(f"head ({layer}, {head}): layer {layer} was not probed ({layers})")
            if not 0 <= head < n_heads:
                raise ValueError(f"head ({layer}, {head}) is outside [0, {n_heads})")
            weights[layers.index(layer), head] = 1.0
        if weights.sum() == 0:
            raise ValueError("no heads selected")
    return weights / weights.sum()


def query_row_weights(probed: Probed, query: torch.Tensor) -> torch.Tensor:
    """Per recorded query row, ``1 / n`` on the row's query tokens (mean over the query)."""
    rec = probed.records[0]
    picked = query.gather(1, rec.positions) & rec.mask
    return picked.float() / picked.sum(1, keepdim=True).clamp(min=1)


def token_attention(
    probed: Probed, row_weights: torch.Tensor, *, per_head: bool = False
) -> list[list[torch.Tensor]]:
    """Per row and image, the attention each of the image's tokens receives.

    ``row_weights [B, Tq]`` weights the recorded query rows (e.g. ``1/n`` on a phrase's tokens).
    Returns ``[L, H, n]`` per image (layers in ``probed.layers`` order) when ``per_head``, else
    the mean over layers and heads kept as ``[1, 1, n]``.
    """
    by_layer = {r.layer: r for r in probed.records}
    out: list[list[torch.Tensor]] = []
    for b, images in enumerate(probed.layout):
        row_images = []
        for image in images:
            positions = image.positions.to(row_weights.device)
            stack = []
            for layer in probed.layers:
                rec = by_layer[layer]
                w = (row_weights[b] * rec.mask[b].float())[None, :, None]  # [1, Tq, 1]
                probs = rec.probs[b][:, :, positions]  # [H, Tq, n]
                stack.append((probs * w).sum(1))  # [H, n]
            per = torch.stack(stack)  # [L, H, n]
            row_images.append(per if per_head else per.mean((0, 1), keepdim=True))
        out.append(row_images)
    return out


def image_rows(probed: Probed, weights: torch.Tensor) -> list[list[torch.Tensor]]:
    """Per row and image, ``[Tq, n]``: each recorded query row's attention to the image's
    tokens, averaged over the (layer, head) pairs with ``weights [L, H]``."""
    by_layer = {r.layer: r for r in probed.records}
    out: list[list[torch.Tensor]] = []
    for b, images in enumerate(probed.layout):
        row_images = []
        for image in images:
            total = None
            for li, layer in enumerate(probed.layers):
                probs = by_layer[layer].probs[b]  # [H, Tq, L]
                positions = image.positions.to(probs.device)
                w = weights[li].to(probs.device, probs.dtype)  # [H]
                part = torch.einsum("h,htn->tn", w, probs[:, :, positions].float())  # [Tq, n]
                total = part if total is None else total + part
            row_images.append(total.cpu())
        out.append(row_images)
    return out
