"""One call tracker per model instance, shared by the pruning engine, the probes and the biases.

A forward pre-hook on the top model records, for every call, the new token ids, which keys are
padding, how long the cache already is, and (for a prompt) which tokens are visual and the
image inputs the adapter lays them out from. ``generate()`` hands some of those inputs to the
image encoder only, so they are recorded there
(:class:`~vlm_focus.core.encoder_inputs.EncoderInputs`).

When a pruning handle is attached, it shares with the tracker what each decoder layer holds
(:class:`~vlm_focus.core.prune_state.PrunedLayers`): the original positions of its prompt
tokens (:meth:`CallTracker.prompt_positions`), so a probe or a bias at a pruned layer reads
and writes its attention in original positions instead of refusing.
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..model_adapters import ImageLayout, ModelAdapter
from .attention import text_after_image
from .encoder_inputs import EncoderInputs

CACHE_KEYS = ("cache", "past_key_values")


def cache_of(kwargs: dict[str, Any]) -> Any:
    for key in CACHE_KEYS:
        if kwargs.get(key) is not None:
            return kwargs[key]
    return None


def cache_length(cache: Any, layer: int = 0) -> int:
    return 0 if cache is None else int(cache.get_seq_length(layer))


def is_static(cache: Any) -> bool:
    """A preallocated cache (``StaticCache``): fixed-width buffers written at each layer's own
    length, which lives on the device, with masks as wide as the buffers."""
    return bool(getattr(cache, "is_compileable", False))


def static_length(cache: Any, layer: int) -> torch.Tensor:
    """How many slots layer ``layer`` of a static cache holds, as a 0-d device tensor (no host
    read, so a compiled step stays one graph)."""
    length = cache.layers[layer].get_seq_length()
    return length if isinstance(length, torch.Tensor) else torch.tensor(length)


def full_attention_mask(mask: Any) -> Any:
    """The mask of a call: a model that takes one mask per attention type (``generate()`` with
    a static cache builds ``{"full_attention": [B, 1, q, L]}`` for Qwen, with a
    ``"sliding_attention"`` one beside it for Gemma 3 and a ``"linear_attention"`` one for a
    hybrid decoder) gives its full one."""
    if isinstance(mask, dict) and "full_attention" in mask:
        return mask["full_attention"]
    return mask


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
        return text_after_image(self.visual, self.valid)


@dataclass
class CallState:
    """What the top model saw in one forward call (prefill or one decode step).

    ``valid`` spans every key of the call in original positions (the prompt at full length,
    then the generated tokens), ``past`` is how many of those precede this call's tokens.

    A decode step inside ``torch.compile`` (``compiled``) carries neither: both grow with every
    step, so reading them would recompile the step each time (see ``CallTracker``)."""

    input_ids: torch.Tensor  # [B, T] the new tokens of this call
    valid: torch.Tensor | None  # [B, past + T] bool, keys that are not padding
    past: int | None
    inputs: dict[str, Any]
    compiled: bool = False


@dataclass
class CallTracker:
    """The one top-model pre-hook of a model instance; see the module docstring.

    Get it with :meth:`acquire` and give it back with :meth:`release`; the hook (and the
    encoder recording) goes when the last user releases it.
    """

    model: nn.Module
    adapter: ModelAdapter
    call: CallState | None = None
    prefill: Prefill | None = None
    step: int = -1
    #: why the current call cannot be read (no input_ids, a mask that is not 2-D), or None
    problem: str | None = None
    #: what the layers of a pruned model hold (the pruning handle's ``PrunedLayers``), if any
    pruning: Any = None
    has_images: bool = False  # the current call brings images (pixels or encoder outputs)
    #: prompt tokens before a teacher-forced continuation (see :meth:`scoring_prompt`), or None
    prompt_end: int | None = None
    users: int = 0
    _hook: Any = None
    _encoder: EncoderInputs | None = None
    _prefill_cache: Any = field(default=None, repr=False)

    @classmethod
    def acquire(cls, model: nn.Module, adapter: ModelAdapter) -> CallTracker:
        tracker = _TRACKERS.get(model)
        if tracker is None:
            tracker = cls(model, adapter)
            tracker._encoder = EncoderInputs(model, adapter)
            tracker._hook = model.register_forward_pre_hook(
                tracker._on_model, with_kwargs=True, prepend=True
            )
            _TRACKERS[model] = tracker
        tracker.users += 1
        return tracker

    def release(self) -> None:
        self.users -= 1
        if self.users > 0:
            return
        self._hook.remove()
        self._encoder.close()
        if _TRACKERS.get(self.model) is self:
            del _TRACKERS[self.model]

    # --- what layers hold ---------------------------------------------------------------------
    def prompt_positions(self, index: int) -> torch.Tensor | None:
        """``[B, S']`` original positions of the prompt tokens decoder layer ``index`` holds in
        the current prefill (and its cache), or ``None`` when it holds all of them."""
        if self.pruning is None:
            return None
        return self.pruning.prompt_positions(index)

    def fixating(self) -> bool:
        """True while a decode-time pruner chooses the keys of each decoding step."""
        return self.pruning is not None and self.pruning.fixating()

    def dropped_keys(self) -> dict[int, torch.Tensor]:
        """Per decoder layer holding fewer prompt tokens, ``[B, S]`` bool: the visual tokens it
        lacks in the current prefill (empty without pruning)."""
        return {} if self.pruning is None else self.pruning.dropped_keys()

    @contextlib.contextmanager
    def scoring_prompt(self, length: int):
        """Calls inside carry a teacher-forced continuation after their first ``length`` tokens
        (a grounding pass over prompt + answer). Pruners then score with the prompt's rows
        only, as in the generation's prefill: causal attention makes those rows identical, so
        the pass keeps the visual tokens that the generation kept."""
        saved, self.prompt_end = self.prompt_end, int(length)
        try:
            yield self
        finally:
            self.prompt_end = saved

    @contextlib.contextmanager
    def isolated(self):
        """Run a side pass (e.g. contrastive decoding's second model call) without disturbing
        the current generation: the pruning engine stands aside, and the tracked prompt and
        call are restored afterwards."""
        saved = (self.call, self.prefill, self.step, self._prefill_cache, self.pruning)
        self.pruning = None
        try:
            yield self
        finally:
            self.call, self.prefill, self.step, self._prefill_cache, self.pruning = saved

    @property
    def prompt_length(self) -> int:
        return 0 if self.prefill is None else self.prefill.input_ids.shape[1]

    # --- the hook -------------------------------------------------------------------------------
    def _on_model(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        cache = cache_of(kwargs)
        self.has_images = bool(kwargs.get("mm_encoder_outputs")) or any(
            kwargs.get(k) is not None for k in self.adapter.pixel_inputs
        )
        self.problem = None
        if torch.compiler.is_compiling():
            self._compiled_step(input_ids, cache, kwargs)
            return
        if input_ids is None:
            self.call = None
            self.problem = "input_ids (not inputs_embeds)"
            return
        mask = full_attention_mask(kwargs.get("attention_mask"))
        if mask is not None and (not isinstance(mask, torch.Tensor) or mask.dim() not in (2, 4)):
            self.call = None
            self.problem = "a 2-D attention_mask [batch, seq] (or none)"
            return
        batch, new = input_ids.shape
        stored = cache_length(cache)
        if mask is not None and mask.dim() == 4:
            # generate() with a static cache hands the model its 4-D mask, as wide as the cache.
            # A prompt's last query row allows every key that is not padding; a decode step's
            # keys are the prompt's and the generated tokens (never padding).
            past = stored + self._short_by(cache)
            if stored == 0 or self.prefill is None:
                if mask.shape[-1] < past + new:
                    self.call = None
                    self.problem = (
                        f"a static cache that holds the prompt: it holds {mask.shape[-1]} "
                        f"tokens and the prompt has {past + new} (max_cache_len >= prompt "
                        "length + max_new_tokens)"
                    )
                    return
                last = mask[:, 0, -1, : past + new].contiguous()
                valid = last if last.dtype == torch.bool else last == 0
            else:
                prompt = self.prefill.valid
                n_after = past + new - prompt.shape[1]
                after = torch.ones(batch, n_after, dtype=torch.bool, device=prompt.device)
                valid = torch.cat([prompt, after], dim=1)
        elif mask is not None:
            past = mask.shape[1] - new
            valid = mask.bool()
        else:
            past = stored + self._short_by(cache)
            valid = torch.ones(batch, past + new, dtype=torch.bool, device=input_ids.device)
        if stored == 0:
            past = 0
            if valid.shape[1] != new:
                self.call = None
                self.problem = f"an attention_mask as long as the call ({new} tokens)"
                return
        self.call = CallState(input_ids, valid, past, kwargs)
        self.step = self.step + 1 if stored > 0 else 0
        if stored == 0:
            recorded = self._encoder.take()
            if not recorded and kwargs.get("mm_encoder_outputs"):
                # generate() encoded the images once and hands the same encoder outputs to
                # every full-sequence call (use_cache=False, an assistant's passes)
                recorded = self._encoder.last
            inputs = {**recorded, **{k: v for k, v in kwargs.items() if v is not None}}
            self.prefill = Prefill(
                input_ids=input_ids,
                valid=valid,
                visual=self.adapter.visual_mask(self.model, input_ids, inputs) & valid,
                inputs=inputs,
            )
            self._prefill_cache = None if cache is None else weakref.ref(cache)

    def _compiled_step(self, input_ids: Any, cache: Any, kwargs: dict) -> None:
        """A call traced by ``torch.compile``: one decode step on the static cache of the prompt
        this tracker last saw (``generate()`` runs the prompt eagerly and compiles the steps).
        A static cache's length lives on the device, so reading it would split the graph, and
        a host count would change, and recompile, at every step: the step is recorded
        without either."""
        if (
            input_ids is None
            or input_ids.shape[1] != 1
            or self.has_images
            or not is_static(cache)
            or self._prefill_cache is None
            or self._prefill_cache() is not cache
        ):
            raise ValueError(
                "vlm_focus under torch.compile runs one-token decode steps on a static cache "
                "whose prompt ran uncompiled: use generate(..., cache_implementation='static', "
                "compile_config=...), or compile only the calls after the prompt"
            )
        self.call = CallState(input_ids, None, None, kwargs, compiled=True)

    def _short_by(self, cache: Any) -> int:
        """How many prompt tokens layer 0's static cache lacks (pruning before layer 0), so
        that a call without a mask is still placed at its original position. (A dynamic
        cache's pruned layers report their original lengths.)"""
        if not is_static(cache) or self._prefill_cache is None:
            return 0
        if self._prefill_cache() is not cache:
            return 0
        kept = self.prompt_positions(0)
        return 0 if kept is None else self.prompt_length - kept.shape[1]


_TRACKERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
