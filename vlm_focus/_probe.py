"""Attention probes: read (and bias) a decoder's attention rows through instance hooks.

Nothing here needs ``output_attentions`` or an eager model. At a probed layer a forward pre-hook
recomputes, from the layer's own ``input_layernorm``, ``q_proj``, ``k_proj`` and the RoPE tables
the decoder hands it (``position_embeddings``), the query rows it was asked for and every key::

    P[b, h, t, s] = softmax_s( q[b, h, t] . k[b, h, s] * scaling  +  mask[b, t, s] )

with the layer's mask semantics (causal: key ``s <= `` the query's position; padding: keys whose
2-D ``attention_mask`` is 0 are excluded). In decode, keys come from the layer's own KV cache plus
the new token's k, so generated tokens are probed with the cache they really attend to. At most a
``[B, H, Tq, S]`` slab per layer is ever materialised.

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

from ._encoder_inputs import EncoderInputs
from .model_adapters import ImageLayout, ModelAdapter, get_adapter
from .pruners.base import apply_rope

_CACHE_KEYS = ("cache", "past_key_values")


def _cache_of(kwargs: dict[str, Any]) -> Any:
    for key in _CACHE_KEYS:
        if kwargs.get(key) is not None:
            return kwargs[key]
    return None


def _past_keys(cache: Any, layer_idx: int) -> torch.Tensor | None:
    """The keys a layer holds before this call (``[B, Hkv, L, D]``, after RoPE), or None."""
    if cache is None or int(cache.get_seq_length(layer_idx)) == 0:
        return None
    layers = getattr(cache, "layers", None)
    if layers is None:
        raise ValueError(f"cannot read keys from a cache of type {type(cache).__name__}")
    return layers[layer_idx].keys


def attention_probs(
    q: torch.Tensor, k: torch.Tensor, scaling: float, allowed: torch.Tensor
) -> torch.Tensor:
    """``softmax(q k^T * scaling)`` over allowed keys: q ``[B, H, Tq, D]``, k ``[B, Hkv, S, D]``
    (GQA kv heads are shared), allowed ``[B, Tq, S]`` bool -> ``[B, H, Tq, S]`` float32."""
    groups = q.shape[1] // k.shape[1]
    keys = k.repeat_interleave(groups, dim=1) if groups > 1 else k  # [B, H, S, D]
    logits = torch.matmul(q.float(), keys.float().transpose(-1, -2)) * scaling  # [B, H, Tq, S]
    logits = logits.masked_fill(~allowed[:, None], float("-inf"))
    return torch.softmax(logits, dim=-1).nan_to_num(0.0)


@dataclass
class CallState:
    """What the top model saw in one forward call (prefill or one decode step)."""

    input_ids: torch.Tensor  # [B, T] the new tokens of this call
    valid: torch.Tensor  # [B, past + T] bool, keys that are not padding
    past: int  # cached length before the call
    inputs: dict[str, Any]


@dataclass
class Prefill:
    """The prompt of the current generation: ids, padding, visual tokens, layout inputs."""

    input_ids: torch.Tensor  # [B, S]
    valid: torch.Tensor  # [B, S] bool
    visual: torch.Tensor  # [B, S] bool
    inputs: dict[str, Any]
    _layout: list[list[ImageLayout]] | None = None

    def layout(self, model: nn.Module, adapter: ModelAdapter) -> list[list[ImageLayout]]:
        if self._layout is None:
            self._layout = adapter.layout(model, self.input_ids, self.inputs)
        return self._layout

    def text_after_image(self) -> torch.Tensor:
        """``[B, S]`` bool: valid tokens after each row's last visual token (the instruction)."""
        batch, seq = self.visual.shape
        index = torch.arange(seq, device=self.visual.device).expand(batch, seq)
        last = torch.where(self.visual, index, -1).amax(dim=1, keepdim=True)
        return self.valid & (index > last) & (last >= 0)


@dataclass
class Rows:
    """Attention rows recorded at one layer in one call.

    ``probs [B, H, Tq, L]`` over every key of the call (prompt + cache + new), ``positions
    [B, Tq]`` the query rows' absolute positions, ``mask [B, Tq]`` False on filler rows.
    """

    layer: int
    probs: torch.Tensor
    positions: torch.Tensor
    mask: torch.Tensor
    step: int


