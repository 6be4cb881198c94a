"""Instance hooks that prune visual tokens inside an unmodified HF decoder.

The decoder computes RoPE ``(cos, sin)``, the mask and ``position_ids`` once at full length and
hands the same objects to every layer. So:

* a pre-hook on the top model reads ``input_ids`` and the image inputs of each prefill and lays
  out the visual tokens (via the model adapter);
* a pre-hook on every layer ``>= K`` slices ``hidden_states`` (only at a stage layer), cos/sin,
  the 4-D (or 2-D) mask and ``position_ids`` down to the tokens it keeps. Kept tokens keep their
  ORIGINAL positions, so RoPE sees exactly what the unpruned model would; with
  ``positions="compact"`` (one stage at layer 0, 1-D RoPE) they are renumbered as the prompt
  without its pruned tokens would be, and decode positions count on from that prompt;
* in decode, each layer's own cache length tells prefill from decode; a layer ``>= K`` holds a
  shorter cache, so a materialised mask (``S + t`` wide) is column-sliced to
  ``kept ++ [S, S + t)``. With ``K = 0`` every cache is short, so the decoder's 2-D mask is
  sliced before it builds its masks, and missing decode positions are filled from the full mask.

A static cache (``StaticCache``) keeps its lengths on the device, so no step reads them: the
prompt sizes each pruned layer's buffer to its kept prompt plus the room left for generated
tokens and builds, per layer, the mask column each buffer slot reads; a decode step then only
gathers, which lets ``torch.compile`` trace it as one graph that no step recompiles.

Batches: every row drops the same number of visual tokens (the smallest number any row asks to
drop), so all rows keep one common length and no row keeps fewer tokens than ``keep`` asks.

On a GPU the hot path never waits for the device: a call brings images when it carries image
inputs (never judged from token ids), counts come from the host, the kept set is chosen on the
device, slices are built once per stage (or decode step) on the device of the tensor sliced,
each stage scores on its layer's execution device (``device_map`` splits), and the trace is
read back only when it is read. Adapters may add hooks for decoder inputs laid out on the full
sequence (Qwen3-VL's DeepStack), fed with the original positions each layer outputs.
"""

from __future__ import annotations

import functools
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..config import FocusConfig, keep_count
from ..kernels import warm_up
from ..model_adapters import ImageLayout, ModelAdapter
from ..trace import FocusTrace, StageTrace
from .cache_lengths import held_length, report_original_length
from .calls import (
    CACHE_KEYS,
    CallTracker,
    cache_length,
    cache_of,
    is_static,
    static_length,
)
from .fixation import FixedView, StepFixation
from .pruner import Pruner, StageContext
from .selection import frame_shares, keep_mask, kept_columns, lowest_visual, selected_keep


@dataclass
class _Prefill:
    """State of one pruned prefill and the decode steps that follow it."""

    layout: list[list[ImageLayout]]
    visual: torch.Tensor  # [B, S] bool, original
    valid: torch.Tensor  # [B, S] bool, original
    full_len: int
    drops: list[int]  # visual tokens every row drops at each stage
    # per stage, per row: visual tokens it keeps in its slots but masks as keys, so that each
    # row keeps its own share while the batch keeps one length (host; all 0 without this rule)
    extras: list[list[int]]
    visual_counts: list[list[int]]  # per stage, per row: visual tokens before it (host)
    inputs: dict[str, Any]
    trace: FocusTrace
    current: torch.Tensor  # [B, S'] original positions still present
    per_layer: dict[int, torch.Tensor] = field(default_factory=dict)
    # Per layer: which prefill columns of the decode mask it keeps. The decode mask spans the
    # full prompt, or layer 0's kept prompt when K = 0 (the decoder hook sliced it already).
    decode_cols: dict[int, torch.Tensor] = field(default_factory=dict)
    cache: Any = None  # weakref to the cache this prefill filled
    frames: torch.Tensor | None = None  # [B, S] image / frame id (budget="frame")
    memo: dict = field(default_factory=dict)  # slices reused across the layers of a stage
    fixation: StepFixation | None = None  # decode-time selection (pruner="fixation")
    # A static cache: every layer writes at its own length into a buffer as wide as the cache,
    # and every mask is that wide. Per layer, the mask column each buffer slot reads in decode
    # (built once, at the end of the prompt: a compiled step then only gathers).
    static: bool = False
    static_cols: dict[int, torch.Tensor] = field(default_factory=dict)
    prefilling: bool = True  # the prompt's own call (False from the first decode step on)
    # per stage layer, the local indices its stage kept (a recomputed layer, e.g. under
    # gradient checkpointing, slices the same tokens again instead of scoring twice)
    stage_rows: dict[int, torch.Tensor] = field(default_factory=dict)
    # labels: the next-token target of every original position ([B, S]) and the loss kwargs;
    # the loss is taken over the positions the last layer holds (see FocusEngine._after_model)
    targets: torch.Tensor | None = None
    masked: torch.Tensor | None = None  # [B, S] original positions masked as keys (extras)
    masked_at: dict[int, torch.Tensor] = field(default_factory=dict)  # per layer, [B, S'] local
    loss_kwargs: dict = field(default_factory=dict)
    # positions="compact": the visual tokens every row dropped, on the device (a tensor, so a
    # compiled decode step does not specialise on the count)
    dropped: torch.Tensor | None = None


def _gather_seq(
    x: torch.Tensor, index: torch.Tensor, dim: int, batch_dim: int | None = None
) -> torch.Tensor:
    """Pick ``index [B, T]`` along sequence dim ``dim`` of ``x``; the batch dim is ``batch_dim``
    (default ``dim - 1``) and a batch of 1 is broadcast first."""
    dim = dim % x.dim()
    batch_dim = dim - 1 if batch_dim is None else batch_dim
    batch = index.shape[0]
    shape = list(x.shape)
    shape[batch_dim] = batch
    x = x.expand(shape)
    view = [1] * x.dim()
    view[batch_dim], view[dim] = batch, index.shape[1]
    full = list(x.shape)
    full[dim] = index.shape[1]
    return x.gather(dim, index.view(view).expand(full))


