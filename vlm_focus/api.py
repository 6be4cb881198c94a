"""``wrap()``: one call that makes an unmodified HF VLM prune its visual tokens, and its undo."""

from __future__ import annotations

import dataclasses
from typing import Any

from torch import nn

from .config import FocusConfig
from .core.engine import FocusEngine
from .model_adapters import ModelAdapter, get_adapter, supported_models
from .pruners import get_pruner, video_pruner_class
from .trace import FocusTrace

_HANDLE_ATTR = "_vlm_focus_handle"
_CONFIG_FIELDS = {f.name for f in dataclasses.fields(FocusConfig)} - {"options"}


class FocusHandle:
    """Returned by :func:`wrap`. ``remove()`` (or leaving a ``with`` block) takes every hook off
    the model, after which it computes exactly what it did before wrapping."""

    def __init__(self, model: nn.Module, engine: FocusEngine) -> None:
        self.model = model
        self.config = engine.config
        self._engine: FocusEngine | None = engine
        self._final_trace: FocusTrace | None = None

    @property
    def last_trace(self) -> FocusTrace | None:
        """What the last prefill with images did while this handle was attached (``None``
        before the first one); still readable after ``remove()``, when it describes the last
        pruned run, and a removed handle cannot be entered again."""
        return self._engine.last_trace if self._engine is not None else self._final_trace

    @property
    def active(self) -> bool:
        return self._engine is not None

    def remove(self) -> None:
        """Remove all hooks. Idempotent."""
        if self._engine is None:
            return
        self._final_trace = self._engine.last_trace
        self._engine.detach()
        self._engine = None
        if getattr(self.model, _HANDLE_ATTR, None) is self:
            delattr(self.model, _HANDLE_ATTR)

    def __enter__(self) -> FocusHandle:
        if not self.active:
            raise ValueError(
                "this FocusHandle was removed (a `with` block or remove() ended it), so its "
                "model is no longer pruned; call vf.wrap(model, ...) again for a new handle"
            )
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def __repr__(self) -> str:
        state = "active" if self.active else "removed"
        return f"FocusHandle({type(self.model).__name__}, {self.config}, {state})"


def wrap(model: nn.Module, config: FocusConfig | None = None, **options: Any) -> FocusHandle:
    """Prune visual tokens inside ``model``'s language model; returns a :class:`FocusHandle`.

    ``options`` are :class:`FocusConfig` fields (``pruner``, ``keep``, ``layer``, ``query_rows``,
    ``reduce``, ``budget``, ``positions``, ``video_pruner``) and the chosen pruner's own
    options; a prompt that carries a video runs :attr:`FocusConfig.pruner_for_video`. The model
    object is patched in place with instance hooks only. Wrapping an already wrapped model raises
    ``ValueError``: call ``handle.remove()`` first.

    Example::

        handle = vf.wrap(model, pruner="fastv", keep=0.25, layer=2)
        out = model.generate(**inputs, max_new_tokens=32)
        handle.last_trace.kept, handle.remove()
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"wrap() expects a transformers model (nn.Module), got {type(model)}")
    adapter = get_adapter(model)
    if config is not None and not isinstance(config, FocusConfig):
        raise TypeError(f"config must be a FocusConfig, got {type(config).__name__}")
    if getattr(model, _HANDLE_ATTR, None) is not None:
        raise ValueError(
            "this model is already wrapped; call handle.remove() before wrapping again"
        )
    config = _build_config(config, options)
    pruner_cls = get_pruner(config.pruner)
    try:
        pruner_options = pruner_cls.Options(**config.options)
    except TypeError as err:
        allowed = sorted(_CONFIG_FIELDS | set(pruner_cls.option_names()))
        raise ValueError(
            f"unknown option for pruner '{config.pruner}': {sorted(config.options)}; "
            f"allowed: {', '.join(allowed)}"
        ) from err
    n_layers = len(adapter.decoder_layers(model))
    for layer, _ in config.stages:
        if layer >= n_layers:
            raise ValueError(
                f"layer={layer} is out of range: this model has layers [0, {n_layers})"
            )
    adapter.check(model, [layer for layer, _ in config.stages])
    if config.positions == "compact":
        _check_compact(config, adapter)
    video_cls = video_pruner_class(config)  # the pruner of prompts with a video, if another
    video_pruner = None if video_cls is None else video_cls(config, video_cls.Options())
    engine = FocusEngine(
        model, adapter, config, pruner_cls(config, pruner_options), video_pruner=video_pruner
    )
    engine.attach()
    handle = FocusHandle(model, engine)
    setattr(model, _HANDLE_ATTR, handle)
    return handle


def _check_compact(config: FocusConfig, adapter: ModelAdapter) -> None:
    """``positions="compact"`` renumbers the prompt that every layer sees, which is the pruned
    prompt's own numbering only when nothing ran on the full prompt first (one stage at layer 0)
    and the model counts positions in 1-D."""
    if [layer for layer, _ in config.stages] != [0]:
        raise ValueError(
            f"positions='compact' supports one pruning stage at layer=0 (pruning before the "
            f"first decoder layer), got layer={config.layer!r}; use positions='original' for "
            "other schedules"
        )
    if adapter.mask_rule != "causal" or adapter.attention_window is not None:
        raise ValueError(
            f"positions='compact' renumbers the kept tokens, but '{adapter.model_type}' masks "
            "attention by position (sliding windows, image blocks), which vlm_focus keeps in "
            "original positions; use positions='original'"
        )
    if not adapter.consecutive_positions:
        allowed = ", ".join(supported_models(consecutive_positions=True))
        raise ValueError(
            f"positions='compact' supports models with 1-D RoPE positions ({allowed}); "
            f"'{adapter.model_type}' positions visual tokens by their grid cells (M-RoPE): use "
            "positions='original'"
        )


def _build_config(config: FocusConfig | None, options: dict[str, Any]) -> FocusConfig:
    # field by field, not dataclasses.asdict: that deep-copies the options, and a pruner's
    # options may hold live objects (guided's guide model and its guide_inputs callback)
    fields = dataclasses.fields(FocusConfig)
    base = {f.name: getattr(config, f.name) for f in fields} if config is not None else {}
    extra = dict(base.pop("options", {}) or {})
    for key, value in options.items():
        if key in _CONFIG_FIELDS:
            base[key] = value
        else:
            extra[key] = value
    return FocusConfig(**base, options=extra)
