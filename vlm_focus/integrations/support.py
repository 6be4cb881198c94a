"""The support matrix: what each model class runs, read from the registries.

One row per ``model_type`` that :func:`vlm_focus.supported_models` lists. Images and several
images per prompt run on every registered class (the tests' reference suites cover each); video
and the static cache come from the adapter (``ModelAdapter.video``,
``ModelAdapter.static_cache``); the lmms-eval and vLLM columns come from each integration's
own table (``lmms_eval.DELEGATES``, ``vllm.MODELS`` and ``vllm.NOT_SERVED``), so a class one
of them leaves out says so here with the reason.
"""

from __future__ import annotations

from ..model_adapters import supported_models


def _lmms_eval_cell(model_type: str) -> str:
    from .lmms_eval import DELEGATES

    delegate = DELEGATES[model_type]
    if delegate.class_path is None:
        return "—"
    module, _, cls = delegate.class_path.rpartition(".")
    batch = "any batch" if delegate.max_batch is None else f"batch {delegate.max_batch}"
    return f"`{module.removeprefix('lmms_eval.models.')}.{cls}`, {batch}"


def _vllm_cell(model_type: str) -> str:
    from .vllm import MODELS

    model = MODELS.get(model_type)
    if model is None:
        return "—"
    if model.one_image_only:
        return "one image per prompt"
    if not model.video_budgets:
        return "images"
    return f"images and videos (`budget`: {', '.join(model.video_budgets)})"


def support_matrix() -> str:
    """The support matrix as a Markdown table (the README's, generated from this function)."""
    lines = [
        "| `model_type` | images | several images | video | static cache | lmms-eval "
        "| vLLM plugin |",
        "|---|---|---|---|---|---|---|",
    ]
    videos = set(supported_models(video=True))
    static = set(supported_models(static_cache=True))
    for model_type in supported_models():
        video = "yes" if model_type in videos else "—"
        cache = "yes" if model_type in static else "—"
        cells = ["yes", "yes", video, cache, _lmms_eval_cell(model_type), _vllm_cell(model_type)]
        lines.append(f"| `{model_type}` | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