def _execution_device(module: nn.Module, default: torch.device) -> torch.device:
    """Where ``module`` computes: accelerate's execution device when it dispatched the model
    (weights may be offloaded), else the device of its first parameter."""
    device = getattr(getattr(module, "_hf_hook", None), "execution_device", None)
    if device is not None:
        return torch.device(device)
    param = next(module.parameters(), None)
    return param.device if param is not None else default


def _on(index: torch.Tensor, x: Any) -> torch.Tensor:
    """``index`` on the device of ``x`` (a layer's inputs follow the layer under a device map)."""
    return index.to(x.device) if isinstance(x, torch.Tensor) else index


def _slice_mask(mask: Any, rows: torch.Tensor | None, cols: torch.Tensor) -> Any:
    """Slice a 4-D ``[B, H, Sq, Sk]`` or 2-D ``[B, Sk]`` mask; other mask kinds are rejected."""
    if mask is None:
        return None
    if not isinstance(mask, torch.Tensor):
        raise ValueError(
            f"vlm_focus cannot slice an attention mask of type {type(mask).__name__}; "
            "use attn_implementation='sdpa', 'eager' or 'flash_attention_2'"
        )
    if mask.dim() == 4:
        if rows is not None:
            mask = _gather_seq(mask, rows, 2, batch_dim=0)
        return _gather_seq(mask, cols, 3, batch_dim=0)
    if mask.dim() == 2:
        return _gather_seq(mask, cols, 1)
    raise ValueError(f"unexpected attention mask with shape {list(mask.shape)}")


def _mask_keys(mask: Any, masked: torch.Tensor, n_queries: int, width: int) -> torch.Tensor:
    """``mask`` (4-D ``[B, 1, q, width]``, additive or bool, or ``None`` for plain causal
    attention) with the prompt keys ``masked [B, S']`` (its first ``S'`` columns) masked out."""
    batch, held = masked.shape
    cols = torch.zeros(batch, width, dtype=torch.bool, device=masked.device)
    cols[:, :held] = masked
    cols = cols[:, None, None, :]
    if mask is None:  # causal: query j (the last n_queries of width keys) sees keys <= itself
        keys = torch.arange(width, device=masked.device)
        queries = torch.arange(width - n_queries, width, device=masked.device)
        return (keys[None, :] <= queries[:, None])[None, None] & ~cols
    if not isinstance(mask, torch.Tensor) or mask.dim() != 4:
        raise ValueError(
            "vlm_focus: a batch whose rows keep different shares masks keys, which needs a 4-D "
            f"attention mask or none, got {type(mask).__name__}"
        )
    cols = cols.to(mask.device)
    if mask.dtype == torch.bool:
        return mask & ~cols
    return mask.masked_fill(cols, torch.finfo(mask.dtype).min)


def _decode_columns(kept: torch.Tensor, full_len: int, width: int) -> torch.Tensor:
    """Columns of a full-width decode mask that a layer holding ``kept`` still has."""
    tail = torch.arange(full_len, width, device=kept.device).expand(kept.shape[0], -1)
    return torch.cat([kept, tail], dim=1)


def _static_columns(held: torch.Tensor, prompt: int, slots: int, width: int) -> torch.Tensor:
    """``[B, slots]``: the column of a ``width``-wide mask that slot ``j`` of a static buffer
    holding ``held`` (``[B, S']`` prompt columns) reads: ``held[j]`` for the prompt, then
    ``prompt + (j - S')`` for the tokens generated after it. Slots past the mask point at
    column ``width``, a masked column :func:`_static_mask` appends."""
    tail = torch.arange(prompt, prompt + slots - held.shape[1], device=held.device)
    cols = torch.cat([held, tail.expand(held.shape[0], -1)], dim=1)
    return cols.clamp(max=width)


def _static_mask(mask: torch.Tensor, rows: torch.Tensor | None, cols: torch.Tensor) -> torch.Tensor:
    """A 4-D mask over a static buffer: ``mask`` (original or layer-0 columns) with one masked
    column appended, its rows (prefill) and columns gathered to the buffer's slots."""
    blocked = False if mask.dtype == torch.bool else torch.finfo(mask.dtype).min
    pad = mask.new_full((*mask.shape[:-1], 1), blocked)
    return _slice_mask(torch.cat([mask, pad], dim=-1), rows, cols)


def _resize(layer: Any, slots: int) -> None:
    """Give a static cache layer ``slots`` slots; its buffers are allocated again, empty, at
    its next write (the prompt's, on a cache that holds nothing yet)."""
    if layer.max_cache_len != slots:
        layer.max_cache_len = slots
        if layer.is_initialized:
            layer.keys = layer.values = None
            layer.is_initialized = False


def _check_room(cache: Any, needed: int, prompt: int) -> None:
    """A static cache too short for the tokens of this call raises, saying the size needed
    (the buffers cannot grow)."""
    room = getattr(cache.layers[0], "max_cache_len", None)
    if room is not None and needed > room:
        raise ValueError(
            f"the static cache holds {room} tokens, and this step needs {needed} (a prompt of "
            f"{prompt} tokens and {needed - prompt} generated): build it with max_cache_len >= "
            "prompt length + max_new_tokens"
        )


class _ScoresPromptRows:
    """An instance wrapper on ``model.generate``: inside one generation, a pruned prompt is
    scored with the rows of the prompt ``generate()`` was given, whatever else its first call
    carries. Assisted decoding's first call holds the prompt and the assistant's draft, and
    without a cache every step re-runs the prompt and the tokens generated so far; scored by
    the prompt's rows, both keep what greedy decoding with a cache keeps. ``remove()`` puts
    the class method back."""

    def __init__(self, model: nn.Module, tracker: CallTracker) -> None:
        self.model = model
        original = model.generate

        @functools.wraps(original)
        def generate(*args: Any, **kwargs: Any) -> Any:
            ids = kwargs.get("input_ids", args[0] if args else None)
            if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
                return original(*args, **kwargs)
            with tracker.scoring_prompt(ids.shape[1]):
                return original(*args, **kwargs)

        self.wrapper = generate
        model.__dict__["generate"] = generate

    def remove(self) -> None:
        if self.model.__dict__.get("generate") is self.wrapper:
            del self.model.__dict__["generate"]


