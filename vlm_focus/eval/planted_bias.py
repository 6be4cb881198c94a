"""A positional bias and attention sinks planted in a model's own attention, to test debiasing.

The debiasing paper describes real VLMs whose text-to-image attention "disproportionately favors
tokens appearing later in the sequence" (so the lower image rows) and inflates semantically
empty tokens. The organism models have neither: their fastv row means fall from top to bottom.
:class:`PlantedBias` gives a model both, inside the attention every reader of it computes, so
the model's answers and every pruner's scores see the same bias::

    logit[t, s] = q_t . k_s * scaling  +  b(s)

    b(s) = positional * i_s / (N - 1)  +  sinks * [s is one of the row's n_sinks emptiest tokens]

for the visual key ``s`` that is the ``i_s``-th of its row's ``N`` visual tokens (``b = 0`` for
text keys). "Emptiest" is judged from the content the decoder receives: the visual tokens whose
input embeddings lie closest (cosine) to the row's median visual embedding, i.e. plain
background, as the sinks of real models are.

How: per head, the lowest-frequency RoPE pair of q and k (dimensions ``D/2 - 1`` and ``D - 1``)
is given over to the bias. A forward hook on ``q_proj`` writes ``(1 / scaling, 0)`` there, one
on ``k_proj`` writes ``(b(s), 0)``; after RoPE the pair adds ``b(s) * cos((t - s) * w)`` to the
logit, and its frequency ``w`` is so low (``1.8e-4`` rad per position for head dim 32 and theta
1e4) that the cosine stays above 0.999 over a prompt of this size (checked at run time). The
pair's original share of the attention is lost, so ``PlantedBias(model)`` with both strengths
at 0 is the reference the bias is measured against. The pruners' scoring calls the same
projections (:func:`vlm_focus.core.attention.layer_qk`), so it reads the biased attention.

The keys' bias follows each token through pruning: decoder layer pre-hooks look it up by the
layer's own (possibly pruned) position ids. A pruning stage scores its input before that
lookup, so only single-stage pruning is supported (a second stage raises).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from ..core.calls import cache_length, cache_of
from ..model_adapters import get_adapter, supported_models

__all__ = ["PlantedBias", "planted_key_bias"]

MIN_COSINE = 0.999  # the bias pair's largest allowed drift over a prompt


def planted_key_bias(
    embeds: torch.Tensor,
    visual: torch.Tensor,
    *,
    positional: float,
    sinks: float,
    n_sinks: int,
) -> torch.Tensor:
    """``[B, S]`` logit bias of each key: ``positional * i / (N - 1)`` on the ``i``-th of a
    row's ``N`` visual tokens, plus ``sinks`` on its ``n_sinks`` visual tokens closest (cosine)
    to the row's median visual embedding; 0 on text."""
    bias = torch.zeros(visual.shape, dtype=torch.float32, device=visual.device)
    for b in range(visual.shape[0]):
        where = visual[b].nonzero()[:, 0]
        n = where.numel()
        if n == 0:
            continue
        if n > 1:
            bias[b, where] += positional * torch.arange(n, device=bias.device) / (n - 1)
        if sinks and n_sinks:
            tokens = embeds[b, where].float()
            median = tokens.median(dim=0).values
            near = torch.nn.functional.cosine_similarity(tokens, median[None], dim=-1)
            bias[b, where[near.topk(min(n_sinks, n)).indices]] += sinks
    return bias


def _lowest_frequency(decoder: nn.Module) -> float:
    """The rotation per position of the decoder's lowest-frequency RoPE pair (the bias pair)."""
    inv_freq = getattr(getattr(decoder, "rotary_emb", None), "inv_freq", None)
    if inv_freq is None:
        raise ValueError("PlantedBias needs the decoder's RoPE table (rotary_emb.inv_freq)")
    return float(inv_freq[-1])


