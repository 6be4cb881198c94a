"""Attention intervention: raise the attention logits of visual tokens at chosen layers, placed
as the instruction-relevant keys, PAI or ClearSight's VAF."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from ..config import keep_count
from ..core.attention import instruction_relevance
from ..core.options import check_choices, option
from ..core.probe import AttentionBias, LayerView, Prefill, attention_layers, rows_from_mask
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


#: Where the boost goes: ``relevant`` (the instruction-relevant visual keys, every row of the
#: instruction), ``pai`` (PAI: every image key, the generating row only, proportional to the
#: logit) and ``vaf`` (ClearSight's visual amplification fusion: the middle layers, every image
#: key up, the text before the image down).
PLACEMENTS = ("relevant", "pai", "vaf")


@dataclass
class AttentionReweightOptions:
    """The options of :func:`attention_reweight`."""

    strength: float = option(
        1.0,
        "the boost: relevant adds it to the logits of the relevant visual keys; pai: alpha in "
        "z + alpha |z| on the image keys; vaf: attention to the image times (1 + strength)",
    )
    layers: list[int] | None = option(
        None,
        "decoder layers to reweight (none: the placement's; relevant every layer, pai from "
        "skip on, vaf the middle layers [n/4, n/2); a hybrid decoder's full-attention ones)",
    )
    ratio: float = option(
        0.25, "relevant: share of the visual tokens that are task-relevant, in (0, 1]"
    )
    placement: str = option(
        "relevant", "where the boost goes: relevant, pai or vaf", choices=PLACEMENTS
    )
    skip: int = option(2, "pai: the first layers left alone (its layers are skip .. n-1), >= 0")
    suppress: float = option(
        0.0, "vaf: attention to the text before the image times (1 - suppress), in [0, 1)"
    )
    heads: float = option(
        1.0,
        "share of heads boosted per layer, in (0, 1]: those whose instruction rows attend "
        "most to the image",
    )

    def __post_init__(self) -> None:
        check_numbers(self, "strength", "ratio", "suppress", "heads")
        check_choices(self, AttentionReweightOptions)
        if not 0 < self.ratio <= 1:
            raise ValueError(f"ratio must lie in (0, 1], got {self.ratio}")
        if isinstance(self.skip, bool) or not isinstance(self.skip, int):
            raise TypeError(f"skip must be an int, got {self.skip!r}")
        if self.skip < 0:
            raise ValueError(f"skip must be >= 0, got {self.skip}")
        if not 0 <= self.suppress < 1:
            raise ValueError(f"suppress must lie in [0, 1), got {self.suppress}")
        if not 0 < self.heads <= 1:
            raise ValueError(f"heads must lie in (0, 1], got {self.heads}")
        if self.placement == "vaf" and self.strength <= -1:
            raise ValueError(
                f"vaf scales attention by 1 + strength: strength must be > -1, got {self.strength}"
            )


def default_layers(placement: str, usable: Sequence[int], skip: int) -> list[int]:
    """The layers a placement reweights when ``layers`` is not given, chosen among ``usable``
    (the decoder layers with attention rows, in order: every layer but a hybrid decoder's
    linear-attention ones)."""
    usable = list(usable)
    if placement == "pai":
        chosen = [i for i in usable if i >= skip]
        if not chosen:
            raise ValueError(f"skip={skip} leaves none of this model's attention layers {usable}")
        return chosen
    if placement == "vaf":  # the middle layers, where the image is fused into the text
        n = len(usable)
        start = round(n / 4)
        return usable[start : max(round(n / 2), start + 1)]
    return usable


def visual_heads(probs: torch.Tensor, rows: torch.Tensor, visual: torch.Tensor, share: float):
    """``[B, H]`` bool: per batch row the ``keep_count(share, H)`` heads whose query rows put the
    most attention on the visual keys (``probs [B, H, Tq, W]``, ``rows [B, Tq]`` the valid
    rows, ``visual [B, S]``, ``S <= W``; ties to the lower head)."""
    batch, n_heads = probs.shape[:2]
    image = visual.to(probs.device)[:, None, None].float()
    on_image = probs[..., : visual.shape[1]].mul(image).sum(-1)  # [B, H, Tq]
    weights = rows.float() / rows.sum(1, keepdim=True).clamp(min=1)  # [B, Tq]
    mass = torch.einsum("bht,bt->bh", on_image, weights)
    order = torch.sort(mass, dim=1, descending=True, stable=True).indices
    chosen = order[:, : keep_count(float(share), n_heads)]
    return torch.zeros(batch, n_heads, dtype=torch.bool, device=probs.device).scatter(
        1, chosen, True
    )


@register_mitigation
class AttentionReweight(Mitigation):
    """Context manager; see :func:`attention_reweight`."""

    name = "attention_reweight"
    Options = AttentionReweightOptions
    summary = "raise the attention logits of the visual tokens (relevant ones, PAI or VAF)"

    def __init__(self, model: nn.Module, options: AttentionReweightOptions) -> None:
        self.model = model
        self.placement = options.placement
        self.strength = float(options.strength)
        self.ratio = float(options.ratio)
        self.suppress = float(options.suppress)
        self.heads = float(options.heads)
        self.adapter = get_adapter(model)
        self.relevant: dict[int, torch.Tensor] = {}  # layer -> [B, S] bool (last prefill)
        self.chosen_heads: dict[int, torch.Tensor] = {}  # layer -> [B, H] bool (heads < 1)
        self._read: set[int] = set()  # layers that read the last prefill
        self.text_rows: torch.Tensor | None = None  # [B, S] bool
        self._prefill: Prefill | None = None
        self._has_visual = False
        layers = options.layers
        if layers is None:
            layers = default_layers(self.placement, attention_layers(model), options.skip)
        self._bias = AttentionBias(model, layers, self._bias_fn)
        self.layers = self._bias.layers

    def attach(self) -> None:
        self._bias.attach()

    def remove(self) -> None:
        """Remove every hook: the model is exactly as before."""
        self._bias.remove()

    def _acts(self) -> bool:
        if self.placement == "vaf":
            return self.strength != 0 or self.suppress != 0
        return self.strength != 0

    def _bias_fn(self, view: LayerView) -> torch.Tensor | None:
        prefill, call = view.prefill, view.call
        if prefill is not self._prefill:
            self._prefill = prefill
            self.relevant.clear()
            self.chosen_heads.clear()
            self._read.clear()
            self.text_rows = prefill.text_after_image()
            self._has_visual = bool(prefill.visual.any())  # read once per prefill
        if not self._has_visual or not self._acts():
            return None
        index = view.index
        if index not in self._read:
            if call.past != 0:
                return None  # a decode step of a prefill this context did not see
            self._read_prefill(view)
            self._read.add(index)
        if self.placement == "pai":
            bias = self._pai(view)
        else:
            columns = self._columns(view)  # [B, W]
            bias = columns[:, None, :] * self._text_rows(view)[:, :, None].float()  # [B, T, W]
        heads = self.chosen_heads.get(index)
        if heads is None:
            return bias
        if bias.dim() == 3:
            bias = bias[:, None]
        return bias * heads[:, :, None, None].to(bias.dtype)  # [B, H, T, W]

    def _read_prefill(self, view: LayerView) -> None:
        """What the layer's own q/k say at the prefill: the relevant visual keys (placement
        relevant) and the heads to boost (``heads < 1``)."""
        prefill, index = view.prefill, view.index
        if self.placement != "relevant" and self.heads == 1:
            return
        # attention of the instruction rows, from this layer's q/k over the keys it holds
        # (a pruned layer: the kept ones)
        rows, row_mask = rows_from_mask(self.text_rows)
        probs = view.attention(self.adapter, rows)  # [B, H, Tq, S]
        if self.placement == "relevant":
            scores = instruction_relevance(probs, row_mask)  # [B, S]
            self.relevant[index] = relevant_tokens(scores, prefill.visual, self.ratio)
        if self.heads < 1:
            self.chosen_heads[index] = visual_heads(probs, row_mask, prefill.visual, self.heads)

    def _text_rows(self, view: LayerView) -> torch.Tensor:
        """``[B, T]`` bool: the call's rows that are instruction text (every generated row)."""
        call = view.call
        batch, new = call.input_ids.shape
        seq = self.text_rows.shape[1]
        is_text = torch.ones(batch, new, dtype=torch.bool, device=view.hidden.device)
        n_prompt = min(new, seq - call.past)  # this call's rows inside the prompt (host ints)
        if n_prompt > 0:
            is_text[:, :n_prompt] = self.text_rows[:, call.past : call.past + n_prompt]
        return is_text

    def _columns(self, view: LayerView) -> torch.Tensor:
        """``[B, W]`` the additive bias of a text row per key (relevant, vaf)."""
        prefill = view.prefill
        seq = prefill.visual.shape[1]
        columns = torch.zeros(view.hidden.shape[0], view.width, device=view.hidden.device)
        if self.placement == "relevant":
            columns[:, :seq] = self.relevant[view.index].float() * self.strength
            return columns
        visual = prefill.visual.to(columns.device)
        index = torch.arange(seq, device=columns.device).expand_as(visual)
        first = torch.where(visual, index, seq).amin(1, keepdim=True)  # first visual token
        before = prefill.valid.to(columns.device) & (index < first)  # system prompt, BOS
        columns[:, :seq] = visual.float() * math.log1p(self.strength)
        columns[:, :seq] += before.float() * math.log1p(-self.suppress)
        return columns

    def _pai(self, view: LayerView) -> torch.Tensor:
        """``[B, H, T, W]``: the generating rows (the last prompt row, every decode row) get
        ``strength * |z|`` on the image keys, ``z`` their raw per-head logits."""
        call, prefill = view.call, view.prefill
        batch, new = call.input_ids.shape
        seq = prefill.visual.shape[1]
        first = max(seq - 1 - call.past, 0)  # this call's first generating row
        device = view.hidden.device
        positions = torch.arange(call.past + first, call.past + new, device=device)
        logits = view.logits(self.adapter, positions.repeat(batch, 1))  # [B, H, Tg, W]
        image = torch.zeros(batch, view.width, device=device)
        image[:, :seq] = prefill.visual.to(device).float()
        bias = logits.new_zeros(batch, logits.shape[1], new, view.width)
        bias[:, :, first:] = self.strength * logits.abs() * image[:, None, None]
        return bias


