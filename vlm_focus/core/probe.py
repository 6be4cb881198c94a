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
from .attention import allowed_keys, attention_probs, layer_qk
from .calls import CallState, CallTracker, Prefill, cache_of

__all__ = [
    "AttentionBias",
    "AttentionProbe",
    "CallState",
    "LayerView",
    "Prefill",
    "QuerySpec",
    "Rows",
    "attention_probs",
    "check_layers",
    "layer_attention_rows",
    "layer_view",
    "resolve_rows",
    "rows_from_mask",
]


def _past_keys(cache: Any, layer_idx: int) -> torch.Tensor | None:
    """The keys a layer holds before this call (``[B, Hkv, L, D]``, after RoPE), or None."""
    if cache is None or int(cache.get_seq_length(layer_idx)) == 0:
        return None
    layers = getattr(cache, "layers", None)
    if layers is None:
        raise ValueError(f"cannot read keys from a cache of type {type(cache).__name__}")
    return layers[layer_idx].keys


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


@dataclass
class LayerView:
    """One decoder layer's share of the current call, in original positions.

    A layer after a pruning stage holds only the kept prompt tokens: ``rows [B, T]`` are the
    original positions of the tokens it computes in this call, ``keys [B, L]`` those of the keys
    it attends to (its cache, then this call's tokens), ``None`` when it holds every one
    (``0 .. width-1``). ``valid [B, L]`` marks the non-padding keys, ``allowed [B, T, L]`` what
    the layer's own mask lets each row see (``None``: causal + padding), ``past`` its cache.
    """

    index: int
    layer: nn.Module
    hidden: torch.Tensor
    kwargs: dict
    call: CallState
    prefill: Prefill | None
    rows: torch.Tensor
    keys: torch.Tensor | None
    valid: torch.Tensor
    past: torch.Tensor | None
    allowed: torch.Tensor | None

    @property
    def width(self) -> int:
        """Keys of the call in original positions (the 2-D mask's width)."""
        return self.call.valid.shape[1]

    @property
    def prefill_call(self) -> bool:
        return self.past is None

    def local(self, positions: torch.Tensor) -> torch.Tensor:
        """Indices into this layer's tokens of the original ``positions [B, Tq]``; a position
        the layer no longer holds (a pruned visual token) raises."""
        if self.keys is None or not self.prefill_call:
            return positions - self.call.past
        local = torch.searchsorted(self.rows, positions).clamp(max=self.rows.shape[1] - 1)
        if not bool((self.rows.gather(1, local) == positions).all()):
            raise ValueError(
                f"a query row is a visual token that pruning removed before layer {self.index}; "
                "query text tokens, or probe layers before the pruning stage"
            )
        return local

    def to_full(self, x: torch.Tensor) -> torch.Tensor:
        """``[..., L]`` values over this layer's keys scattered to ``[..., width]`` (0 at keys
        the layer does not hold); the leading dim is the batch."""
        if self.keys is None:
            return x
        out = x.new_zeros(*x.shape[:-1], self.width)
        index = self.keys.view(self.keys.shape[0], *([1] * (x.dim() - 2)), -1).expand_as(x)
        return out.scatter(-1, index, x)

    def to_layer(self, full: torch.Tensor) -> torch.Tensor:
        """``[B, T, width]`` over the call's tokens and keys -> ``[B, T_l, L]`` over this
        layer's tokens and keys."""
        if self.keys is None:
            return full
        rows = self.rows - self.call.past
        full = full.gather(1, rows[..., None].expand(-1, -1, full.shape[-1]))
        return full.gather(2, self.keys[:, None, :].expand(-1, full.shape[1], -1))

    def attention(self, adapter: ModelAdapter, positions: torch.Tensor) -> torch.Tensor:
        """``[B, H, Tq, width]`` attention of the rows at original ``positions`` (tokens of
        this call) over the call's keys, from the layer's own q/k."""
        local = self.local(positions)
        allowed = None
        if self.allowed is not None:
            allowed = self.allowed.expand(local.shape[0], -1, -1)
            allowed = allowed.gather(1, local[..., None].expand(-1, -1, allowed.shape[-1]))
        probs = layer_attention_rows(
            adapter,
            self.layer,
            self.hidden,
            self.kwargs,
            local,
            positions,
            self.past,
            self.valid,
            self.keys,
            allowed,
        )
        return self.to_full(probs)


def _layer_allowed(mask: Any, n_rows: int, n_keys: int) -> torch.Tensor | None:
    """``[B, T, L]`` bool from a layer's materialised 4-D mask (bool, or additive float), or
    None when the layer gets no such mask (causal + padding then say it all)."""
    if not isinstance(mask, torch.Tensor) or mask.dim() != 4:
        return None
    if tuple(mask.shape[-2:]) != (n_rows, n_keys):
        raise RuntimeError(
            f"layer mask {list(mask.shape)} does not match {n_rows} rows and {n_keys} keys"
        )
    mask = mask[:, 0]
    if mask.dtype == torch.bool:
        return mask
    return mask > torch.finfo(mask.dtype).min / 2


