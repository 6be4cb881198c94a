"""vlm_focus: attention-driven visual-token pruning, grounding and hallucination mitigation
for Hugging Face vision-language models (LLaVA, LLaVA-NeXT, Qwen2-VL, Qwen2.5-VL).

    import vlm_focus as vf
    handle = vf.wrap(model, pruner="fastv", keep=0.25, layer=2)
    model.generate(**inputs)
    handle.last_trace.kept
    handle.remove()
    found = vf.ground(model, processor, image, "red circle")  # map, point, boxes in its pixels
"""

from .api import FocusHandle, wrap
from .config import FocusConfig
from .model_adapters import ModelAdapter, register_adapter, supported_models
from .pruners import Pruner, pruner_options, pruners, register_pruner
from .trace import FocusTrace, StageTrace

__version__ = "0.1.0"


def __getattr__(name: str):
    """Subpackages, ``vf.ground`` and ``vf.mitigation_options`` are imported on first use, so
    ``import vlm_focus`` stays fast (``transformers`` and ``cv2`` load only when a feature
    needs them)."""
    if name in ("grounding", "hallucination", "geometry", "zoom", "integrations"):
        import importlib

        return importlib.import_module(f".{name}", __name__)
    if name == "ground":
        from .grounding import ground

        return ground
    if name == "mitigation_options":
        from .hallucination import mitigation_options

        return mitigation_options
    raise AttributeError(f"module 'vlm_focus' has no attribute {name!r}")


__all__ = [
    "FocusConfig",
    "FocusHandle",
    "FocusTrace",
    "ModelAdapter",
    "Pruner",
    "StageTrace",
    "__version__",
    "geometry",
    "ground",
    "grounding",
    "hallucination",
    "mitigation_options",
    "pruner_options",
    "pruners",
    "register_adapter",
    "register_pruner",
    "supported_models",
    "wrap",
]
