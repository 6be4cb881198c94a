"""Attention probes: read (and bias) a decoder's attention rows through instance hooks.

Nothing here needs ``output_attentions`` or an eager model. At a probed layer a forward pre-hook
recomputes, from the layer's own ``input_layernorm``, ``q_proj``, ``k_proj`` and the RoPE tables
the decoder hands it (``position_embeddings``), the query rows it was asked for and every key::

    P[b, h, t, s] = softmax_s( q[b, h, t] . k[b, h, s] * scaling  +  mask[b, t, s] )

with the layer's mask semantics (causal: key ``s <= `` the query's position; padding: keys whose
2-D ``attention_mask`` is 0 are excluded; a materialised 4-D layer mask is honoured too). In
decode, keys come from the layer's own KV cache plus the new token's k, so generated tokens are
probed with the cache they really attend to. At most a ``[B, H, Tq, S]`` slab per layer is ever
materialised (:mod:`vlm_focus.core.attention` holds the math).

On a pruned model (``vf.wrap``), a layer after a pruning stage holds only the kept tokens. The
shared call tracker (:mod:`vlm_focus.core.calls`) knows their original positions, so probes record
rows over the call's keys in original positions (0 at keys the layer no longer holds), and
biases are written in original positions and mapped onto the layer's keys: both read and change
exactly the attention the pruned model computes.

:class:`AttentionBias` is the writing twin: it replaces a layer's mask with an additive float mask
(``0`` / ``min`` from the same causal + padding semantics, plus a per-key bias), which both SDPA
and eager attention honour.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..model_adapters import ModelAdapter, get_adapter
from .attention import attention_probs
from .calls import CallState, CallTracker, Prefill
from .layer_view import LayerView, layer_attention_rows, layer_view

__all__ = [
    "AttentionBias",
    "AttentionProbe",
    "CallState",
    "LayerView",
    "Prefill",
    "QuerySpec",
    "Rows",
    "attention_layers",
    "attention_probs",
    "check_layers",
    "layer_attention_rows",
    "layer_view",
    "resolve_rows",
    "rows_from_mask",
]


@dataclass
class Rows:
    """Attention rows recorded at one layer in one call.

    ``probs [B, H, Tq, L]`` over every key of the call in original positions (prompt + cache +
    new; keys a pruned layer no longer holds get 0), ``positions [B, Tq]`` the query rows'
    original positions, ``mask [B, Tq]`` False on filler rows.
    """

    layer: int
    probs: torch.Tensor
    positions: torch.Tensor
    mask: torch.Tensor
    step: int


QuerySpec = torch.Tensor | str | Callable[[Prefill], tuple[torch.Tensor, torch.Tensor]]


def resolve_rows(prefill: Prefill, spec: QuerySpec) -> tuple[torch.Tensor, torch.Tensor]:
    """Query rows ``([B, Tq] positions, [B, Tq] mask)`` of a prefill for a row spec.

    ``"last"``: the final position; ``"text"``: the instruction (valid tokens after the last
    visual token); a ``[B, S]`` bool tensor: those positions; a ``[B, Tq]`` long tensor: positions
    (all valid); a callable: its own answer.
    """
    batch, seq = prefill.input_ids.shape
    device = prefill.input_ids.device
    if callable(spec) and not isinstance(spec, torch.Tensor):
        return spec(prefill)
    if isinstance(spec, str):
        if spec == "last":
            return (
                torch.full((batch, 1), seq - 1, device=device),
                torch.ones(batch, 1, dtype=torch.bool, device=device),
            )
        if spec == "text":
            return rows_from_mask(prefill.text_after_image())
        raise ValueError(f"query rows {spec!r}: use 'last', 'text' or a tensor of positions")
    if spec.dtype == torch.bool:
        if tuple(spec.shape) != (batch, seq):
            raise ValueError(f"query mask has shape {list(spec.shape)}, expected [{batch}, {seq}]")
        return rows_from_mask(spec.to(device))
    if spec.dim() != 2 or spec.shape[0] != batch:
        raise ValueError(f"query positions must be [{batch}, Tq], got {list(spec.shape)}")
    if bool(((spec < 0) | (spec >= seq)).any()):
        raise ValueError(f"query positions must lie in [0, {seq})")
    return spec.to(device).long(), torch.ones_like(spec, dtype=torch.bool, device=device)


def rows_from_mask(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[B, S]`` bool -> ragged rows padded to the longest: (positions, valid) ``[B, Tq]``;
    filler entries point at the last position (a text token every layer holds)."""
    counts = mask.sum(1)
    width = max(int(counts.max()), 1) if mask.shape[0] else 1
    order = torch.sort(mask.int(), dim=1, descending=True, stable=True).indices[:, :width]
    valid = torch.arange(width, device=mask.device)[None] < counts[:, None]
    positions = torch.where(valid, order, mask.shape[1] - 1)
    return positions, valid