class FocusEngine:
    """Owns the hooks on one model instance and the state of the current prefill."""

    def __init__(
        self, model: nn.Module, adapter: ModelAdapter, config: FocusConfig, pruner: Pruner
    ) -> None:
        self.model = model
        self.adapter = adapter
        self.config = config
        self.pruner = pruner
        self.stages = dict(config.stages)
        self.first_layer = min(self.stages)
        self.layers = adapter.decoder_layers(model)
        self.state: _Prefill | None = None  # the prefill the current call belongs to
        # every live prefill by the cache it filled: generations may interleave on one model
        # (assisted decoding with the model as its own assistant runs two caches)
        self._states: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self.last_trace: FocusTrace | None = None
        self._hooks: list[Any] = []
        self._static_caches: weakref.WeakSet = weakref.WeakSet()  # whose buffers it resized
        self._warned_uneven = False
        self.tracker: CallTracker | None = None
        attn = getattr(getattr(model, "config", None), "_attn_implementation", None) or ""
        self._flash = attn.startswith("flash")

    # --- lifecycle ------------------------------------------------------------------------------
    def attach(self) -> None:
        # The shared tracker reads each call first; the engine's hooks run before any probe's
        # or bias's on the same module (prepend), so those see the pruned layer inputs.
        self.tracker = CallTracker.acquire(self.model, self.adapter)
        self.tracker.engine = self  # wrap() refuses a model that is already wrapped
        self._hooks.append(self.model.register_forward_pre_hook(self._on_model, with_kwargs=True))
        self._hooks.append(self.model.register_forward_hook(self._after_model, with_kwargs=True))
        self._hooks.append(_ScoresPromptRows(self.model, self.tracker))
        if self.first_layer == 0:
            decoder = self.adapter.decoder(self.model)
            self._hooks.append(
                decoder.register_forward_pre_hook(self._on_decoder, with_kwargs=True, prepend=True)
            )
        for index in range(self.first_layer, len(self.layers)):
            self._hooks.append(
                self.layers[index].register_forward_pre_hook(
                    self._layer_hook(index), with_kwargs=True, prepend=True
                )
            )
        if self.adapter.sequence_hooks is not None:  # e.g. Qwen3-VL's DeepStack
            self._hooks.extend(self.adapter.sequence_hooks(self.model, self.prompt_positions))
        self._hooks.extend(self.pruner.attach(self.model, self.adapter))  # e.g. vision tower
        if self.config.warm_kernels and self.pruner.attention_based:
            self._warm_kernels()

    def _warm_kernels(self) -> None:
        """Compile the score kernel for each stage layer's head layout (a no-op off CUDA)."""
        seen = set()
        for index in self.stages:
            layer = self.layers[index]
            attn = getattr(layer, self.adapter.attention)
            weight = attn.q_proj.weight
            device = _execution_device(layer, weight.device)
            n_heads = weight.shape[0] // attn.head_dim
            key = (n_heads, n_heads // attn.num_key_value_groups, attn.head_dim, weight.dtype)
            if device.type == "cuda" and (key, device) not in seen:
                seen.add((key, device))
                warm_up(*key[:3], dtype=key[3], device=device, reduces=(self.config.reduce,))

    def detach(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        for cache in list(self._static_caches):  # give pruned layers their full width back
            room = cache.layers[0].max_cache_len
            for layer in cache.layers:
                _resize(layer, room)
        if self.tracker is not None:
            if self.tracker.engine is self:
                self.tracker.engine = None
            self.tracker.release()  # the encoder methods are back once nobody listens
            self.tracker = None
        self.state = None

    @property
    def _active(self) -> bool:
        """False while a side pass runs with the engine stood aside (``tracker.isolated()``)."""
        return self.tracker is not None and self.tracker.engine is self

    # --- what each layer holds, for the probes and biases ----------------------------------------
    def prompt_positions(self, index: int) -> torch.Tensor | None:
        """``[B, S']`` original positions of the prompt tokens layer ``index`` holds (and
        outputs) in the current prefill, or ``None`` when it holds them all (before the first
        stage, or no pruned prefill is current)."""
        state = self.state
        if state is None or index < self.first_layer:
            return None
        return state.per_layer.get(index)

    def fixating(self) -> bool:
        return self.state is not None and self.state.fixation is not None

    def dropped_keys(self) -> dict[int, torch.Tensor]:
        """Per layer holding fewer prompt tokens, ``[B, S]`` bool: the visual tokens it lacks."""
        state = self.state
        if state is None:
            return {}
        out = {}
        for index, held in state.per_layer.items():
            masked = state.masked_at.get(index)
            if held.shape[1] == state.full_len and masked is None:
                continue
            held = held.to(state.visual.device)
            has = torch.zeros_like(state.visual).scatter(1, held, True)
            if masked is not None:
                has = has.scatter(1, held, ~masked.to(has.device))
            out[index] = state.visual & ~has
        return out

    # --- top-level hook: one layout per prefill -----------------------------------------------
    def _on_model(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if not self._active:
            return args, kwargs
        cache = cache_of(kwargs)
        # A call brings images when it carries pixels or (inside generate()) encoder outputs;
        # an image-token id that decoding emits is only text, so ids alone never decide.
        tracker = self.tracker
        call = tracker.call
        if call is None:
            if tracker.has_images:
                self._unreadable_call(tracker.problem)
            self._pass_through(True)
            return args, kwargs
        extends = cache is not None and (call.compiled or cache_length(cache) > 0)
        if tracker.has_images and not extends:
            return args, self._start_prefill(call, cache, kwargs)
        if call.compiled:
            # a compiled step decodes the prompt that ran last, eagerly (the tracker checks its
            # cache); no lookup by cache, whose guards would recompile the step
            state = self.state if self.state is not None and self.state.static else None
        else:
            state = self._states.get(cache) if extends else None
        if state is not None:
            if tracker.has_images:
                # generate() sends a continued prompt's images again with its new tokens (a
                # later chat turn on a returned cache); they are already in the cache
                self._check_no_new_images(call, cache)
            self.state = state
            return args, self._begin_decode_step(state, call, cache, kwargs)
        if call.compiled:  # a compiled step after a text-only prompt: nothing is pruned
            self.state = None
            return args, kwargs
        if tracker.has_images:
            self._check_no_new_images(call, cache)
        # a text-only call passes through unpruned; a new prompt (empty cache) is the latest call
        self._pass_through(not extends)
        return args, kwargs

    def _unreadable_call(self, problem: str | None) -> None:
        """A call with images that the tracker could not read (``inputs_embeds`` without
        ``input_ids``): it runs unpruned, with a warning when pruning was asked for."""
        if problem and problem.startswith("input_ids"):
            if any(keep != 1.0 for _, keep in self.config.stages):
                warnings.warn(
                    "vlm_focus: this call passes inputs_embeds without input_ids, so the visual "
                    "tokens cannot be found and it runs unpruned; pass input_ids (and the pixel "
                    "inputs) to prune",
                    stacklevel=3,
                )
            return
        raise ValueError(f"vlm_focus needs {problem} to prune images")

    def _check_no_new_images(self, call: Any, cache: Any) -> None:
        """Images whose tokens arrive on a cache that already holds tokens cannot be pruned."""
        if self.adapter.visual_mask(self.model, call.input_ids).any():
            raise ValueError(
                "vlm_focus prunes images in a prefill with an empty cache; this call brings "
                f"new image tokens onto a cache that already holds {cache_length(cache)} tokens "
                "(a later chat turn with a new image). Run the whole conversation as one prompt "
                "on a fresh cache (pass every turn and image to the processor, no "
                "past_key_values), or call handle.remove() for calls that extend a cache"
            )

    def _begin_decode_step(self, state: _Prefill, call: Any, cache: Any, kwargs: dict) -> dict:
        """A decode step on the cache this prefill filled. On a static cache nothing here reads
        a length from the device, so a compiled step stays one graph."""
        if state.static and not call.compiled:
            _check_room(cache, call.past + call.input_ids.shape[1], state.full_len)
        state.prefilling = False
        state.memo.clear()  # slices of the last call only
        state.inputs = {}  # pixel inputs served the prefill's stages; let them go
        if state.fixation is not None:
            # which cached keys are padding (a 2-D mask, whatever mask the call has; a static
            # cache's step uses the prompt's own, mapped once when the prompt ended)
            state.fixation.begin_step(None if state.static else call.valid)
        compact = self.config.positions == "compact"
        # A dynamic cache reports original lengths (cache_lengths), so the decoder places a
        # step itself; a static layer 0 at K = 0 counts only its kept prompt.
        if kwargs.get("position_ids") is None and (
            compact or (state.static and self.first_layer == 0)
        ):
            if call.compiled:
                raise ValueError(
                    "vlm_focus with layer=0 under torch.compile needs the decode step's "
                    "position_ids (generate() passes them)"
                )
            kwargs = self._fill_decode_inputs(kwargs, call.input_ids, cache)
        if compact:
            # Compact positions count on from the pruned prompt: the original ones minus what
            # every row dropped.
            position_ids = kwargs["position_ids"]
            kwargs = dict(kwargs)
            kwargs["position_ids"] = position_ids - _on(state.dropped, position_ids)
        return kwargs

    def _pass_through(self, new_prompt: bool) -> None:
        """A call without images: nothing is pruned. After a new prompt (empty cache)
        ``last_trace`` is ``None``, as before any image call, rather than still describing an
        earlier call's prefill; a step on an existing cache leaves it as it is."""
        self.state = None
        if new_prompt:
            self.last_trace = None

    def _start_prefill(self, call: Any, cache: Any, kwargs: dict) -> dict:
        """Lay out a prompt with images and plan its stages; returns the call's kwargs (without
        ``labels`` when the loss is taken over the kept positions, see :meth:`_after_model`)."""
        prefill = self.tracker.prefill  # the tracker read this call's ids, padding and inputs
        input_ids, valid, visual = prefill.input_ids, prefill.valid, prefill.visual
        n_visual = visual.sum(1).tolist()
        # a text-only row has nothing to drop or score, so such a batch keeps the common rule
        per_row = self._per_row_shares(cache) and 0 not in n_visual
        if 0 in n_visual and any(n_visual):
            warnings.warn(
                "vlm_focus: this batch mixes rows without visual tokens and rows with images; "
                "rows keep one common length and a text-only row has nothing to drop, so the "
                "batch runs unpruned (batch text-only prompts separately to prune the others)",
                stacklevel=2,
            )
        drops, extras, counts = [], [], []
        remaining, attended = list(n_visual), list(n_visual)  # in the row's slots / unmasked
        for _, keep in self.config.stages:
            keep = self.pruner.prefill_keep(keep)
            target = [min(a, keep_count(keep, n)) for a, n in zip(attended, n_visual)]
            want = [r - t for r, t in zip(remaining, target)]
            drop = min(want)
            extra = [w - drop for w in want] if per_row else [0] * len(want)
            drops.append(drop)
            extras.append(extra)
            counts.append(remaining)
            remaining = [r - drop for r in remaining]
            attended = [r - e for r, e in zip(remaining, extra)]
        if any(drops) and not per_row:
            self._warn_uneven_rows(n_visual, remaining)
        # Nothing to drop (keep=1.0): the prompt runs as the model runs it, so no input the
        # layout needs is asked for and no layout is built.
        layout: list[list[ImageLayout]] = [[] for _ in n_visual]
        prunes = any(drops) or any(map(any, extras))
        if prunes or self.pruner.decode_time:
            for name in self.adapter.required_with_images:
                if prefill.inputs.get(name) is None:
                    raise ValueError(
                        f"'{self.adapter.model_type}' needs `{name}` (from the processor) with "
                        "images to prune them"
                    )
            layout = prefill.layout(self.model, self.adapter)
        batch, seq = input_ids.shape
        if is_static(cache):
            self._fit_static_buffers(cache, seq, drops)
        trace = FocusTrace(n_visual=n_visual, visual=visual)
        self.state = _Prefill(
            layout=layout,
            visual=visual,
            valid=valid,
            full_len=seq,
            drops=drops,
            extras=extras,
            visual_counts=counts,
            inputs={k: v for k, v in prefill.inputs.items() if k not in CACHE_KEYS},
            trace=trace,
            current=torch.arange(seq, device=input_ids.device).expand(batch, seq),
            frames=(
                _frame_ids(layout, (batch, seq), input_ids.device)
                if self.config.budget == "frame"
                else None
            ),
            dropped=(
                torch.full((), sum(drops), dtype=torch.long, device=input_ids.device)
                if self.config.positions == "compact"
                else None
            ),
        )
        if prunes and (kwargs.get("labels") is not None or kwargs.get("shift_labels") is not None):
            kwargs = self._take_labels(kwargs)
        if self.pruner.decode_time:
            options = self.pruner.options
            self.state.fixation = StepFixation(
                self.adapter,
                layout,
                visual,
                n_visual,
                remaining,
                self.config.stages[0][1],
                self.config.reduce,
                options.refresh,
                options.radius,
            )
            trace.fixation = self.state.fixation
        self.last_trace = trace
        return kwargs

    def _per_row_shares(self, cache: Any) -> bool:
        """Rows of a batch keep their own share of visual tokens: each drops what the row with
        the fewest drops, and masks the rest of its share as keys in the slots it keeps (the
        batch keeps one length, so this costs what the longest row costs). A static cache
        (fixed masks per slot), flash attention (no key masks), compact positions (which count
        every kept slot) and decode-time selection keep the common rule instead."""
        return not (
            is_static(cache)
            or self._flash
            or self.config.positions == "compact"
            or self.pruner.decode_time
        )

    def _warn_uneven_rows(self, n_visual: list[int], kept: list[int]) -> None:
        """Under the common rule a row with more visual tokens than the others keeps more than
        its own share; say so, with the numbers, once per handle."""
        alone = list(n_visual)
        for _, keep in self.config.stages:
            keep = self.pruner.prefill_keep(keep)
            alone = [min(r, keep_count(keep, n)) for r, n in zip(alone, n_visual)]
        if self._warned_uneven or all(k <= 1.25 * a + 2 for k, a in zip(kept, alone)):
            return
        self._warned_uneven = True
        warnings.warn(
            f"vlm_focus: rows with {n_visual} visual tokens keep {kept} of them, where each "
            f"alone would keep {alone}: a batch keeps one common length, so each row drops "
            "what the row with the fewest visual tokens drops. Batch images of similar token "
            "counts together (or one image per call) to keep each row's own share",
            stacklevel=3,
        )

    def _take_labels(self, kwargs: dict) -> dict:
        """Training on a pruned prompt: the forward returns logits for the kept positions only,
        so the model cannot shift ``labels`` itself. Each original position's next-token
        target is taken here and the loss is computed after the forward over the positions
        the last layer holds (:meth:`_after_model`): the full run's loss with the pruned visual
        tokens' own targets left out (they are image tokens, whose labels are ignored)."""
        kwargs = dict(kwargs)
        labels = kwargs.pop("labels", None)
        targets = kwargs.pop("shift_labels", None)
        ignore = kwargs.get("ignore_index", -100)
        if targets is None:
            targets = torch.nn.functional.pad(labels, (0, 1), value=ignore)[:, 1:]
        self.state.targets = targets
        self.state.loss_kwargs = {
            k: kwargs.pop(k) for k in ("num_items_in_batch", "ignore_index") if k in kwargs
        }
        return kwargs

    def _after_model(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        """After a prefill: its pruned cache layers report original lengths, and the loss of
        a call with labels is taken over the kept positions."""
        state = self.state
        if state is None or not state.prefilling or not self._active:
            return None
        cache = state.cache() if state.cache is not None else None
        if cache is not None and not state.static:
            for index in range(self.first_layer, len(self.layers)):
                dropped = state.full_len - state.per_layer[index].shape[1]
                if dropped and index < len(cache.layers):
                    report_original_length(cache.layers[index], dropped)
        if state.targets is None:
            return None
        state.targets, targets = None, state.targets
        if isinstance(output, tuple):  # return_dict=False: the loss comes first
            return (self._pruned_loss(module, output[0], targets), *output)
        loss = self._pruned_loss(module, output.logits, targets)
        return type(output)(**{**dict(output.items()), "loss": loss})

    def _pruned_loss(
        self, model: nn.Module, logits: torch.Tensor, targets: torch.Tensor
    ) -> torch.Tensor:
        state = self.state
        held = state.per_layer[len(self.layers) - 1]  # [B, S'] original positions
        targets = targets.to(held.device)
        ignore = state.loss_kwargs.get("ignore_index", -100)
        vocab = model.config.get_text_config().vocab_size
        if targets.shape[1] != state.full_len:
            if targets.shape[1] != logits.shape[1]:
                raise ValueError(
                    f"labels / shift_labels have {targets.shape[1]} positions; pass one per "
                    f"prompt token ({state.full_len}, original positions) or, as shift_labels, "
                    f"one per returned logit ({logits.shape[1]}, last_trace.sequence)"
                )
            # already aligned with the logits the pruned forward returns
            return model.loss_function(
                logits=logits,
                labels=None,
                shift_labels=targets,
                vocab_size=vocab,
                **state.loss_kwargs,
            )
        masked = state.masked_at.get(len(self.layers) - 1)  # [B, S'] in the held slots
        counted = torch.ones_like(held, dtype=torch.bool) if masked is None else ~masked
        lost = targets.masked_fill(
            torch.zeros_like(targets, dtype=torch.bool).scatter(1, held, counted), ignore
        )
        targets = targets.gather(1, held)
        if masked is not None:
            targets = targets.masked_fill(masked.to(targets.device), ignore)
        targets = targets[:, targets.shape[1] - logits.shape[1] :]  # logits_to_keep
        if bool((lost != ignore).any()):
            warnings.warn(
                "vlm_focus: some pruned visual tokens had a next-token target (a label right "
                "after an image); the loss leaves those positions out. Mask the labels of the "
                "prompt (-100) to train on answers only",
                stacklevel=3,
            )
        return model.loss_function(
            logits=logits, labels=None, shift_labels=targets, vocab_size=vocab, **state.loss_kwargs
        )

    def _fit_static_buffers(self, cache: Any, seq: int, drops: list[int]) -> None:
        """Size each pruned layer's static buffer to what it holds: its kept prompt and the
        tokens generated after it (the room the cache leaves past the prompt). Attention in
        decode then reads only those slots. Layer 0 keeps the cache's width: the model sizes
        every mask by it."""
        room = cache.layers[0].max_cache_len
        if room is None or room < seq:
            return  # too short for the prompt: the prompt's mask check says so
        held, stage = seq, 0
        stages = [layer for layer, _ in self.config.stages]
        for index in range(1, len(cache.layers)):
            while stage < len(stages) and stages[stage] <= index:
                held -= drops[stage]
                stage += 1
            _resize(cache.layers[index], held + room - seq)
        self._static_caches.add(cache)

    def _fill_decode_inputs(self, kwargs: dict, input_ids: torch.Tensor, cache: Any) -> dict:
        """A decode step's original positions (full prompt + step), for a step without
        ``position_ids`` that the decoder would place wrongly: on a static cache at K = 0
        (layer 0 counts its kept prompt) or with compact positions (renumbered from them)."""
        state = self.state
        batch, n_new = input_ids.shape
        width = cache_length(cache) + n_new  # a dynamic cache reports original lengths
        if state.static and self.first_layer == 0:
            width += state.full_len - state.per_layer[0].shape[1]
        text = torch.arange(width - n_new, width, device=input_ids.device).expand(batch, -1)
        kwargs = dict(kwargs)
        kwargs["position_ids"] = self.adapter.decode_positions(
            self.model, text, kwargs.get("attention_mask")
        )
        return kwargs

    # --- decoder hook (K = 0 decode): slice the 2-D mask before masks are built -----------------
    def _on_decoder(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """A decode step on a static cache at K = 0: layer 0's buffer holds its kept prompt, so
        the 2-D mask is sliced to it before the decoder builds its masks. (A dynamic cache
        reports original lengths, so its masks are built full width and sliced per layer.)"""
        state = self.state if self._active else None
        if state is None or not state.static or state.prefilling or 0 not in state.per_layer:
            return args, kwargs
        mask = kwargs.get("attention_mask")
        kept = state.per_layer[0]
        # host counts, no read: layer 0 dropped tokens when it holds fewer than the prompt
        if isinstance(mask, torch.Tensor) and mask.dim() == 2 and kept.shape[1] != state.full_len:
            kwargs = dict(kwargs)
            kwargs["attention_mask"] = _gather_seq(
                mask, _decode_columns(kept, state.full_len, mask.shape[1]), 1
            )
        return args, kwargs

    # --- layer hooks ----------------------------------------------------------------------------
    def _layer_hook(self, index: int) -> Callable:
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
            state = self.state
            if state is None or not self._active:
                return None
            cache = cache_of(kwargs)
            hidden = args[0] if args else kwargs["hidden_states"]
            # a static cache's length lives on the device: its prefill is known per call instead
            prefill = state.prefilling if state.static else cache_length(cache, index) == 0
            if prefill:
                hidden, kwargs = self._prefill_layer(index, module, hidden, kwargs, cache)
            elif state.fixation is not None:
                kwargs = self._fixated_layer(index, module, hidden, kwargs, cache)
            else:
                kwargs = self._decode_layer(index, hidden, kwargs, cache)
            if args:
                return (hidden, *args[1:]), kwargs
            kwargs["hidden_states"] = hidden
            return args, kwargs

        return hook

    def _prefill_layer(
        self, index: int, layer: nn.Module, hidden: torch.Tensor, kwargs: dict, cache: Any
    ) -> tuple[torch.Tensor, dict]:
        state = self.state
        cos, sin = kwargs["position_embeddings"]
        replay = index in state.per_layer  # recomputed (gradient checkpointing): same slices
        if replay:
            current = state.per_layer[index]
            if index in state.stage_rows:
                hidden = _gather_seq(hidden, state.stage_rows[index].to(hidden.device), 1)
        else:
            if hidden.shape[1] != state.current.shape[1]:
                raise RuntimeError(
                    f"layer {index} got {hidden.shape[1]} tokens, expected {state.current.shape[1]}"
                )
            if cache is not None and state.cache is None:
                state.cache = weakref.ref(cache)
                state.static = is_static(cache)
                self._states[cache] = state
            if index in self.stages:
                local = self._run_stage(index, layer, hidden, cos, sin)
                state.stage_rows[index] = local
                hidden = _gather_seq(hidden, local.to(hidden.device), 1)
                state.current = state.current.gather(1, local.to(state.current.device))
            current = state.current
            state.per_layer[index] = current
        state.decode_cols[index] = self._once("cols", None, current, lambda: self._columns(current))
        kwargs = dict(kwargs)
        # The decoder hands every layer the same full-length cos/sin, mask and position ids, and
        # the kept set changes only at a stage: slice each once per stage (on its own device).
        kwargs["position_embeddings"] = (
            self._once("cos", cos, current, lambda: self._kept_positions(cos, current, 1)),
            self._once("sin", sin, current, lambda: self._kept_positions(sin, current, 1)),
        )
        mask = kwargs.get("attention_mask")
        if state.static:
            slots = cache.layers[index].max_cache_len
            kwargs["attention_mask"] = self._once(
                f"mask{slots}",
                mask,
                current,
                lambda: self._static_prefill_mask(mask, current, slots),
            )
        else:
            kwargs["attention_mask"] = self._once(
                "mask",
                mask,
                current,
                lambda: _slice_mask(mask, _on(current, mask), _on(current, mask)),
            )
        if state.masked is not None:
            masked = self._once(
                "masked",
                state.masked,
                current,
                lambda: _gather_seq(state.masked, _on(current, state.masked), 1),
            )
            state.masked_at[index] = masked
            mask = kwargs["attention_mask"]
            kwargs["attention_mask"] = self._once(
                "masked_mask",
                mask,
                current,
                lambda: _mask_keys(mask, masked, hidden.shape[1], masked.shape[1]),
            )
        position_ids = kwargs.get("position_ids")
        if isinstance(position_ids, torch.Tensor) and self._flash:
            # Kept ids have gaps, which flash-attention at batch 1 reads as packed sequences
            # (a host read per layer); RoPE already sits in cos/sin, so the layers need none.
            kwargs["position_ids"] = None
        elif isinstance(position_ids, torch.Tensor):
            kwargs["position_ids"] = self._once(
                "position_ids",
                position_ids,
                current,
                lambda: self._kept_positions(position_ids, current, position_ids.dim() - 1),
            )
        if index == len(self.layers) - 1 and not replay:
            state.trace.sequence = current
            if state.fixation is not None:  # its focal layer's cache holds the kept prompt
                state.fixation.hold(state.per_layer[self.first_layer], state.valid)
            if state.static:
                self._build_static_columns(cache)
                if state.fixation is not None:
                    state.fixation.record_into(cache.layers[0].max_cache_len - state.full_len)
        return hidden, kwargs

    def _fixated_layer(
        self, index: int, layer: nn.Module, hidden: torch.Tensor, kwargs: dict, cache: Any
    ) -> dict:
        """A decode step under fixation: the focal layer (the first hooked one) picks the
        step's visual columns; every hooked layer reads only those (plus all text) from the
        cache. Chunks of several new tokens (a follow-up turn) attend to everything."""
        fixation = self.state.fixation
        if hidden.shape[1] != 1:
            return kwargs
        if fixation.columns is None:
            keys = cache.layers[index].keys  # [B, Hkv, L, D], before this step's token
            if self.state.static:  # the whole buffer, its first `length` slots written
                fixation.fixate_static(layer, hidden, kwargs, keys, static_length(cache, index))
            else:
                fixation.fixate(layer, hidden, kwargs, keys)
        columns = fixation.columns
        mask = self._decode_layer(index, hidden, kwargs, cache).get("attention_mask")
        kwargs = dict(kwargs)
        for key in CACHE_KEYS:
            if kwargs.get(key) is not None:
                kwargs[key] = FixedView(kwargs[key], columns)
        if isinstance(mask, torch.Tensor):  # the layer's own columns, then the step's
            kwargs["attention_mask"] = self._once(
                "fixed_mask", mask, columns, lambda: _slice_mask(mask, None, _on(columns, mask))
            )
        return kwargs

    def _kept_positions(self, x: torch.Tensor, current: torch.Tensor, dim: int) -> torch.Tensor:
        """``x`` (cos, sin or position ids along ``dim``) for the tokens a layer holding
        ``current`` keeps: theirs (``positions="original"``), or, compact, the first ``S'``: the
        j-th kept token takes what the unpruned row gives its j-th token. Padding comes first
        and is never pruned, so this is the numbering of the prompt without its pruned tokens
        (``generate()`` counts from each row's first token, a plain forward from column 0)."""
        if self.config.positions == "compact":
            return x.narrow(dim, 0, current.shape[1])
        return _gather_seq(x, _on(current, x), dim)

    def _columns(self, current: torch.Tensor) -> torch.Tensor:
        """Prefill columns of the decode mask a layer holding ``current`` keeps: the decode mask
        spans the full prompt, or layer 0's kept prompt on a static cache at K = 0 (the decoder
        hook sliced it)."""
        static_k0 = self.first_layer == 0 and self.state.static
        base = self.state.per_layer.get(0) if static_k0 else None
        return current if base is None else torch.searchsorted(base, current)

    def _once(self, name: str, source: Any, current: torch.Tensor, make: Callable[[], Any]) -> Any:
        """``make()``, computed once and reused while ``source`` and ``current`` stay the same
        objects (they do across the layers of a stage, or of one decode step)."""
        memo = self.state.memo
        hit = memo.get(name)
        if hit is not None and hit[0] is source and hit[1] is current:
            return hit[2]
        value = make()
        memo[name] = (source, current, value)
        return value

    def _static_prefill_mask(
        self, mask: Any, current: torch.Tensor, slots: int
    ) -> torch.Tensor | None:
        """The prefill mask of a layer holding ``current`` in a static buffer of ``slots``:
        its rows, and per slot the column it reads. Without a mask (SDPA, no padding) the
        layer's causal attention is aligned to its first slot, which matches its kept tokens."""
        if mask is None:
            return None
        if not isinstance(mask, torch.Tensor) or mask.dim() != 4:
            raise ValueError(
                "vlm_focus with a static cache needs the 4-D attention mask the model builds "
                "for it (use attn_implementation='sdpa' or 'eager', and pass attention_mask)"
            )
        width = mask.shape[-1]
        if width < self.state.full_len:
            raise ValueError(
                f"the static cache holds {width} tokens, fewer than this prompt's "
                f"{self.state.full_len}: build it with max_cache_len >= prompt length + "
                "max_new_tokens"
            )
        cols = _static_columns(_on(current, mask), self.state.full_len, slots, width)
        return _static_mask(mask, _on(current, mask), cols)

    def _build_static_columns(self, cache: Any) -> None:
        """At the end of a prompt on a static cache: per hooked layer, the mask column each
        slot of its buffer reads in decode. A decode mask spans the original prompt, or layer
        0's kept prompt with K = 0 (layer 0's short cache sizes it); the layers of a stage
        share one map."""
        state = self.state
        compact = self.first_layer == 0
        prompt = state.per_layer[0].shape[1] if compact else state.full_len
        width = cache.layers[0].max_cache_len  # every decode mask's
        built: dict[tuple[int, int], torch.Tensor] = {}
        for index in range(self.first_layer, len(self.layers)):
            held = state.decode_cols[index] if compact else state.per_layer[index]
            key = (id(held), cache.layers[index].max_cache_len)
            if key not in built:
                built[key] = _static_columns(held, prompt, key[1], width)
            state.static_cols[index] = built[key]

    def _static_decode_mask(self, index: int, mask: Any) -> torch.Tensor:
        """A decode step's mask for a layer's static buffer: slot ``j`` reads the column of
        the token stored there."""
        if not isinstance(mask, torch.Tensor) or mask.dim() != 4:
            raise ValueError(
                "vlm_focus with a static cache needs the 4-D attention mask the model builds "
                "for it (use attn_implementation='sdpa' or 'eager')"
            )
        cols = _on(self.state.static_cols[index], mask)
        return self._once("decode_mask", mask, cols, lambda: _static_mask(mask, None, cols))

    def _decode_layer(self, index: int, hidden: torch.Tensor, kwargs: dict, cache: Any) -> dict:
        state = self.state
        mask = kwargs.get("attention_mask")
        if state.static:
            kwargs = dict(kwargs)
            kwargs["attention_mask"] = self._static_decode_mask(index, mask)
            return kwargs
        masked = state.masked_at.get(index)
        if masked is not None:  # this layer's masked prompt keys stay masked at every step
            kwargs = dict(self._decode_mask(index, hidden, kwargs, cache))
            mask = kwargs.get("attention_mask")
            width = held_length(cache, index) + hidden.shape[1]
            kwargs["attention_mask"] = self._once(
                "decode_masked",
                mask,
                masked,
                lambda: _mask_keys(mask, masked, hidden.shape[1], width),
            )
            return kwargs
        return self._decode_mask(index, hidden, kwargs, cache)

    def _decode_mask(self, index: int, hidden: torch.Tensor, kwargs: dict, cache: Any) -> dict:
        """A decode step's mask, column-sliced to the keys layer ``index`` holds."""
        state = self.state
        mask = kwargs.get("attention_mask")
        if not isinstance(mask, torch.Tensor):
            return kwargs  # no mask: every cached key is attendable, nothing to slice
        width, n_new = mask.shape[-1], hidden.shape[1]
        own = held_length(cache, index)
        if width == own + n_new:
            return kwargs
        kept_cols = state.decode_cols[index]
        prompt = state.full_len
        if width - prompt != own - kept_cols.shape[1] + n_new:
            raise RuntimeError(f"layer {index}: decode mask width {width} matches no cache length")
        kwargs = dict(kwargs)
        kwargs["attention_mask"] = self._once(
            "decode_mask",
            mask,
            kept_cols,
            lambda: _slice_mask(mask, None, _decode_columns(_on(kept_cols, mask), prompt, width)),
        )
        return kwargs

    def _run_stage(
        self,
        index: int,
        layer: nn.Module,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> torch.Tensor:
        """Score and select at a stage layer; returns the local indices ``[B, S'']`` to keep.

        Counts are known on the host, so nothing here waits for the device: every row drops
        ``drop`` visual tokens, chosen on the device, and the trace reads them back lazily."""
        state = self.state
        stage_index = len(state.trace.stages)
        # Score where the layer's weights are (under a device map its input may still be on
        # the previous layer's device: accelerate moves it only inside forward).
        device = _execution_device(layer, hidden.device)
        hidden = hidden.to(device)
        current = state.current.to(device)
        batch, seq = current.shape
        visual = state.visual.to(device).gather(1, current)
        drop = state.drops[stage_index]
        extra = state.extras[stage_index]
        if drop == 0 and not any(extra):  # nothing to drop (keep=1.0, or a text-only row)
            keep = torch.ones_like(visual)
            zeros = torch.zeros(visual.shape, device=visual.device)
            state.trace.stages.append(StageTrace(index, current, visual, keep, zeros))
            return torch.arange(seq, device=device).expand(batch, seq)
        counts = state.visual_counts[stage_index]  # host: visual tokens per row at this stage
        n_keep = min(counts) - drop
        ctx = StageContext(
            model=self.model,
            adapter=self.adapter,
            config=self.config,
            layer_index=index,
            stage_index=stage_index,
            decoder_layer=layer,
            hidden=hidden,
            cos=_gather_seq(cos.to(device), current, 1),
            sin=_gather_seq(sin.to(device), current, 1),
            positions=current,
            visual=visual,
            valid=state.valid.to(device).gather(1, current),
            layout=state.layout,
            inputs=state.inputs,
            visual_counts=counts,
            prompt_end=self.tracker.prompt_end,  # set for the whole forward of a grounding pass
        )
        watch = state.trace.stopwatch
        start = watch.start(device)
        with torch.no_grad():
            selection = self.pruner.select(ctx, n_keep)
        ranking = selection.scores
        if self.config.budget == "frame":
            frames = state.frames.to(device).gather(1, current)
            ranking = frame_shares(ranking, visual, frames)
        before = None if state.masked is None else state.masked.to(device).gather(1, current)
        masked = None
        if any(extra) or before is not None:
            if before is not None:  # what an earlier stage masked goes first
                floor = torch.finfo(torch.float32).min
                ranking = ranking.float().masked_fill(before, floor)
            keep = keep_mask(ranking, visual, drop)
            share = torch.tensor(extra, device=device) + drop
            masked = lowest_visual(ranking, visual, share) & keep
            state.masked = torch.zeros_like(state.visual).scatter(
                1, current.to(state.visual.device), masked.to(state.visual.device)
            )
        elif self.config.budget == "frame":
            keep = keep_mask(ranking, visual, drop)
        else:  # the pruner's own top n_keep when every row keeps the same count
            kept = selection.kept if len(set(counts)) == 1 else None
            keep = selected_keep(selection.scores, kept, visual, drop)
        watch.stop(start, device)
        local = kept_columns(keep, seq - drop)
        state.trace.stages.append(
            StageTrace(index, current, visual, keep, selection.scores, masked=masked)
        )
        return local


def _frame_ids(layout: list[list[ImageLayout]], shape: tuple[int, int], device) -> torch.Tensor:
    """``[B, S]`` id of the image, or of the video frame, each original position belongs to
    (-1 off the visual span): the units of ``budget="frame"``."""
    frames = torch.full(shape, -1, dtype=torch.long)
    for b, images in enumerate(layout):
        next_id = 0
        for image in images:
            if image.kind == "video":
                frames[b, image.positions] = next_id + image.cells[:, 0].clamp(min=0)
                next_id += len(image.grids)
            else:
                frames[b, image.positions] = next_id
                next_id += 1
    return frames.to(device)