def layer_view(
    tracker: CallTracker, adapter: ModelAdapter, index: int, layer: nn.Module, args, kwargs
) -> LayerView | None:
    """How decoder layer ``index`` sees the current call, or None when nothing is tracked."""
    call = tracker.call
    if call is None:
        if tracker.problem is not None:
            raise ValueError(f"attention probes and biases need {tracker.problem}")
        return None
    if call.compiled:
        raise ValueError(
            "attention probes and biases read host-side lengths at every step and do not run "
            "inside torch.compile; run them uncompiled"
        )
    if call.past > 0 and tracker.fixating():
        raise ValueError(
            "attention probes and biases do not read the decoding steps of pruner='fixation' "
            "(each step attends to its own visual columns); probe the prefill, or use a "
            "prefill pruner"
        )
    hidden = args[0] if args else kwargs["hidden_states"]
    attn = getattr(layer, adapter.attention)
    past = _past_keys(cache_of(kwargs), attn.layer_idx)
    n_past = 0 if past is None else past.shape[2]
    batch, n_new = hidden.shape[:2]
    device = hidden.device
    kept = tracker.prompt_positions(index)
    width = call.valid.shape[1]
    if kept is None:
        if n_past + n_new != width:
            raise RuntimeError(f"layer {index} keys ({n_past + n_new}) and mask ({width}) differ")
        rows = torch.arange(call.past, call.past + n_new, device=device).expand(batch, -1)
        keys, valid = None, call.valid.to(device)
    else:
        kept = kept.to(device)
        if past is None:
            rows = keys = kept
        else:
            later = torch.arange(tracker.prompt_length, width, device=device).expand(batch, -1)
            keys = torch.cat([kept, later], dim=1)
            rows = later[:, later.shape[1] - n_new :]
        if keys.shape[1] != n_past + n_new:
            raise RuntimeError(
                f"layer {index} holds {n_past + n_new} keys, the pruning trace {keys.shape[1]}"
            )
        valid = call.valid.to(device).gather(1, keys)
    allowed = _layer_allowed(kwargs.get("attention_mask"), n_new, n_past + n_new)
    return LayerView(
        index, layer, hidden, kwargs, call, tracker.prefill, rows, keys, valid, past, allowed
    )


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
        n_layers = len(self.decoder_layers)
        self.layers = list(range(n_layers)) if layers is None else check_layers(layers, n_layers)
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
        layers: decoder layer indices; ``None`` for all.
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


def layer_attention_rows(
    adapter: ModelAdapter,
    layer: nn.Module,
    hidden: torch.Tensor,
    kwargs: dict,
    local: torch.Tensor,
    rows: torch.Tensor,
    past: torch.Tensor | None,
    valid: torch.Tensor,
    key_positions: torch.Tensor | None = None,
    allowed: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention probabilities ``[B, H, Tq, L]`` of the query rows ``local [B, Tq]`` (indices
    into this call's ``hidden``; original positions ``rows``) over the layer's ``L`` keys
    (``past`` cached keys, then this call's), from the layer's own norm, projections and RoPE
    tables. ``valid [B, L]`` marks non-padding keys, ``key_positions [B, L]`` their original
    positions (default ``0 .. L-1``), ``allowed [B, Tq, L]`` what the layer's mask permits."""
    cos, sin = kwargs["position_embeddings"]
    q, k = layer_qk(adapter, layer, hidden, cos, sin, local)  # [B, H, Tq, D], [B, Hkv, T, D]
    if past is not None:
        k = torch.cat([past.to(k.dtype), k], dim=2)  # [B, Hkv, L, D]
    total = k.shape[2]
    if valid.shape[1] != total:
        raise RuntimeError(f"layer keys ({total}) and attention_mask ({valid.shape[1]}) differ")
    permitted = allowed_keys(valid, rows, key_positions, rule=adapter.mask_rule)  # [B, Tq, L]
    if allowed is not None:
        permitted = permitted & allowed
    return attention_probs(q, k, getattr(layer, adapter.attention).scaling, permitted)


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


BiasFn = Callable[[LayerView], torch.Tensor | None]


class AttentionBias(_LayerHooks):
    """Add a per-key bias to the attention logits of chosen layers (SDPA and eager).

    ``bias_fn(view) -> [B, T, W] float or None`` gives the additive bias of one decoder layer
    (:class:`LayerView`: its index, module, inputs and positions) for the call's ``T`` tokens
    over its ``W`` keys, in original positions (``-inf`` blocks a key); it may read the layer's
    own attention (:meth:`LayerView.attention`). The bias is mapped onto the tokens and keys the
    layer holds (a pruned layer holds fewer), the layer's own mask (causal + padding) is rebuilt
    as an additive float mask and the bias added, so the attention becomes
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
            return args, self._biased(view, bias, self.adapter.mask_rule)

        return hook

    @staticmethod
    def _biased(view: LayerView, bias: torch.Tensor, mask_rule: str) -> dict:
        kwargs, hidden = view.kwargs, view.hidden
        batch = hidden.shape[0]
        n_call = view.call.input_ids.shape[1]
        if tuple(bias.shape) != (batch, n_call, view.width):
            raise RuntimeError(
                f"bias has shape {list(bias.shape)}, expected {[batch, n_call, view.width]}"
            )
        bias = view.to_layer(bias.to(hidden.device))  # [B, T_l, L]
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
            allowed = allowed_keys(view.valid, view.rows, view.keys, rule=mask_rule)  # [B, T_l, L]
            base = torch.zeros(batch, 1, *allowed.shape[1:], dtype=dtype, device=hidden.device)
            base = base.masked_fill(~allowed[:, None], low)
        if tuple(base.shape[-2:]) != tuple(bias.shape[-2:]):
            raise RuntimeError(f"layer mask {list(base.shape)} does not match the call")
        bias = bias.to(dtype)[:, None]  # [B, 1, T, L]
        blocked = torch.isneginf(bias)
        out = (base + bias.masked_fill(blocked, 0.0)).clamp(min=low).masked_fill(blocked, low)
        kwargs = dict(kwargs)
        kwargs["attention_mask"] = out
        return kwargs
