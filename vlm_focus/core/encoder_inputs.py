"""Record the image inputs that ``generate()`` hands to the image encoder but not to ``forward``.

``generate()`` encodes images before prefill and then drops ``image_sizes`` / ``image_grid_thw``
(and ``pixel_values``) from the forward call, so anything that lays out visual tokens during
``generate()`` reads them on the way into the adapter's ``encoders`` methods instead.

Several listeners (a pruning handle, a grounding probe, a mitigation) may watch one model at
once: the encoder methods are wrapped once per model instance, each listener gets its own
``recorded`` dict, and the instance attribute is dropped when the last listener closes.
"""

from __future__ import annotations

import functools
import inspect
import threading
import weakref
from typing import Any

from torch import nn

from ..model_adapters import ModelAdapter

# owner module -> {method name: list of live listeners}
_LISTENERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class EncoderInputs:
    """One listener: ``recorded`` holds the latest layout inputs seen by the encoders."""

    def __init__(self, model: nn.Module, adapter: ModelAdapter) -> None:
        self.adapter = adapter
        self.recorded: dict[str, Any] = {}
        #: what the last prefill took: a later call with the same encoder outputs reuses it
        self.last: dict[str, Any] = {}
        self._owner = getattr(model, "base_model", model)
        self._names: list[str] = []
        if not adapter.layout_inputs:
            return
        per_owner = _LISTENERS.setdefault(self._owner, {})
        for name in adapter.encoders:
            if name not in per_owner:
                method = getattr(self._owner, name, None)
                if method is None:
                    continue
                per_owner[name] = []
                self._owner.__dict__[name] = _recording(method, per_owner[name])
            per_owner[name].append(self)
            self._names.append(name)

    def take(self) -> dict[str, Any]:
        """The recorded inputs, cleared (one prefill consumes them)."""
        out = dict(self.recorded)
        self.recorded.clear()
        if out:
            self.last = out
        return dict(out)

    def close(self) -> None:
        per_owner = _LISTENERS.get(self._owner, {})
        for name in self._names:
            listeners = per_owner.get(name, [])
            if self in listeners:
                listeners.remove(self)
            if not listeners and name in per_owner:
                del per_owner[name]
                self._owner.__dict__.pop(name, None)  # the class method is back
        self._names.clear()


_DEPTH = threading.local()  # encoder calls in progress on this thread


def _recording(method: Any, listeners: list[EncoderInputs]) -> Any:
    signature = inspect.signature(method)

    def recording(*args: Any, **kwargs: Any) -> Any:
        # Only the outermost call speaks for the inputs: Qwen3-VL's get_video_features calls
        # get_image_features(videos, video_grid_thw), which must not pass for image inputs.
        depth = getattr(_DEPTH, "value", 0)
        if depth == 0:
            bound = signature.bind_partial(*args, **kwargs).arguments
            for listener in listeners:
                for key in listener.adapter.layout_inputs:
                    if bound.get(key) is not None:
                        listener.recorded[key] = bound[key]
        _DEPTH.value = depth + 1
        try:
            return method(*args, **kwargs)
        finally:
            _DEPTH.value = depth

    return functools.wraps(method)(recording)
