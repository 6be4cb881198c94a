"""Model adapters: one per ``config.model_type``, kept as data in a registry.

Third parties add support for another VLM with :func:`register_adapter`.
"""

from __future__ import annotations

from torch import nn

from .base import ImageLayout, ModelAdapter, merge_views
from .gemma3 import GEMMA3
from .gemma4 import GEMMA4
from .internvl import INTERNVL
from .llava import LLAVA
from .llava_next import LLAVA_NEXT
from .llava_onevision import LLAVA_ONEVISION
from .qwen2_vl import QWEN2_5_VL, QWEN2_VL
from .qwen3_5 import QWEN3_5, QWEN3_5_MOE
from .qwen3_vl import QWEN3_VL, QWEN3_VL_MOE

__all__ = [
    "ImageLayout",
    "ModelAdapter",
    "get_adapter",
    "merge_views",
    "register_adapter",
    "supported_models",
]

_ADAPTERS: dict[str, ModelAdapter] = {}


def register_adapter(adapter: ModelAdapter, *, replace: bool = False) -> None:
    """Register ``adapter`` for its ``model_type``. Re-registering a type needs ``replace=True``."""
    if not isinstance(adapter, ModelAdapter):
        raise TypeError(f"expected a ModelAdapter, got {type(adapter).__name__}")
    name = adapter.model_type
    if not isinstance(name, str) or not name:
        raise ValueError(f"adapter model_type must be a non-empty string, got {name!r}")
    if name in _ADAPTERS and not replace:
        raise ValueError(f"an adapter for '{name}' is already registered (pass replace=True)")
    _ADAPTERS[name] = adapter


def supported_models(
    *,
    consecutive_positions: bool | None = None,
    video: bool | None = None,
    static_cache: bool | None = None,
) -> list[str]:
    """The model types with a registered adapter (with ``consecutive_positions``, ``video`` or
    ``static_cache``, those whose adapter declares it so)."""
    return sorted(
        name
        for name, adapter in _ADAPTERS.items()
        if consecutive_positions in (None, adapter.consecutive_positions)
        and video in (None, adapter.video)
        and static_cache in (None, adapter.static_cache)
    )


def get_adapter(model: nn.Module) -> ModelAdapter:
    """The adapter for ``model.config.model_type``; ``ValueError`` listing the supported ones."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in _ADAPTERS:
        raise ValueError(
            f"unsupported model type {model_type!r} ({type(model).__name__}); supported: "
            f"{', '.join(supported_models())}. Register one with vlm_focus.register_adapter()."
        )
    return _ADAPTERS[model_type]


for _adapter in (
    LLAVA,
    LLAVA_NEXT,
    LLAVA_ONEVISION,
    QWEN2_VL,
    QWEN2_5_VL,
    QWEN3_VL,
    QWEN3_VL_MOE,
    INTERNVL,
    QWEN3_5,  # hybrid decoders (linear-attention layers)
    QWEN3_5_MOE,
):
    register_adapter(_adapter)
register_adapter(GEMMA3)
register_adapter(GEMMA4)