class PlantedBias:
    """Plant :func:`planted_key_bias` in every decoder layer of a model with 1-D RoPE positions;
    a context manager (``with PlantedBias(model, positional=4.0): ...``), or ``attach()`` /
    ``remove()``. Attach it before or after ``vlm_focus.wrap``: the wrap's hooks run first."""

    def __init__(
        self,
        model: nn.Module,
        *,
        positional: float = 0.0,
        sinks: float = 0.0,
        n_sinks: int = 4,
    ) -> None:
        for name, value in (("positional", positional), ("sinks", sinks)):
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"{name}={value!r} must be a number (a logit bias)")
            if not math.isfinite(value):
                raise ValueError(f"{name}={value!r} must be finite")
        if isinstance(n_sinks, bool) or not isinstance(n_sinks, int) or n_sinks < 0:
            raise ValueError(f"n_sinks={n_sinks!r} must be an int >= 0")
        self.adapter = get_adapter(model)
        if not self.adapter.consecutive_positions:  # the bias is laid out by 1-D position id
            raise ValueError(
                f"PlantedBias needs a 1-D RoPE decoder (one of "
                f"{', '.join(supported_models(consecutive_positions=True))}), got "
                f"'{self.adapter.model_type}'"
            )
        self.model = model
        self.positional, self.sinks, self.n_sinks = float(positional), float(sinks), n_sinks
        self._hooks: list[Any] = []
        self._visual: torch.Tensor | None = None  # [B, S] of the current prompt
        self._by_position: torch.Tensor | None = None  # [B, P] bias by position id
        self._keys: torch.Tensor | None = None  # [B, T] bias of the tokens k_proj sees next
        self._decoding = False  # the current call extends a cache: its tokens are text

    def __enter__(self) -> PlantedBias:
        self.attach()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.remove()

    def attach(self) -> None:
        if self._hooks:
            raise RuntimeError("this PlantedBias is already attached")
        adapter, model = self.adapter, self.model
        decoder = adapter.decoder(model)
        self._lowest = _lowest_frequency(decoder)
        hooks = [
            model.register_forward_pre_hook(self._on_model, with_kwargs=True),
            decoder.register_forward_pre_hook(self._on_decoder, with_kwargs=True),
        ]
        for layer in adapter.decoder_layers(model):
            attention = getattr(layer, adapter.attention)
            hooks.append(layer.register_forward_pre_hook(self._on_layer, with_kwargs=True))
            hooks.append(attention.q_proj.register_forward_hook(self._query_hook(attention)))
            hooks.append(attention.k_proj.register_forward_hook(self._key_hook(attention)))
        self._hooks = hooks

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()

    # --- what the bias is, per prompt and per layer ----------------------------------------------
    def _on_model(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        if isinstance(input_ids, torch.Tensor) and cache_length(cache_of(kwargs)) == 0:
            self._visual = self.adapter.visual_mask(module, input_ids)

    def _on_decoder(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        embeds = kwargs.get("inputs_embeds")
        if embeds is None:
            raise ValueError("PlantedBias needs the decoder to be called with inputs_embeds")
        batch, seq = embeds.shape[:2]
        self._decoding = cache_length(cache_of(kwargs)) > 0
        if self._decoding:  # new tokens are text
            self._keys = torch.zeros(batch, seq, device=embeds.device)
            return
        visual = self._visual
        if visual is None or tuple(visual.shape) != (batch, seq):
            raise ValueError("PlantedBias saw a prefill it cannot match to input_ids")
        bias = planted_key_bias(
            embeds,
            visual.to(embeds.device),
            positional=self.positional,
            sinks=self.sinks,
            n_sinks=self.n_sinks,
        )
        positions = self._positions(kwargs.get("position_ids"), batch, seq, embeds.device)
        if math.cos(self._lowest * float(positions.max())) < MIN_COSINE:
            raise ValueError(
                f"a prompt of {int(positions.max()) + 1} positions turns the bias pair by more "
                f"than acos({MIN_COSINE}): use shorter prompts"
            )
        lookup = torch.zeros(batch, int(positions.max()) + 1, device=embeds.device)
        self._by_position = lookup.scatter(1, positions, bias)  # pads share text's 0
        self._keys = bias

    def _on_layer(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        hidden = args[0] if args else kwargs["hidden_states"]
        batch, seq = hidden.shape[:2]
        if self._decoding:
            self._keys = torch.zeros(batch, seq, device=hidden.device)
            return
        positions = self._positions(kwargs.get("position_ids"), batch, seq, hidden.device)
        self._keys = self._by_position.gather(1, positions)

    @staticmethod
    def _positions(position_ids: Any, batch: int, seq: int, device: Any) -> torch.Tensor:
        if position_ids is None:
            return torch.arange(seq, device=device).expand(batch, seq)
        if position_ids.dim() != 2:
            raise ValueError("PlantedBias needs 1-D RoPE position ids [B, S]")
        return position_ids.to(device).long().expand(batch, seq)

    # --- the bias pair -------------------------------------------------------------------------
    @staticmethod
    def _pair(out: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, int, int]:
        heads = out.view(*out.shape[:-1], -1, head_dim)
        return heads, head_dim // 2 - 1, head_dim - 1

    def _query_hook(self, attention: nn.Module):
        def hook(module: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
            heads, first, second = self._pair(out.clone(), attention.head_dim)
            heads[..., first] = 1.0 / attention.scaling
            heads[..., second] = 0.0
            return heads.flatten(-2)

        return hook

    def _key_hook(self, attention: nn.Module):
        def hook(module: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
            keys = self._keys
            if keys is None or tuple(keys.shape) != tuple(out.shape[:2]):
                raise RuntimeError(
                    f"PlantedBias holds key biases for {None if keys is None else list(keys.shape)}"
                    f" tokens, k_proj got {list(out.shape[:2])} (several pruning stages, or a "
                    "pruner that projects keys itself, are not supported)"
                )
            heads, first, second = self._pair(out.clone(), attention.head_dim)
            heads[..., first] = keys[..., None].to(out.dtype)
            heads[..., second] = 0.0
            return heads.flatten(-2)

        return hook
