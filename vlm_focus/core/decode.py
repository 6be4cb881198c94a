"""Decode steps on a pruned prompt's cache.

A layer ``>= K`` holds a shorter cache than the sequence it stands for, so a materialised mask
(``S + t`` wide) is column-sliced to ``kept ++ [S, S + t)``. A dynamic cache reports original
lengths (:mod:`vlm_focus.core.cache_lengths`), so the decoder places each step itself; a step
that the decoder would place wrongly (compact positions, or a static layer 0 at ``K = 0``) gets
its ``position_ids`` here. A static cache's masks are built per buffer slot instead
(:mod:`vlm_focus.core.static_decode`). Under a decode-time pruner each step reads only the
visual columns its focal layer picks (:mod:`vlm_focus.core.fixation`).
"""

from __future__ import annotations

from typing import Any

import torch

from .attention import allowed_keys, layer_window
from .cache_lengths import held_length
from .calls import CACHE_KEYS, CallState, cache_length, static_length
from .fixation import FixedView
from .prune_state import EngineSetup, LayerCall, PruneState
from .slicing import decode_columns, mask_keys, on_device_of, slice_mask
from .static_decode import StaticBuffers, check_room


class Decode:
    """The hooks' work in a decode step: the step's inputs, then each layer's mask and keys."""

    def __init__(self, setup: EngineSetup, static: StaticBuffers) -> None:
        self.setup = setup
        self.static = static

    def begin_step(self, state: PruneState, call: CallState, cache: Any, kwargs: dict) -> dict:
        """A decode step on the cache this prefill filled. On a static cache nothing here reads
        a length from the device, so a compiled step stays one graph."""
        if state.static and not call.compiled:
            room = self.static.room(cache)
            check_room(room, call.past + call.input_ids.shape[1], state.full_len)
        state.prefilling = False
        state.memo.clear()  # slices of the last call only
        state.step_masks.clear()
        state.prompt.inputs = {}  # pixel inputs served the prefill's stages; let them go
        if state.fixation is not None:
            # which cached keys are padding (a 2-D mask, whatever mask the call has; a static
            # cache's step uses the prompt's own, mapped once when the prompt ended)
            state.fixation.begin_step(None if state.static else call.valid)
        compact = self.setup.config.positions == "compact"
        # A dynamic cache reports original lengths (cache_lengths), so the decoder places a
        # step itself; a static layer 0 at K = 0 counts only its kept prompt.
        if kwargs.get("position_ids") is None and (
            compact or (state.static and self.setup.first_layer == 0)
        ):
            if call.compiled:
                raise ValueError(
                    "vlm_focus with layer=0 under torch.compile needs the decode step's "
                    "position_ids (generate() passes them)"
                )
            kwargs = self._fill_positions(state, kwargs, call.input_ids, cache)
        if compact:
            # Compact positions count on from the pruned prompt: the original ones minus what
            # every row dropped.
            position_ids = kwargs["position_ids"]
            kwargs = dict(kwargs)
            kwargs["position_ids"] = position_ids - on_device_of(state.dropped, position_ids)
        return kwargs

    def _fill_positions(
        self, state: PruneState, kwargs: dict, input_ids: torch.Tensor, cache: Any
    ) -> dict:
        """A decode step's original positions (full prompt + step), for a step without
        ``position_ids`` that the decoder would place wrongly: on a static cache at K = 0
        (layer 0 counts its kept prompt) or with compact positions (renumbered from them)."""
        batch, n_new = input_ids.shape
        width = cache_length(cache) + n_new  # a dynamic cache reports original lengths
        if state.static and self.setup.first_layer == 0:
            width += state.full_len - state.per_layer[0].shape[1]
        text = torch.arange(width - n_new, width, device=input_ids.device).expand(batch, -1)
        kwargs = dict(kwargs)
        kwargs["position_ids"] = self.setup.adapter.decode_positions(
            self.setup.model, text, kwargs.get("attention_mask")
        )
        return kwargs

    def layer(self, state: PruneState, call: LayerCall) -> dict:
        """The kwargs of a hooked layer's call in a decode step."""
        source = self.setup.key_sources.get(call.index)
        if source is not None:  # it attends to its source's keys: the source's mask
            if source not in state.step_masks:
                raise RuntimeError(
                    f"layer {call.index} reuses layer {source}'s keys, which ran unhooked"
                )
            return {**call.kwargs, "attention_mask": state.step_masks[source]}
        if state.fixation is not None:
            kwargs = self._fixated(state, call)
        else:
            kwargs = self._masked(state, call)
        state.step_masks[call.index] = kwargs.get("attention_mask")
        return kwargs

    def _masked(self, state: PruneState, call: LayerCall) -> dict:
        """The step's mask as the layer holds its keys: per buffer slot on a static cache,
        else column-sliced, with this layer's masked prompt keys kept masked."""
        if state.static and call.index in self.setup.linear_layers:
            return call.kwargs  # its step mask is None, or the new tokens' own: nothing to map
        if state.static and self.static.windowed:
            return self.static.windowed_decode(state, call)
        if state.static:
            return self.static.decode_layer(state, call.index, call.kwargs)
        window = layer_window(self.setup.adapter, call.module)
        if window is not None:
            return self._windowed(state, call, window)
        masked = state.masked_at.get(call.index)
        hidden = call.hidden
        if masked is not None:  # this layer's masked prompt keys stay masked at every step
            kwargs = dict(self._sliced(state, call))
            mask = kwargs.get("attention_mask")
            width = held_length(call.cache, call.index) + hidden.shape[1]
            kwargs["attention_mask"] = state.once(
                "decode_masked",
                mask,
                masked,
                lambda: mask_keys(mask, masked, hidden.shape[1], width),
            )
            return kwargs
        return self._sliced(state, call)

    @staticmethod
    def _windowed(state: PruneState, call: LayerCall, window: int) -> dict:
        """A decode step's mask on a sliding-window layer, built from original positions.

        Its cache keeps only its newest ``window - 1`` keys, and after pruning those reach
        further back in original positions than the window does; the model's mask, sized by
        another layer's cache, cannot tell which of them to hide. So the mask is built here:
        the step sees the held keys that are valid, not masked for its row, and within
        ``window`` positions of it (:func:`vlm_focus.core.attention.allowed_keys`)."""
        index, kwargs, hidden = call.index, call.kwargs, call.hidden
        n_new = hidden.shape[1]
        layer = call.cache.layers[index]
        held = (layer.keys.shape[-2] if layer.is_initialized else 0) + n_new
        width = cache_length(call.cache, index) + n_new  # reported in original positions
        kept = state.per_layer[index]
        key_pos = decode_columns(kept, state.full_len, width)[:, -held:]  # [B, held]
        prompt = state.valid.to(kept.device)
        valid = torch.ones(key_pos.shape, dtype=torch.bool, device=kept.device)
        in_prompt = key_pos < state.full_len
        valid &= ~in_prompt | prompt.gather(1, key_pos.clamp(max=state.full_len - 1))
        masked = state.masked_at.get(index)
        if masked is not None:  # this layer's masked prompt keys stay masked at every step
            full = torch.cat([masked, masked.new_zeros(masked.shape[0], width - state.full_len)], 1)
            valid &= ~full.to(kept.device)[:, -held:]
        query_pos = torch.arange(width - n_new, width, device=kept.device).expand(
            key_pos.shape[0], -1
        )
        allowed = allowed_keys(valid, query_pos, key_pos, window=window)[:, None]  # [B,1,T,L]
        mask = kwargs.get("attention_mask")
        if isinstance(mask, torch.Tensor) and mask.is_floating_point():
            low = torch.finfo(mask.dtype).min
            allowed = torch.zeros(
                allowed.shape, dtype=mask.dtype, device=allowed.device
            ).masked_fill(~allowed, low)
        kwargs = dict(kwargs)
        kwargs["attention_mask"] = allowed.to(hidden.device)
        return kwargs

    @staticmethod
    def _sliced(state: PruneState, call: LayerCall) -> dict:
        """A decode step's mask, column-sliced to the keys the layer holds."""
        index, kwargs = call.index, call.kwargs
        mask = kwargs.get("attention_mask")
        if not isinstance(mask, torch.Tensor):
            return kwargs  # no mask: every cached key is attendable, nothing to slice
        width, n_new = mask.shape[-1], call.hidden.shape[1]
        own = held_length(call.cache, index)
        if width == own + n_new or (mask.dim() == 2 and width == n_new):
            return kwargs  # as wide as the layer holds, or a recurrent layer's new tokens only
        kept_cols = state.per_layer[index]
        prompt = state.full_len
        if width - prompt != own - kept_cols.shape[1] + n_new:
            raise RuntimeError(f"layer {index}: decode mask width {width} matches no cache length")
        kwargs = dict(kwargs)
        kwargs["attention_mask"] = state.once(
            "decode_mask",
            mask,
            kept_cols,
            lambda: slice_mask(
                mask, None, decode_columns(on_device_of(kept_cols, mask), prompt, width)
            ),
        )
        return kwargs

    def _fixated(self, state: PruneState, call: LayerCall) -> dict:
        """A decode step under fixation: the focal layer (the first hooked one) picks the
        step's visual columns; every hooked layer reads only those (plus all text) from the
        cache. Chunks of several new tokens (a follow-up turn) attend to everything."""
        fixation = state.fixation
        if call.hidden.shape[1] != 1:
            return call.kwargs
        if fixation.columns is None:
            cache, index = call.cache, call.index
            keys = cache.layers[index].keys  # [B, Hkv, L, D], before this step's token
            if state.static:  # the whole buffer, its first `length` slots written
                length = static_length(cache, index)
                fixation.fixate_static(call.module, call.hidden, call.kwargs, keys, length)
            else:
                fixation.fixate(call.module, call.hidden, call.kwargs, keys)
        columns = fixation.columns
        mask = self._masked(state, call).get("attention_mask")
        kwargs = dict(call.kwargs)
        for key in CACHE_KEYS:
            if kwargs.get(key) is not None:
                kwargs[key] = FixedView(kwargs[key], columns)
        if isinstance(mask, torch.Tensor):  # the layer's own columns, then the step's
            kwargs["attention_mask"] = state.once(
                "fixed_mask",
                mask,
                columns,
                lambda: slice_mask(mask, None, on_device_of(columns, mask)),
            )
        return kwargs