class _LayerHooks:
    """Pre-hooks on chosen decoder layers plus a share of the model's call tracker."""

    def __init__(self, model: nn.Module, layers: Sequence[int] | None) -> None:
        self.model = model
        self.adapter = get_adapter(model)
        self.decoder_layers = self.adapter.decoder_layers(model)
        self.layers = attention_layers(model, layers)
        self.tracker: CallTracker | None = None
        self._hooks: list[Any] = []

    def __enter__(self):
        self.attach()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.remove()

    def attach(self) -> None:
        if self.tracker is not None:
            return
        self.tracker = CallTracker.acquire(self.model, self.adapter)
        try:
            for index in self.layers:
                layer = self.decoder_layers[index]
                self._hooks.append(
                    layer.register_forward_pre_hook(self._hook(index), with_kwargs=True)
                )
        except Exception:
            self.remove()
            raise

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        if self.tracker is not None:
            self.tracker.release()
            self.tracker = None

    @property
    def prefill(self) -> Prefill | None:
        return None if self.tracker is None else self.tracker.prefill

    def _hook(self, index: int) -> Callable:
        raise NotImplementedError


class AttentionProbe(_LayerHooks):
    """Record attention probabilities of chosen query rows at chosen decoder layers.

    Use as a context manager around ``model(...)`` or ``model.generate(...)``::

        with AttentionProbe(model, layers=[0, 1], rows="text") as probe:
            model(**inputs)
        probe.records  # list of Rows, one per (layer, call)

    Args:
        model: a supported VLM (``*ForConditionalGeneration``), pruned or not.
        layers: decoder layer indices; ``None`` for every layer with attention rows (a hybrid
            decoder's full-attention layers, :func:`attention_layers`).
        rows: prefill query rows (see :func:`resolve_rows`); ``None`` records no prefill rows.
        decode: also record every decode step's new token rows.
        on_rows: called with each :class:`Rows` as it is computed.
        keep: keep the rows in ``records`` (turn off when ``on_rows`` reduces them).
    """

    def __init__(
        self,
        model: nn.Module,
        layers: Sequence[int] | None = None,
        *,
        rows: QuerySpec | None = "last",
        decode: bool = False,
        on_rows: Callable[[Rows], None] | None = None,
        keep: bool = True,
    ) -> None:
        super().__init__(model, layers)
        self.rows = rows
        self.decode = decode
        self.on_rows = on_rows
        self.keep = keep
        self.records: list[Rows] = []
        self._rows_cache: tuple[Any, torch.Tensor, torch.Tensor] | None = None

    def __enter__(self) -> AttentionProbe:
        self.attach()
        return self

    def _hook(self, index: int) -> Callable:
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            tracker = self.tracker
            if tracker is None:
                return
            view = layer_view(tracker, self.adapter, index, module, args, kwargs)
            if view is None:
                return
            if view.prefill_call:
                if self.rows is None:
                    return
                rows, row_mask = self._prefill_rows(tracker.prefill)
            elif self.decode:
                rows = view.rows
                row_mask = torch.ones_like(rows, dtype=torch.bool)
            else:
                return
            with torch.no_grad():
                probs = view.attention(self.adapter, rows)
            record = Rows(index, probs, rows, row_mask, tracker.step)
            if self.on_rows is not None:
                self.on_rows(record)
            if self.keep:
                self.records.append(record)

        return hook

    def _prefill_rows(self, prefill: Prefill) -> tuple[torch.Tensor, torch.Tensor]:
        cached = self._rows_cache
        if cached is None or cached[0] is not prefill:
            rows, mask = resolve_rows(prefill, self.rows)
            self._rows_cache = (prefill, rows, mask)
            return rows, mask
        return cached[1], cached[2]


def check_layers(layers: Sequence[int], n_layers: int) -> list[int]:
    """Validated, de-duplicated, sorted layer indices (negative ones count from the end)."""
    if isinstance(layers, int | str) or not isinstance(layers, Sequence | range):
        raise TypeError(f"layers must be a sequence of ints, got {layers!r}")
    out = []
    for layer in layers:
        if isinstance(layer, bool) or not isinstance(layer, int):
            raise TypeError(f"layers must be ints, got {layer!r}")
        if not -n_layers <= layer < n_layers:
            raise ValueError(f"layer {layer} is outside [0, {n_layers}) for this model")
        out.append(layer % n_layers)
    if not out:
        raise ValueError("layers is empty")
    return sorted(set(out))