class _Tracker:
    """Top-model pre-hook: the current call's ids / padding, and the prefill's visual tokens."""

    def __init__(self, model: nn.Module, adapter: ModelAdapter) -> None:
        self.model = model
        self.adapter = adapter
        self.call: CallState | None = None
        self.prefill: Prefill | None = None
        self.step = -1
        self._encoder = EncoderInputs(model, adapter)
        self._hook = model.register_forward_pre_hook(self._on_model, with_kwargs=True)

    def close(self) -> None:
        self._hook.remove()
        self._encoder.close()

    def _on_model(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        if input_ids is None:
            raise ValueError("attention probes need input_ids (not inputs_embeds)")
        cache = _cache_of(kwargs)
        past = 0 if cache is None else int(cache.get_seq_length(0))
        mask = kwargs.get("attention_mask")
        if mask is not None and (not isinstance(mask, torch.Tensor) or mask.dim() != 2):
            raise ValueError("attention probes need a 2-D attention_mask [batch, seq] (or none)")
        batch, new = input_ids.shape
        if mask is None:
            valid = torch.ones(batch, past + new, dtype=torch.bool, device=input_ids.device)
        else:
            valid = mask.bool()
            if valid.shape[1] != past + new:
                raise ValueError(
                    f"attention_mask covers {valid.shape[1]} tokens, the call has {past + new}"
                )
        self.call = CallState(input_ids, valid, past, kwargs)
        self.step = self.step + 1 if past > 0 else 0
        if past == 0:
            recorded = self._encoder.take()
            inputs = {**recorded, **{k: v for k, v in kwargs.items() if v is not None}}
            self.prefill = Prefill(
                input_ids=input_ids,
                valid=valid,
                visual=self.adapter.visual_mask(self.model, input_ids) & valid,
                inputs=inputs,
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
    """``[B, S]`` bool -> ragged rows padded to the longest: (positions, valid) ``[B, Tq]``."""
    counts = mask.sum(1)
    width = max(int(counts.max()), 1) if mask.shape[0] else 1
    order = torch.sort(mask.int(), dim=1, descending=True, stable=True).indices[:, :width]
    valid = torch.arange(width, device=mask.device)[None] < counts[:, None]
    positions = torch.where(valid, order, mask.shape[1] - 1)
    return positions, valid


class AttentionProbe:
    """Record attention probabilities of chosen query rows at chosen decoder layers.

    Use as a context manager around ``model(...)`` or ``model.generate(...)``::

        with AttentionProbe(model, layers=[0, 1], rows="text") as probe:
            model(**inputs)
        probe.records  # list of Rows, one per (layer, call)

    Args:
        model: a supported VLM (``*ForConditionalGeneration``).
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
        self.model = model
        self.adapter = get_adapter(model)
        self.decoder_layers = self.adapter.decoder_layers(model)
        n_layers = len(self.decoder_layers)
        self.layers = list(range(n_layers)) if layers is None else check_layers(layers, n_layers)
        self.rows = rows
        self.decode = decode
        self.on_rows = on_rows
        self.keep = keep
        self.records: list[Rows] = []
        self.tracker: _Tracker | None = None
        self._hooks: list[Any] = []
        self._rows_cache: tuple[Any, torch.Tensor, torch.Tensor] | None = None

    # --- lifecycle --------------------------------------------------------------------------
    def __enter__(self) -> AttentionProbe:
        self.attach()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.remove()

    def attach(self) -> None:
        if self.tracker is not None:
            return
        self.tracker = _Tracker(self.model, self.adapter)
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
            self.tracker.close()
            self.tracker = None

    @property
    def prefill(self) -> Prefill | None:
        return None if self.tracker is None else self.tracker.prefill

    # --- the hook ---------------------------------------------------------------------------
    def _hook(self, index: int) -> Callable:
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            tracker = self.tracker
            call = tracker.call if tracker is not None else None
            if call is None:
                return
            hidden = args[0] if args else kwargs["hidden_states"]
            _check_unpruned(hidden, call, index)
            attn = getattr(module, self.adapter.attention)
            past = _past_keys(_cache_of(kwargs), attn.layer_idx)
            n_past = 0 if past is None else past.shape[2]
            if n_past == 0:
                if self.rows is None:
                    return
                rows, row_mask = self._prefill_rows(tracker.prefill)
                local = rows
            elif self.decode:
                batch, new = hidden.shape[:2]
                local = torch.arange(new, device=hidden.device).expand(batch, new)
                rows = local + n_past
                row_mask = torch.ones_like(rows, dtype=torch.bool)
            else:
                return
            with torch.no_grad():
                probs = layer_attention_rows(
                    self.adapter, module, hidden, kwargs, local, rows, past, call.valid
                )
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
) -> torch.Tensor:
    """Attention probabilities ``[B, H, Tq, L]`` of the query rows ``local [B, Tq]`` (indices into
    this call's ``hidden``; absolute positions ``rows``) over the layer's keys (``past`` cached
    keys, then this call's), from the layer's own norm, projections and RoPE tables."""
    attn = getattr(layer, adapter.attention)
    norm = getattr(layer, adapter.input_norm)
    cos, sin = kwargs["position_embeddings"]
    batch, _, width = hidden.shape
    cos = cos.expand(batch, -1, -1)
    sin = sin.expand(batch, -1, -1)
    normed = norm(hidden)  # [B, T, D]
    q_in = normed.gather(1, local[..., None].expand(-1, -1, width))  # [B, Tq, D]
    q, k = adapter.project_qk(attn, q_in, normed)
    index = local[..., None].expand(-1, -1, cos.shape[-1])
    q = apply_rope(q, cos.gather(1, index), sin.gather(1, index))  # [B, H, Tq, D]
    k = apply_rope(k, cos, sin)  # [B, Hkv, T, D]
    if past is not None:
        k = torch.cat([past.to(k.dtype), k], dim=2)  # [B, Hkv, L, D]
    total = k.shape[2]
    if valid.shape[1] != total:
        raise RuntimeError(f"layer keys ({total}) and attention_mask ({valid.shape[1]}) differ")
    keys = torch.arange(total, device=hidden.device)
    allowed = valid[:, None, :] & (keys[None, None, :] <= rows[:, :, None])  # [B, Tq, L]
    return attention_probs(q, k, attn.scaling, allowed)


def _check_unpruned(hidden: torch.Tensor, call: CallState, index: int) -> None:
    if hidden.shape[1] != call.input_ids.shape[1]:
        raise ValueError(
            f"decoder layer {index} sees {hidden.shape[1]} tokens but the call has "
            f"{call.input_ids.shape[1]}: attention probes and biases need the unpruned sequence "
            "(remove the pruning handle, or probe layers before its first stage)"
        )


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


class AttentionBias:
    """Add a per-key bias to the attention logits of chosen layers (SDPA and eager).

    ``bias_fn(index, layer, hidden, kwargs, prefill, call) -> [B, T, L] float or None`` gives
    the additive bias of decoder layer ``index`` for the call's ``T`` query rows over its ``L``
    keys (``-inf`` blocks a key); it may read the layer's own q/k (:func:`layer_attention_rows`).
    The layer's own mask (causal + padding) is rebuilt as an additive float mask and the bias
    added, so the model's attention becomes ``softmax(q k^T * scaling + mask + bias)``.
    """

    def __init__(
        self,
        model: nn.Module,
        layers: Sequence[int],
        bias_fn: Callable[..., torch.Tensor | None],
    ) -> None:
        implementation = getattr(model.config, "_attn_implementation", None) or "eager"
        if implementation not in ("eager", "sdpa"):
            raise ValueError(
                f"attention biasing needs attn_implementation 'sdpa' or 'eager', got "
                f"{implementation!r} (flash attention takes no additive mask)"
            )
        self.model = model
        self.adapter = get_adapter(model)
        self.decoder_layers = self.adapter.decoder_layers(model)
        self.layers = check_layers(layers, len(self.decoder_layers))
        self.bias_fn = bias_fn
        self.tracker: _Tracker | None = None
        self._hooks: list[Any] = []

    def __enter__(self) -> AttentionBias:
        self.attach()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.remove()

    def attach(self) -> None:
        if self.tracker is not None:
            return
        self.tracker = _Tracker(self.model, self.adapter)
        for index in self.layers:
            layer = self.decoder_layers[index]
            self._hooks.append(layer.register_forward_pre_hook(self._hook(index), with_kwargs=True))

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        if self.tracker is not None:
            self.tracker.close()
            self.tracker = None

    def _hook(self, index: int) -> Callable:
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
            tracker = self.tracker
            if tracker is None or tracker.call is None or tracker.prefill is None:
                return None
            hidden = args[0] if args else kwargs["hidden_states"]
            _check_unpruned(hidden, tracker.call, index)
            with torch.no_grad():
                bias = self.bias_fn(index, module, hidden, kwargs, tracker.prefill, tracker.call)
            if bias is None:
                return None
            return args, self._biased(kwargs, hidden, bias, tracker.call)

        return hook

    def _biased(
        self, kwargs: dict, hidden: torch.Tensor, bias: torch.Tensor, call: CallState
    ) -> dict:
        batch, new = hidden.shape[:2]
        total = call.valid.shape[1]
        if tuple(bias.shape) != (batch, new, total):
            raise RuntimeError(f"bias has shape {list(bias.shape)}, expected {[batch, new, total]}")
        dtype = hidden.dtype if hidden.is_floating_point() else torch.float32
        low = torch.finfo(dtype).min
        mask = kwargs.get("attention_mask")
        if mask is None:
            keys = torch.arange(total, device=hidden.device)
            rows = torch.arange(call.past, call.past + new, device=hidden.device)
            allowed = call.valid[:, None, :] & (keys[None, None, :] <= rows[None, :, None])
            base = torch.zeros(batch, 1, new, total, dtype=dtype, device=hidden.device)
            base = base.masked_fill(~allowed[:, None], low)
        elif mask.dtype == torch.bool:
            base = torch.zeros(mask.shape, dtype=dtype, device=hidden.device)
            base = base.masked_fill(~mask, low).expand(batch, -1, -1, -1)
        else:
            base = mask.to(dtype).expand(batch, -1, -1, -1)
        if base.shape[-1] != total or base.shape[-2] != new:
            raise RuntimeError(f"layer mask {list(base.shape)} does not match the call")
        bias = bias.to(dtype)[:, None]  # [B, 1, T, L]
        blocked = torch.isneginf(bias)
        out = (base + bias.masked_fill(blocked, 0.0)).clamp(min=low).masked_fill(blocked, low)
        kwargs = dict(kwargs)
        kwargs["attention_mask"] = out
        return kwargs
