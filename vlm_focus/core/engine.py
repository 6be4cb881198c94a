"""Instance hooks that prune visual tokens inside an unmodified HF decoder: attach, remove,
and which mode each call runs in.

* A pre-hook on the top model reads each call (through the model's one call tracker): a prompt
  with images starts a pruned prefill (:mod:`vlm_focus.core.prefill`, which lays out the
  visual tokens via the model adapter and plans the stages); a call on the cache a pruned
  prefill filled is one of its decode steps (:mod:`vlm_focus.core.decode`); anything else runs
  unpruned.
* A pre-hook on every layer ``>= K`` hands the layer's inputs to the mode of the call: in the
  prefill, slices to the tokens it keeps (scoring first at a stage layer); in decode, the mask
  (and, under a decode-time pruner, the keys) of what the layer holds. Each layer's own cache
  length tells prefill from decode; a static cache (``StaticCache``, which ``torch.compile``
  decodes) keeps its lengths on the device, so its prefill is known per call instead and its
  masks are built per buffer slot (:mod:`vlm_focus.core.static_decode`; on a model with
  sliding-window layers, from each slot's original position).
* After a prefill, the pruned layers of a dynamic cache report original lengths
  (:mod:`vlm_focus.core.cache_lengths`), and the loss of a call with labels is taken over the
  kept positions (:mod:`vlm_focus.core.pruned_loss`).

The engine shares one :class:`~vlm_focus.core.prune_state.PrunedLayers` with the call tracker,
which the probes and biases read; the tracker never sees the engine. On a GPU the hot path
never waits for the device: a call brings images when it carries image inputs (never judged
from token ids), counts come from the host, and the trace is read back only when it is read.
Adapters may add hooks for decoder inputs laid out on the full sequence (Qwen3-VL's DeepStack),
fed with the original positions each layer outputs.
"""

from __future__ import annotations