def attention_layers(model: nn.Module, layers: Sequence[int] | None = None) -> list[int]:
    """The decoder layers whose attention rows are read or biased: ``layers`` checked by
    :func:`check_layers`, or every layer with attention rows when ``None``.

    A hybrid decoder's recurrent layers (the adapter's ``recurrent_layers``, e.g. Qwen3.5's
    Gated DeltaNet layers) compute no attention rows and cannot hide a key, so they are left out
    of the default, and asking for one raises a ``ValueError`` that lists the layers to use.
    """
    adapter = get_adapter(model)
    n_layers = len(adapter.decoder_layers(model))
    recurrent = adapter.recurrent_layers(model)
    usable = [i for i in range(n_layers) if i not in recurrent]
    if layers is None:
        if not usable:
            raise ValueError(f"'{adapter.model_type}' has no decoder layer with attention rows")
        return usable
    chosen = check_layers(layers, n_layers)
    linear = [i for i in chosen if i in recurrent]
    if linear:
        raise ValueError(
            f"decoder layer(s) {linear} of this '{adapter.model_type}' model are linear-attention "
            f"(recurrent) layers with no attention rows to read or bias; use its full-attention "
            f"layers {usable}"
        )
    return chosen


BiasFn = Callable[[LayerView], torch.Tensor | None]


class AttentionBias(_LayerHooks):
    """Add a per-key bias to the attention logits of chosen layers (SDPA and eager).

    ``bias_fn(view) -> [B, T, W] float or None`` gives the additive bias of one decoder layer
    (:class:`LayerView`: its index, module, inputs and positions) for the call's ``T`` tokens
    over its ``W`` keys, in original positions (``-inf`` blocks a key); ``[B, H, T, W]`` gives
    one per query head (``H`` heads of q, not of the kv cache: GQA heads sharing a kv head may
    differ). It may read the layer's own attention and raw logits (:meth:`LayerView.attention`,
    :meth:`LayerView.logits`). The bias is mapped onto the tokens and keys the layer holds (a
    pruned layer holds fewer), the layer's own mask (causal + padding) is rebuilt as an additive
    float mask and the bias added, so the attention becomes
    ``softmax(q k^T * scaling + mask + bias)``.
    """

    def __init__(self, model: nn.Module, layers: Sequence[int], bias_fn: BiasFn) -> None:
        implementation = getattr(model.config, "_attn_implementation", None) or "eager"
        if implementation not in ("eager", "sdpa"):
            raise ValueError(
                f"attention biasing needs attn_implementation 'sdpa' or 'eager', got "
                f"{implementation!r} (flash attention takes no additive mask)"
            )
        super().__init__(model, layers)
        self.bias_fn = bias_fn

    def __enter__(self) -> AttentionBias:
        self.attach()
        return self

    def _hook(self, index: int) -> Callable:
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
            tracker = self.tracker
            if tracker is None or tracker.prefill is None:
                return None
            view = layer_view(tracker, self.adapter, index, module, args, kwargs)
            if view is None:
                return None
            with torch.no_grad():
                bias = self.bias_fn(view)
            if bias is None:
                return None
            heads = None  # a per-head bias: the heads of q
            if bias.dim() == 4:
                heads = getattr(module, self.adapter.attention).config.num_attention_heads
            return args, self._biased(view, bias, self.adapter, heads)

        return hook

    @staticmethod
    def _biased(
        view: LayerView, bias: torch.Tensor, adapter: ModelAdapter, n_heads: int | None
    ) -> dict:
        kwargs, hidden = view.kwargs, view.hidden
        batch = hidden.shape[0]
        n_call = view.call.input_ids.shape[1]
        shapes = ([batch, n_call, view.width], [batch, n_heads, n_call, view.width])
        if list(bias.shape) not in shapes:
            raise RuntimeError(
                f"bias has shape {list(bias.shape)}, expected {shapes[0]} or per head {shapes[1]}"
            )
        bias = view.to_layer(bias.to(hidden.device))  # [B, T_l, L] or [B, H, T_l, L]
        dtype = hidden.dtype if hidden.is_floating_point() else torch.float32
        low = torch.finfo(dtype).min
        mask = kwargs.get("attention_mask")
        if isinstance(mask, torch.Tensor) and mask.dim() == 4:
            if mask.dtype == torch.bool:
                base = torch.zeros(mask.shape, dtype=dtype, device=hidden.device)
                base = base.masked_fill(~mask, low).expand(batch, -1, -1, -1)
            else:
                base = mask.to(dtype).expand(batch, -1, -1, -1)
        else:
            allowed = view.rule_mask(adapter, view.rows)  # [B, T_l, L]
            base = torch.zeros(batch, 1, *allowed.shape[1:], dtype=dtype, device=hidden.device)
            base = base.masked_fill(~allowed[:, None], low)
        if tuple(base.shape[-2:]) != tuple(bias.shape[-2:]):
            raise RuntimeError(f"layer mask {list(base.shape)} does not match the call")
        bias = bias.to(dtype)
        if bias.dim() == 3:
            bias = bias[:, None]  # [B, 1, T, L]: every head alike
        blocked = torch.isneginf(bias)
        out = (base + bias.masked_fill(blocked, 0.0)).clamp(min=low).masked_fill(blocked, low)
        kwargs = dict(kwargs)
        kwargs["attention_mask"] = out
        return kwargs