def attention_reweight(
    model: nn.Module,
    *,
    strength: float = AttentionReweightOptions.strength,
    layers: Sequence[int] | None = AttentionReweightOptions.layers,
    ratio: float = AttentionReweightOptions.ratio,
    placement: str = AttentionReweightOptions.placement,
    skip: int = AttentionReweightOptions.skip,
    suppress: float = AttentionReweightOptions.suppress,
    heads: float = AttentionReweightOptions.heads,
) -> AttentionReweight:
    """Raise the attention logits of visual tokens (attention intervention), where
    ``placement`` says.

    ``"relevant"`` (the default): at each chosen layer (default every layer), on the prompt's
    prefill, the instruction rows ``T`` (text after the image) score the visual tokens from the
    layer's own q/k (the text-to-vision submatrix of attention, i.e. vision-text similarity)::

        r[v] = 1/(H |T|) sum_h sum_{t in T} A^{l,h}[t, v]

    The top ``round(ratio * n_visual)`` visual tokens by ``r`` (at least 1:
    :func:`vlm_focus.config.keep_count`, the rule of ``vf.wrap``'s ``keep``) are task-relevant.
    From then on (prefill and every decode step) the logits of text rows to those keys get
    ``+ strength``::

        A'[t, :] = softmax(q_t k^T * scaling + mask + strength * 1[relevant])

    so their attention weight grows by ``exp(strength)`` before renormalisation, while all other
    visual tokens are left as they are.

    ``"pai"`` (PAI, Liu et al., ECCV 2024): at layers ``skip`` .. n-1 (the first layers, where
    the image is read, are left alone) only the generating row (the last prompt row at the
    prefill, then every decode row) changes: its raw logit ``z`` to every image key becomes
    ``z + strength * |z|`` per head.

    ``"vaf"`` (ClearSight's visual amplification fusion): in the middle layers
    ``[round(n/4), round(n/2))`` (at least one) every text row after the image scales its
    attention to the image keys by ``1 + strength`` and to the text before the image (system
    prompt, BOS) by ``1 - suppress``, i.e. adds ``log(1 + strength)`` and ``log(1 - suppress)``
    to those logits.

    ``layers`` overrides a placement's layers. ``heads < 1`` boosts, per layer and prompt, only
    the ``round(heads * H)`` heads (at least 1) whose instruction rows put the most attention on
    the image at the prefill (from the layer's own q/k); the other heads are left as they are.

    On a pruned model (``vf.wrap``) a layer after a pruning stage scores and boosts only the
    visual tokens it still holds (pruned ones score 0). Use as a context manager around
    ``generate()``; works with SDPA and eager (the layer's mask becomes an additive float mask,
    per head where the bias differs by head).
    """
    options = AttentionReweightOptions(
        strength=strength,
        layers=layers,
        ratio=ratio,
        placement=placement,
        skip=skip,
        suppress=suppress,
        heads=heads,
    )
    return AttentionReweight(model, options)
