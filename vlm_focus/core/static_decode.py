"""Pruning on a static cache (``StaticCache``), whose decode steps ``torch.compile`` can trace.

A static cache keeps its lengths on the device, so no step reads them: the prompt sizes each
pruned layer's buffer to its kept prompt plus the room left for generated tokens
(:meth:`StaticBuffers.fit`), and, when the prompt ends, builds per layer the mask column each
buffer slot reads (:meth:`StaticBuffers.build_columns`); a decode step then only gathers, which
lets ``torch.compile`` trace it as one graph that no step recompiles. Every mask is as wide as
the cache; slots past it read one masked column appended to the mask.

A model with sliding-window layers (Gemma 3) keeps each sliding layer's newest keys in a ring
buffer (``StaticSlidingWindowLayer``) that rolls by buffer slot, and the model sizes its masks
by its first layer of each kind, which may be pruned. So on such a model every pruned sliding
layer gets a plain buffer of its kept prompt and the generated tokens (``StaticLayer``), and
each pruned layer's decode mask is built from the original position of every slot, the window
included (:meth:`StaticBuffers.windowed_decode`).

A hybrid decoder's linear-attention layers hold fixed-size states beside the buffers: they get
no per-slot mask (a decode step's is ``None``, a prompt's their 2-D padding mask), and the model
sizes its masks by its first attention buffer, which may sit after the first stage
(:func:`mask_layer`).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from transformers.cache_utils import StaticLayer

from .attention import allowed_keys, layer_window
from .calls import static_length
from .prune_state import EngineSetup, LayerCall, PruneState
from .slicing import decode_columns, gather_seq, on_device_of, slice_mask

_NEEDS_4D_MASK = (
    "vlm_focus with a static cache needs the 4-D attention mask the model builds for it (use "
    "attn_implementation='sdpa' or 'eager'"
)


def static_columns(held: torch.Tensor, prompt: int, slots: int, width: int) -> torch.Tensor:
    """``[B, slots]``: the column of a ``width``-wide mask that slot ``j`` of a static buffer
    holding ``held`` (``[B, S']`` prompt columns) reads: ``held[j]`` for the prompt, then
    ``prompt + (j - S')`` for the tokens generated after it. Slots past the mask point at
    column ``width``, a masked column :func:`static_mask` appends."""
    tail = torch.arange(prompt, prompt + slots - held.shape[1], device=held.device)
    cols = torch.cat([held, tail.expand(held.shape[0], -1)], dim=1)
    return cols.clamp(max=width)


def static_mask(mask: torch.Tensor, rows: torch.Tensor | None, cols: torch.Tensor) -> torch.Tensor:
    """A 4-D mask over a static buffer: ``mask`` (original or layer-0 columns) with one masked
    column appended, its rows (prefill) and columns gathered to the buffer's slots."""
    blocked = False if mask.dtype == torch.bool else torch.finfo(mask.dtype).min
    pad = mask.new_full((*mask.shape[:-1], 1), blocked)
    return slice_mask(torch.cat([mask, pad], dim=-1), rows, cols)


def mask_layer(cache: Any) -> int:
    """The layer whose buffer sizes the model's full-attention masks and places their query:
    transformers takes the first full-attention layer's, the first with a buffer that is not
    a sliding window (a hybrid decoder's linear layers hold fixed-size states, and a sliding
    layer only its window; layer 0 may be either). On a model with sliding layers, those masks
    are sized by the first layer of each kind; vlm_focus builds every pruned layer's decode
    mask itself there (:meth:`StaticBuffers.windowed_decode`)."""
    for index, layer in enumerate(cache.layers):
        if getattr(layer, "max_cache_len", None) is not None and not getattr(
            layer, "is_sliding", False
        ):
            return index
    return 0


def cache_room(cache: Any) -> int | None:
    """How many tokens a static cache holds: its mask layer's width (``None`` when no layer
    has a buffer)."""
    return getattr(cache.layers[mask_layer(cache)], "max_cache_len", None)


def resize(layer: Any, slots: int) -> None:
    """Give a static cache layer ``slots`` slots; its buffers are allocated again, empty, at
    its next write (the prompt's, on a cache that holds nothing yet)."""
    if layer.max_cache_len != slots:
        layer.max_cache_len = slots
        if layer.is_initialized:
            layer.keys = layer.values = None
            layer.is_initialized = False


def empty(layer: Any) -> None:
    """``layer.reset()``, in inference mode when the layer's tensors were made in it (a cache
    that ``generate()`` built under ``torch.inference_mode()``): only there may they change in
    place, and ``remove()`` may come after that block."""
    made_there = any(isinstance(t, torch.Tensor) and t.is_inference() for t in vars(layer).values())
    with torch.inference_mode(made_there):
        layer.reset()


def check_room(room: int | None, needed: int, prompt: int) -> None:
    """A static cache too short for the tokens of this call raises, saying the size needed
    (the buffers cannot grow)."""
    if room is not None and needed > room:
        raise ValueError(
            f"the static cache holds {room} tokens, and this step needs {needed} (a prompt of "
            f"{prompt} tokens and {needed - prompt} generated): build it with max_cache_len >= "
            "prompt length + max_new_tokens"
        )


class StaticBuffers:
    """The static caches one engine resized, and the masks over their buffers."""

    def __init__(self, setup: EngineSetup) -> None:
        self.setup = setup
        # per resized cache: its width and the sliding layers it lent (index -> layer)
        self._resized: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._planned: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # cache -> sizes
        # the windows of the pruned layers (None: full attention); any window means every
        # pruned layer's decode mask is built here (windowed_decode)
        self.windows = {
            index: layer_window(setup.adapter, setup.layers[index])
            for index in range(setup.first_layer, len(setup.layers))
        }
        self.windowed = any(w is not None for w in self.windows.values())

    def room(self, cache: Any) -> int | None:
        """How many tokens ``cache`` holds (its width before any layer was resized)."""
        held = self._resized.get(cache)
        return held[0] if held is not None else cache_room(cache)

    def plan(self, cache: Any, seq: int, drops: list[int]) -> None:
        """A prompt of ``seq`` tokens that drops ``drops`` per stage starts on ``cache``."""
        self._planned[cache] = (seq, drops)

    def fit(self, cache: Any) -> None:
        """Size each pruned layer's static buffer to what it holds: its kept prompt and the
        tokens generated after it (the room the cache leaves past the prompt). Attention in
        decode then reads only those slots. The mask layer (:func:`mask_layer`) keeps the
        cache's width: the model sizes its masks by it. Linear layers have no buffer to size.
        On a model with sliding-window layers, each pruned sliding layer (layer 0 included)
        trades its ring buffer for a plain one of that size, and the mask layer is sized like
        the others (every pruned layer's decode mask is built here). Called when the first
        pruned layer runs: the decoder has built the prompt's masks from the cache's own sizes
        by then (it sizes them by its first layer of each kind)."""
        if cache not in self._planned:
            return
        seq, drops = self._planned.pop(cache)
        room = self.room(cache)
        if room is None or room < seq:
            return  # too short for the prompt: the prompt's mask check says so
        keep_width = None if self.windowed else mask_layer(cache)
        lent = self._resized.setdefault(cache, (room, {}))[1]
        held, stage = seq, 0
        stages = [layer for layer, _ in self.setup.config.stages]
        for index in range(len(cache.layers)):
            while stage < len(stages) and stages[stage] <= index:
                held -= drops[stage]
                stage += 1
            if index < self.setup.first_layer or index == keep_width:
                continue  # unpruned layers keep the model's own buffers, as does the mask layer
            if index in self.setup.linear_layers or index in self.setup.key_sources:
                continue  # fixed-size states, or another layer's buffer: none to size
            if self.windows.get(index) is not None and index not in lent:
                lent[index] = cache.layers[index]
                cache.layers[index] = StaticLayer(max_cache_len=held + room - seq)
            resize(cache.layers[index], held + room - seq)

    def restore(self) -> None:
        """Give every resized cache's pruned layers their full width back, and its sliding
        layers their ring buffers (emptied: what a pruned layer held is not the model's).
        Linear and KV-shared layers were never resized."""
        unsized = set(self.setup.linear_layers) | set(self.setup.key_sources)
        for cache, (room, lent) in list(self._resized.items()):
            for index, layer in lent.items():
                empty(layer)
                cache.layers[index] = layer
            for index, layer in enumerate(cache.layers):
                if index not in unsized and not getattr(layer, "is_sliding", False):
                    resize(layer, room)
        self._resized = weakref.WeakKeyDictionary()

    def prefill_mask(
        self,
        state: PruneState,
        mask: Any,
        rows: torch.Tensor | None,
        current: torch.Tensor,
        slots: int,
    ) -> torch.Tensor | None:
        """The prefill mask of a layer whose static buffer of ``slots`` holds ``current``: the
        query rows ``rows`` (``None``: the mask's rows are the queries already), and per slot
        the column it reads. Without a mask (SDPA, no padding) the layer's causal attention is
        aligned to its first slot, which matches its kept tokens."""
        if mask is None:
            return None
        if not isinstance(mask, torch.Tensor) or mask.dim() != 4:
            raise ValueError(f"{_NEEDS_4D_MASK}, and pass attention_mask)")
        width = mask.shape[-1]
        if width < state.full_len:
            raise ValueError(
                f"the static cache holds {width} tokens, fewer than this prompt's "
                f"{state.full_len}: build it with max_cache_len >= prompt length + "
                "max_new_tokens"
            )
        cols = static_columns(on_device_of(current, mask), state.full_len, slots, width)
        return static_mask(mask, None if rows is None else on_device_of(rows, mask), cols)

    def build_columns(self, state: PruneState, cache: Any) -> None:
        """At the end of a prompt on a static cache: per hooked attention layer, the mask
        column each slot of its buffer reads in decode; the layers of a stage share one map.

        A decode mask places its query at the mask layer's length (:func:`mask_layer`). When
        that layer is unpruned, its columns are the original prompt's; when it is pruned, the
        first ``S_m`` columns stand for its kept prompt (the token it holds in slot j is column
        j) and the generated tokens follow. Left padding comes first and is never pruned, so
        column j of the 2-D padding mask is as valid as the j-th kept token in either case.
        A model with sliding-window layers keeps, instead, each slot's original position
        (:meth:`_build_keys`)."""
        if self.windowed:
            self._build_keys(state, cache)
            return
        sizer = mask_layer(cache)
        base = state.per_layer.get(sizer) if sizer >= self.setup.first_layer else None
        prompt = state.full_len if base is None else base.shape[1]
        width = cache.layers[sizer].max_cache_len  # every decode mask's
        built: dict[tuple[int, int], torch.Tensor] = {}
        for index in range(self.setup.first_layer, len(self.setup.layers)):
            if index in self.setup.linear_layers or index in self.setup.key_sources:
                continue  # no buffer, or its source's (a decode step reads the source's mask)
            kept = state.per_layer[index]
            key = (id(kept), cache.layers[index].max_cache_len)
            if key not in built:
                held = kept if base is None else torch.searchsorted(base, kept)
                built[key] = static_columns(held, prompt, key[1], width)
            state.static_cols[index] = built[key]

    def _build_keys(self, state: PruneState, cache: Any) -> None:
        """Per pruned layer of a model with sliding windows: the original position of the
        token each buffer slot holds (its kept prompt, then ``S, S + 1, ...``) and whether
        that token is a key at all (not padding), ``[B, slots]`` each."""
        valid = state.valid
        for index in range(self.setup.first_layer, len(self.setup.layers)):
            if index in self.setup.linear_layers or index in self.setup.key_sources:
                continue  # no buffer, or its source's (a decode step reads the source's mask)
            kept = state.per_layer[index]
            slots = cache.layers[index].max_cache_len
            tail = torch.arange(state.full_len, state.full_len + slots - kept.shape[1])
            positions = torch.cat([kept, tail.to(kept.device).expand(kept.shape[0], -1)], 1)
            is_key = torch.cat(
                [
                    valid.gather(1, kept.to(valid.device)),
                    valid.new_ones(kept.shape[0], slots - kept.shape[1]),
                ],
                1,
            )
            state.static_cols[index] = positions
            state.static_keys[index] = (is_key.to(kept.device), kept.shape[1])

    def windowed_decode(self, state: PruneState, call: LayerCall) -> dict:
        """A decode step's mask for a pruned layer of a model with sliding windows, built from
        original positions: the step at position ``q`` sees the slots holding a key at
        position ``p <= q`` (and ``p > q - window`` on a sliding layer). ``q`` comes from the
        layer's own length on the device (its kept prompt and the tokens generated so far),
        so a compiled step reads nothing on the host."""
        index, hidden = call.index, call.hidden
        positions = state.static_cols[index]  # [B, slots] original positions
        is_key, held = state.static_keys[index]
        first = static_length(call.cache, index).to(positions.device) + (state.full_len - held)
        query = first + torch.arange(hidden.shape[1], device=positions.device)
        query = query.expand(positions.shape[0], -1)  # [B, T]
        allowed = allowed_keys(is_key, query, positions, window=self.windows[index])[:, None]
        mask = call.kwargs.get("attention_mask")
        if isinstance(mask, torch.Tensor) and mask.is_floating_point():
            blocked = torch.finfo(mask.dtype).min
            zeros = torch.zeros(allowed.shape, dtype=mask.dtype, device=allowed.device)
            allowed = zeros.masked_fill(~allowed, blocked)
        kwargs = dict(call.kwargs)
        kwargs["attention_mask"] = allowed.to(hidden.device)  # [B, 1, T, slots]
        return kwargs

    def decode_layer(self, state: PruneState, index: int, kwargs: dict) -> dict:
        """A decode step's kwargs for a layer's static buffer: slot ``j`` reads the mask
        column of the token stored there."""
        mask = kwargs.get("attention_mask")
        if not isinstance(mask, torch.Tensor) or mask.dim() != 4:
            raise ValueError(f"{_NEEDS_4D_MASK})")
        cols = on_device_of(state.static_cols[index], mask)
        kwargs = dict(kwargs)
        kwargs["attention_mask"] = state.once(
            "decode_mask", mask, cols, lambda: static_mask(mask, None, cols)
        )
        return kwargs

    @staticmethod
    def decoder_inputs(state: PruneState, kwargs: dict) -> dict:
        """A decode step at K = 0: layer 0's buffer holds its kept prompt, so the decoder's
        2-D mask is sliced to it before the decoder builds its masks. (A dynamic cache reports
        original lengths, so its masks are built full width and sliced per layer.)"""
        mask = kwargs.get("attention_mask")
        kept = state.per_layer[0]
        # host counts, no read: layer 0 dropped tokens when it holds fewer than the prompt
        if isinstance(mask, torch.Tensor) and mask.dim() == 2 and kept.shape[1] != state.full_len:
            kwargs = dict(kwargs)
            kwargs["attention_mask"] = gather_seq(
                mask, decode_columns(kept, state.full_len, mask.shape[1]), 1
            )
        return kwargs
