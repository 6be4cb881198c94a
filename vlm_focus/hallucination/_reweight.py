"""Attention intervention: raise the logits of task-relevant visual tokens at chosen layers."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from ..config import keep_count
from ..core.attention import instruction_relevance
from ..core.options import option
from ..core.probe import AttentionBias, LayerView, Prefill, rows_from_mask
from ..model_adapters import get_adapter
from .registry import Mitigation, check_numbers, register_mitigation


def relevant_tokens(scores: torch.Tensor, visual: torch.Tensor, ratio: float) -> torch.Tensor:
    """``[B, S]`` bool: per row the ``keep_count(ratio, n_visual)`` visual tokens of highest
    score (:func:`vlm_focus.config.keep_count`: ``round(ratio * n_visual)``, at least 1; ties to
    the lower position)."""
    out = torch.zeros_like(visual)
    for b in range(visual.shape[0]):
        idx = torch.nonzero(visual[b]).flatten()
        if idx.numel() == 0:
            continue
        n = keep_count(float(ratio), idx.numel())
        order = torch.sort(scores[b, idx].float(), descending=True, stable=True).indices[:n]
        out[b, idx[order]] = True
    return out


@dataclass
class AttentionReweightOptions:
    """The options of :func:`attention_reweight`."""

    strength: float = option(
        1.0, "added to the attention logits of text rows to the relevant tokens"
    )
    layers: list[int] | None = option(None, "decoder layers to reweight (none: every layer)")
    ratio: float = option(0.25, "share of the visual tokens that are task-relevant, in (0, 1]")

    def __post_init__(self) -> None:
        check_numbers(self, "strength", "ratio")
        if not 0 < self.ratio <= 1:
            raise ValueError(f"ratio must lie in (0, 1], got {self.ratio}")


@register_mitigation
class AttentionReweight(Mitigation):
    """Context manager; see :func:`attention_reweight`."""

    name = "attention_reweight"
    Options = AttentionReweightOptions
    summary = "raise the attention logits of the instruction-relevant visual tokens"

    def __init__(self, model: nn.Module, options: AttentionReweightOptions) -> None:
        n_layers = len(get_adapter(model).decoder_layers(model))
        self.model = model
        self.strength = float(options.strength)
        self.ratio = float(options.ratio)
        self.adapter = get_adapter(model)
        self.relevant: dict[int, torch.Tensor] = {}  # layer -> [B, S] bool (last prefill)
        self.text_rows: torch.Tensor | None = None  # [B, S] bool
        self._prefill: Prefill | None = None
        self._has_visual = False
        layers = options.layers
        self._bias = AttentionBias(
            model, range(n_layers) if layers is None else layers, self._bias_fn
        )
        self.layers = self._bias.layers

    def attach(self) -> None:
        self._bias.attach()

    def remove(self) -> None:
        """Remove every hook: the model is exactly as before."""
        self._bias.remove()

    def _bias_fn(self, view: LayerView) -> torch.Tensor | None:
        prefill, call = view.prefill, view.call
        if prefill is not self._prefill:
            self._prefill = prefill
            self.relevant.clear()
            self.text_rows = prefill.text_after_image()
            self._has_visual = bool(prefill.visual.any())  # read once per prefill
        if not self._has_visual or self.strength == 0:
            return None
        index = view.index
        if index not in self.relevant:
            if call.past != 0:
                return None  # a decode step of a prefill this context did not see
            # relevance: attention of the instruction rows to the visual keys, from this
            # layer's q/k over the keys it holds (a pruned layer: the kept ones)
            rows, row_mask = rows_from_mask(self.text_rows)
            probs = view.attention(self.adapter, rows)  # [B, H, Tq, S]
            scores = instruction_relevance(probs, row_mask)  # [B, S]
            self.relevant[index] = relevant_tokens(scores, prefill.visual, self.ratio)
        relevant = self.relevant[index]
        batch, new = call.input_ids.shape
        total = view.width
        seq = relevant.shape[1]
        device = view.hidden.device
        is_text = torch.ones(batch, new, dtype=torch.bool, device=device)
        n_prompt = min(new, seq - call.past)  # this call's rows inside the prompt (host ints)
        if n_prompt > 0:
            is_text[:, :n_prompt] = self.text_rows[:, call.past : call.past + n_prompt]
        columns = torch.zeros(batch, total, device=device)
        columns[:, :seq] = relevant.float() * self.strength
        return columns[:, None, :] * is_text[:, :, None].float()  # [B, T, W]


def attention_reweight(
    model: nn.Module,
    *,
    strength: float = AttentionReweightOptions.strength,
    layers: Sequence[int] | None = AttentionReweightOptions.layers,
    ratio: float = AttentionReweightOptions.ratio,
) -> AttentionReweight:
    """Raise the attention logits of task-relevant visual tokens (attention intervention).

    At each chosen layer, on the prompt's prefill, the instruction rows ``T`` (text after the
    image) score the visual tokens from the layer's own q/k (the text-to-vision submatrix of
    attention, i.e. vision-text similarity)::

        r[v] = 1/(H |T|) sum_h sum_{t in T} A^{l,h}[t, v]

    The top ``round(ratio * n_visual)`` visual tokens by ``r`` (at least 1:
    :func:`vlm_focus.config.keep_count`, the rule of ``vf.wrap``'s ``keep``) are task-relevant.
    From then on (prefill and every decode step) the logits of text rows to those keys get
    ``+ strength``::

        A'[t, :] = softmax(q_t k^T * scaling + mask + strength * 1[relevant])

    so their attention weight grows by ``exp(strength)`` before renormalisation, while all other
    visual tokens are left as they are. On a pruned model (``vf.wrap``) a layer after a pruning
    stage scores and boosts only the visual tokens it still holds (pruned ones score 0). Use as
    a context manager around ``generate()``; works with SDPA and eager (the layer's mask becomes
    an additive float mask).
    """
    options = AttentionReweightOptions(strength=strength, layers=layers, ratio=ratio)
    return AttentionReweight(model, options)