import functools
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..config import FocusConfig
from ..kernels import warm_up
from ..model_adapters import ModelAdapter
from ..trace import FocusTrace
from .attention import layer_window
from .cache_lengths import report_original_length
from .calls import CallState, CallTracker, cache_length, cache_of
from .decode import Decode
from .prefill import PrefillPass
from .prune_state import EngineSetup, LayerCall, PrunedLayers, PruneState
from .pruned_loss import pruned_loss
from .pruner import Pruner
from .slicing import execution_device
from .static_decode import StaticBuffers


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
        self,
        model: nn.Module,
        adapter: ModelAdapter,
        config: FocusConfig,
        pruner: Pruner,
        video_pruner: Pruner | None = None,
    ) -> None:
        self.setup = EngineSetup.of(model, adapter, config, pruner, video_pruner)
        if pruner.decode_time and self.setup.recurrent:
            raise ValueError(
                f"pruner {pruner.name!r} picks visual keys per decoding step by masking the "
                f"others, which the linear-attention layers of '{adapter.model_type}' cannot "
                "do (they read every token they hold); use a prefill pruner"
            )
        if pruner.decode_time and any(
            layer_window(adapter, layer) is not None
            for layer in self.setup.layers[self.setup.first_layer :]
        ):
            raise ValueError(
                f"pruner={pruner.name!r} picks each decoding step's visual keys from the whole "
                "cache of the layers it prunes, but this model has sliding-window layers among "
                f"layers >= {self.setup.first_layer}, whose caches keep only their newest keys; "
                "use a prefill pruner (see vf.pruners())"
            )
        self.model = model
        self.adapter = adapter
        self.config = config
        self.pruner = pruner
        # what each layer holds in the call under way, shared with the call tracker
        self.held = PrunedLayers(self.setup.first_layer)
        # every live prefill by the cache it filled: generations may interleave on one model
        # (assisted decoding with the model as its own assistant runs two caches)
        self._states: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._static = StaticBuffers(self.setup)
        self._prefill = PrefillPass(self.setup, self._static, self._states)
        self._decode = Decode(self.setup, self._static)
        self.last_trace: FocusTrace | None = None
        self._hooks: list[Any] = []
        self.tracker: CallTracker | None = None

    @property
    def state(self) -> PruneState | None:
        """The pruned prefill the current call belongs to, or ``None``."""
        return self.held.state

    # --- lifecycle ------------------------------------------------------------------------------
    def attach(self) -> None:
        # The shared tracker reads each call first; the engine's hooks run before any probe's
        # or bias's on the same module (prepend), so those see the pruned layer inputs.
        setup = self.setup
        self.tracker = CallTracker.acquire(self.model, self.adapter)
        self.tracker.pruning = self.held  # wrap() refuses a model that is already wrapped
        self._hooks.append(self.model.register_forward_pre_hook(self._on_model, with_kwargs=True))
        self._hooks.append(self.model.register_forward_hook(self._after_model, with_kwargs=True))
        self._hooks.append(_ScoresPromptRows(self.model, self.tracker))
        if setup.first_layer == 0:
            decoder = self.adapter.decoder(self.model)
            self._hooks.append(
                decoder.register_forward_pre_hook(self._on_decoder, with_kwargs=True, prepend=True)
            )
        for index in range(setup.first_layer, len(setup.layers)):
            self._hooks.append(
                setup.layers[index].register_forward_pre_hook(
                    self._layer_hook(index), with_kwargs=True, prepend=True
                )
            )
        if self.adapter.sequence_hooks is not None:  # e.g. Qwen3-VL's DeepStack
            self._hooks.extend(self.adapter.sequence_hooks(self.model, self.held.prompt_positions))
        for pruner in setup.all_pruners:
            self._hooks.extend(pruner.attach(self.model, self.adapter))  # e.g. vision tower
        if self.config.warm_kernels and any(p.attention_based for p in setup.all_pruners):
            self._warm_kernels()

    def _warm_kernels(self) -> None:
        """Compile the score kernel for each stage layer's head layout (a no-op off CUDA)."""
        seen = set()
        for index in self.setup.stages:
            layer = self.setup.layers[index]
            attn = getattr(self.adapter.scoring_layer(self.model, index), self.adapter.attention)
            if not hasattr(attn, "q_proj"):  # a stand-in that scores without the kernel's heads
                continue
            weight = attn.q_proj.weight
            device = execution_device(layer, weight.device)
            n_heads = weight.shape[0] // attn.head_dim
            key = (n_heads, n_heads // attn.num_key_value_groups, attn.head_dim, weight.dtype)
            if device.type == "cuda" and (key, device) not in seen:
                seen.add((key, device))
                warm_up(*key[:3], dtype=key[3], device=device, reduces=(self.config.reduce,))

    def detach(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        self._static.restore()  # give pruned layers their full width back
        if self.tracker is not None:
            if self.tracker.pruning is self.held:
                self.tracker.pruning = None
            self.tracker.release()  # the encoder methods are back once nobody listens
            self.tracker = None
        self.held.state = None

    @property
    def _active(self) -> bool:
        """False while a side pass runs with the engine stood aside (``tracker.isolated()``)."""
        return self.tracker is not None and self.tracker.pruning is self.held

    # --- top-level hook: which mode this call runs in -----------------------------------------
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
            state, kwargs = self._prefill.start(tracker, cache, kwargs)
            self.held.state = state
            self.last_trace = state.trace
            return args, kwargs
        current = self.held.state
        if call.compiled:
            # a compiled step decodes the prompt that ran last, eagerly (the tracker checks its
            # cache); no lookup by cache, whose guards would recompile the step
            state = current if current is not None and current.static else None
        else:
            state = self._states.get(cache) if extends else None
        if state is not None:
            if tracker.has_images:
                # generate() sends a continued prompt's images again with its new tokens (a
                # later chat turn on a returned cache); they are already in the cache
                self._check_no_new_images(call, cache)
            self.held.state = state
            return args, self._decode.begin_step(state, call, cache, kwargs)
        if call.compiled:  # a compiled step after a text-only prompt: nothing is pruned
            self.held.state = None
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

    def _check_no_new_images(self, call: CallState, cache: Any) -> None:
        """Images whose tokens arrive on a cache that already holds tokens cannot be pruned."""
        if self.adapter.visual_mask(self.model, call.input_ids).any():
            raise ValueError(
                "vlm_focus prunes images in a prefill with an empty cache; this call brings "
                f"new image tokens onto a cache that already holds {cache_length(cache)} tokens "
                "(a later chat turn with a new image). Run the whole conversation as one prompt "
                "on a fresh cache (pass every turn and image to the processor, no "
                "past_key_values), or call handle.remove() for calls that extend a cache"
            )

    def _pass_through(self, new_prompt: bool) -> None:
        """A call without images: nothing is pruned. After a new prompt (empty cache)
        ``last_trace`` is ``None``, as before any image call, rather than still describing an
        earlier call's prefill; a step on an existing cache leaves it as it is."""
        self.held.state = None
        if new_prompt:
            self.last_trace = None

    def _after_model(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        """After a prefill: its pruned cache layers report original lengths, and the loss of
        a call with labels is taken over the kept positions."""
        state = self.held.state
        if state is None or not state.prefilling or not self._active:
            return None
        setup = self.setup
        cache = state.cache() if state.cache is not None else None
        if cache is not None and not state.static:
            for index in range(setup.first_layer, len(setup.layers)):
                if index in setup.key_sources:
                    continue  # a KV-shared layer's cache entry holds nothing
                dropped = state.full_len - state.per_layer[index].shape[1]
                if dropped and index < len(cache.layers):
                    report_original_length(cache.layers[index], dropped)
        if state.targets is None:
            return None
        state.targets, targets = None, state.targets
        if isinstance(output, tuple):  # return_dict=False: the loss comes first
            loss = pruned_loss(state, setup.last_layer, module, output[0], targets)
            return (loss, *output)
        loss = pruned_loss(state, setup.last_layer, module, output.logits, targets)
        return type(output)(**{**dict(output.items()), "loss": loss})

    # --- decoder hook (K = 0, static cache): slice the 2-D mask before masks are built --------
    def _on_decoder(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        state = self.held.state if self._active else None
        if state is None or not state.static or state.prefilling or 0 not in state.per_layer:
            return args, kwargs
        return args, self._static.decoder_inputs(state, kwargs)

    # --- layer hooks: prefill or decode ---------------------------------------------------------
    def _layer_hook(self, index: int) -> Callable:
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
            state = self.held.state
            if state is None or not self._active:
                return None
            cache = cache_of(kwargs)
            hidden = args[0] if args else kwargs["hidden_states"]
            # a static cache's length lives on the device, and a KV-shared layer holds no
            # cache: their prefill is known per call instead
            if state.static or index in self.setup.key_sources:
                prefill = state.prefilling
            else:
                prefill = cache_length(cache, index) == 0
            call = LayerCall(index, module, hidden, kwargs, cache)
            if prefill:
                hidden, kwargs = self._prefill.layer(state, call)
            else:
                kwargs = self._decode.layer(state, call)
            if args:
                return (hidden, *args[1:]), kwargs
            kwargs["hidden_states"] = hidden
            return args, kwargs

        return hook
