"""How one decoder layer sees the current call, in original positions (:class:`LayerView`),
and the attention rows it computes (:func:`layer_attention_rows`; raw logits:
:meth:`LayerView.logits`): what the probes record and the biases write through.

In decode, keys come from the layer's own KV cache plus the new tokens' k. On a pruned model a
layer after a pruning stage holds only the kept tokens; the call tracker knows their original
positions, so a view maps between the layer's tokens and keys and the call's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..model_adapters import ModelAdapter
from .attention import (
    allowed_keys,
    attention_logits,
    attention_probs,
    image_blocks,
    layer_qk,
    layer_window,
)
from .calls import CallState, CallTracker, Prefill, cache_of


def _past_keys(cache: Any, layer_idx: int) -> torch.Tensor | None:
    """The keys a layer holds before this call (``[B, Hkv, L, D]``, after RoPE), or None."""
    if cache is None or int(cache.get_seq_length(layer_idx)) == 0:
        return None
    layers = getattr(cache, "layers", None)
    if layers is None:
        raise ValueError(f"cannot read keys from a cache of type {type(cache).__name__}")
    return layers[layer_idx].keys


@dataclass
class LayerView:
    """One decoder layer's share of the current call, in original positions.

    A layer after a pruning stage holds only the kept prompt tokens: ``rows [B, T]`` are the
    original positions of the tokens it computes in this call, ``keys [B, L]`` those of the keys
    it attends to (its cache, then this call's tokens), ``None`` when it holds every one
    (``0 .. width-1``). ``valid [B, L]`` marks the non-padding keys, ``allowed [B, T, L]`` what
    the layer's own mask lets each row see (``None``: causal + padding), ``past`` its cache.
    A sliding-window layer (``window``) holds only the newest keys of its cache. ``blocks
    [B, width]`` is the image block of each of the call's tokens under a mask rule with image
    blocks (else ``None``).
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
    window: int | None = None
    blocks: torch.Tensor | None = None

    def rule_blocks(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(query_block [B, Tq], key_block [B, L])`` of the rows at original positions
        ``rows`` and of the layer's keys, or ``None`` when the mask rule has no image blocks."""
        if self.blocks is None:
            return None
        return self.blocks.gather(1, rows), self.blocks.gather(1, self.key_positions())

    def rule_mask(self, adapter: ModelAdapter, rows: torch.Tensor) -> torch.Tensor:
        """``[B, Tq, L]`` bool: the keys the rows at original positions ``rows [B, Tq]`` see
        by the model's mask rule, this layer's window and padding."""
        return allowed_keys(
            self.valid,
            rows,
            self.keys,
            rule=adapter.mask_rule,
            window=self.window,
            blocks=self.rule_blocks(rows),
        )

    def key_positions(self) -> torch.Tensor:
        """``[B, L]`` original positions of the layer's keys."""
        if self.keys is not None:
            return self.keys
        return torch.arange(self.valid.shape[1], device=self.valid.device).expand_as(self.valid)

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
        """``[B, T, width]`` (or per head ``[B, H, T, width]``) over the call's tokens and keys
        -> ``[B, T_l, L]`` (``[B, H, T_l, L]``) over this layer's tokens and keys."""
        if self.keys is None:
            return full
        batch, ones = full.shape[0], [1] * (full.dim() - 3)  # a head dim, if any
        rows = (self.rows - self.call.past).view(batch, *ones, -1, 1)
        full = full.gather(-2, rows.expand(*full.shape[:-2], -1, full.shape[-1]))
        keys = self.keys.view(batch, *ones, 1, -1)
        return full.gather(-1, keys.expand(*full.shape[:-1], -1))

    def logits(self, adapter: ModelAdapter, positions: torch.Tensor) -> torch.Tensor:
        """``[B, H, Tq, width]`` float32 raw attention logits ``q k^T * scaling`` (before mask
        and softmax) of the rows at original ``positions`` (tokens of this call) over the call's
        keys, from the layer's own q/k; 0 at keys the layer does not hold."""
        q, k = layer_query_keys(
            adapter, self.layer, self.hidden, self.kwargs, self.local(positions), self.past
        )
        scaling = getattr(self.layer, adapter.attention).scaling
        logits = attention_logits(q, k, scaling)  # [B, Hkv, G, Tq, L]
        return self.to_full(logits.flatten(1, 2))

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
            self.window,
            self.rule_blocks(positions),
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
    window = layer_window(adapter, layer)
    held = n_past + n_new
    if kept is None:
        # a sliding-window layer's cache holds only the newest keys
        if held != width and (window is None or held > width):
            raise RuntimeError(f"layer {index} keys ({held}) and mask ({width}) differ")
        rows = torch.arange(call.past, call.past + n_new, device=device).expand(batch, -1)
        keys = None
        if held != width:
            keys = torch.arange(width - held, width, device=device).expand(batch, -1)
    else:
        kept = kept.to(device)
        if past is None:
            rows = keys = kept
        else:
            later = torch.arange(tracker.prompt_length, width, device=device).expand(batch, -1)
            keys = torch.cat([kept, later], dim=1)
            if window is not None:
                keys = keys[:, max(0, keys.shape[1] - held) :]
            rows = later[:, later.shape[1] - n_new :]
        if keys.shape[1] != held:
            raise RuntimeError(
                f"layer {index} holds {held} keys, the pruning trace {keys.shape[1]}"
            )
    valid = call.valid.to(device)
    if keys is not None:
        valid = valid.gather(1, keys)
    blocks = None
    if adapter.mask_rule != "causal" and tracker.prefill is not None:
        visual = tracker.prefill.visual.to(device)
        blocks = torch.nn.functional.pad(
            image_blocks(visual), (0, width - visual.shape[1]), value=-1
        )
    allowed = _layer_allowed(kwargs.get("attention_mask"), n_new, n_past + n_new)
    return LayerView(
        index,
        layer,
        hidden,
        kwargs,
        call,
        tracker.prefill,
        rows,
        keys,
        valid,
        past,
        allowed,
        window,
        blocks,
    )


def layer_query_keys(
    adapter: ModelAdapter,
    layer: nn.Module,
    hidden: torch.Tensor,
    kwargs: dict,
    local: torch.Tensor,
    past: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q ``[B, H, Tq, D]`` of the rows ``local [B, Tq]`` (indices into this call's ``hidden``)
    and k ``[B, Hkv, L, D]`` of the layer's keys (``past`` cached ones, then this call's), after
    RoPE, from the layer's own norm, projections and RoPE tables."""
    cos, sin = kwargs["position_embeddings"]
    q, k = layer_qk(adapter, layer, hidden, cos, sin, local)  # [B, H, Tq, D], [B, Hkv, T, D]
    if past is not None:
        k = torch.cat([past.to(k.dtype), k], dim=2)  # [B, Hkv, L, D]
    return q, k


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
    window: int | None = None,
    blocks: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Attention probabilities ``[B, H, Tq, L]`` of the query rows ``local [B, Tq]`` (indices
    into this call's ``hidden``; original positions ``rows``) over the layer's ``L`` keys
    (``past`` cached keys, then this call's), from the layer's own norm, projections and RoPE
    tables. ``valid [B, L]`` marks non-padding keys, ``key_positions [B, L]`` their original
    positions (default ``0 .. L-1``), ``allowed [B, Tq, L]`` what the layer's mask permits;
    ``window`` and ``blocks`` (query and key image blocks) complete the model's mask rule
    (:func:`vlm_focus.core.attention.allowed_keys`)."""
    q, k = layer_query_keys(adapter, layer, hidden, kwargs, local, past)
    total = k.shape[2]
    if valid.shape[1] != total:
        raise RuntimeError(f"layer keys ({total}) and attention_mask ({valid.shape[1]}) differ")
    permitted = allowed_keys(
        valid, rows, key_positions, rule=adapter.mask_rule, window=window, blocks=blocks
    )  # [B, Tq, L]
    if allowed is not None:
        permitted = permitted & allowed
    return attention_probs(q, k, getattr(layer, adapter.attention).scaling, permitted)
