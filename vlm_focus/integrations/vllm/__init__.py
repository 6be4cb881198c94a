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
``N`` the prompt's image tokens; a count above ``N`` keeps all ``N``, since one server-wide count
serves prompts of every size), shared out by ``budget="frame"``'s rule. The model scores each
image before the LLM (:data:`SERVED` lists each class's pruners: the attention pruners score with
layer 0 of vLLM's own decoder over the unpruned prompt; ``pool`` is spatially uniform;
``pyramid`` is PTP's bottom-up saliency, the embedding norm) and returns exactly the kept
embeddings, in prompt order, each at its original position (:data:`POSITIONS`: the LLaVA classes
can also serve them consecutively, ``positions="compact"``). This equals ``vf.wrap(model,
pruner=..., keep=..., layer=0, budget="frame", positions=...)`` in transformers (``alpha=0`` for
``pyramid``), where a count above the prompt's tokens raises instead.

The Qwen-VL classes also prune videos (:data:`VIDEO_BUDGETS`): a prompt with one video keeps
``keep_count(keep, N, clamp=True)`` of its ``N`` tokens, every frame the same share
(``budget="frame"``) or wherever the pruner chooses (``budget="span"``, where the video's tokens
form one run in the prompt), each kept token at its original M-RoPE position; the reference is
``vf.wrap(model, pruner=..., keep=..., layer=0, budget=...)``.

The vLLM side imports torch, vLLM and vlm_focus's model-free code (keep's rule, the pruners and
their scoring math); it never runs vlm_focus's transformers code (vLLM pins an older
transformers than vlm_focus supports).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from ...config import KEEP_RULE, parse_keep
from ._positions import CONFIG_KEY  # the settings' key in the HF config (--hf-overrides)

#: Every pruner some class serves (each class serves those :data:`SERVED` lists for it).
PRUNERS = ("pool", "pyramid", "fastv", "text", "debiased")

#: Per-request keys of ``mm_processor_kwargs``.
REQUEST_KEYS = ("vlm_focus_pruner", "vlm_focus_keep", "vlm_focus_budget")
#: What ``budget`` may say: how a video's kept tokens are shared out over its frames.
BUDGETS = ("frame", "span")
#: What ``positions`` may say: where the kept tokens sit for the LLM's RoPE. ``"original"``:
#: where they sat in the unpruned prompt, and every later token (text, decoding) as if nothing
#: had been pruned (``vf.wrap``'s default); ``"compact"``: consecutively, as vLLM numbers any
#: prompt of 1-D RoPE (``vf.wrap(..., positions="compact")``).
POSITIONS = ("original", "compact")
#: ``model_type`` -> (vLLM's architecture, the plugin's pruning architecture).
ARCHITECTURES = {
    "qwen2_5_vl": (
        "Qwen2_5_VLForConditionalGeneration",
        "VlmFocusQwen2_5_VLForConditionalGeneration",
    ),
    "qwen3_vl": ("Qwen3VLForConditionalGeneration", "VlmFocusQwen3VLForConditionalGeneration"),
    "llava": ("LlavaForConditionalGeneration", "VlmFocusLlavaForConditionalGeneration"),
    "llava_next": (
        "LlavaNextForConditionalGeneration",
        "VlmFocusLlavaNextForConditionalGeneration",
    ),
    "llava_onevision": (
        "LlavaOnevisionForConditionalGeneration",
        "VlmFocusLlavaOnevisionForConditionalGeneration",
    ),
}
#: ``model_type`` -> the pruners its class serves and the positions it serves them at, the
#: defaults first (Qwen-VL's M-RoPE positions are always the original ones).
SERVED = {
    "qwen2_5_vl": (("fastv", "text", "debiased", "pyramid", "pool"), ("original",)),
    "qwen3_vl": (("fastv", "text", "debiased", "pyramid", "pool"), ("original",)),
    "llava": (("fastv", "text", "debiased", "pool"), POSITIONS),
    "llava_next": (("fastv", "text", "debiased", "pool"), POSITIONS),
    "llava_onevision": (("fastv", "text", "debiased", "pool"), POSITIONS),
}
#: ``model_type`` -> the budgets its class prunes videos with, the default first (a class not
#: listed serves images only). Qwen3-VL writes a timestamp before every frame, so a frame's
#: placeholder count is fixed before the encoder runs: only ``"frame"`` can fix it.
VIDEO_BUDGETS = {"qwen2_5_vl": ("frame", "span"), "qwen3_vl": ("frame",)}
#: Pruners that choose a video's tokens (``pyramid``'s pre-LLM variant reads one image grid).
VIDEO_PRUNERS = ("fastv", "text", "debiased", "pool")
_CLASSES = {
    "VlmFocusQwen2_5_VLForConditionalGeneration": (
        f"{__name__}._qwen2_5_vl:VlmFocusQwen2_5_VLForConditionalGeneration"
    ),
    "VlmFocusQwen3VLForConditionalGeneration": (
        f"{__name__}._qwen3_vl:VlmFocusQwen3VLForConditionalGeneration"
    ),
    "VlmFocusLlavaForConditionalGeneration": (
        f"{__name__}._llava:VlmFocusLlavaForConditionalGeneration"
    ),
    "VlmFocusLlavaNextForConditionalGeneration": (
        f"{__name__}._llava_next:VlmFocusLlavaNextForConditionalGeneration"
    ),
    "VlmFocusLlavaOnevisionForConditionalGeneration": (
        f"{__name__}._llava_onevision:VlmFocusLlavaOnevisionForConditionalGeneration"
    ),
}


@dataclass
class ServeOptions:
    """The plugin's settings for one server (the ``vlm_focus`` key of the HF config)."""

    pruner: str | None = field(
        default=None,
        metadata={"help": f"one of {PRUNERS} that the class serves (None: the class's default)"},
    )
    keep: float | int = field(
        default=0.25, metadata={"help": f"tokens each image keeps: {KEEP_RULE}"}
    )
    budget: str = field(
        default="frame",
        metadata={
            "help": "a video's share-out: 'frame' = every frame keeps the same share, 'span' = "
            "the pruner chooses where (the classes that take it: VIDEO_BUDGETS)",
            "choices": BUDGETS,
        },
    )
    tiles: int = field(default=2, metadata={"help": "pyramid: regions per side of the grid"})
    min_per_region: int = field(default=1, metadata={"help": "pyramid: tokens every region keeps"})
    positions: str | None = field(
        default=None,
        metadata={
            "help": "where kept tokens sit for the RoPE: 'original' (as unpruned) or 'compact' "
            "(consecutive); None: the class's default (SERVED)",
            "choices": POSITIONS,
        },
    )

    def __post_init__(self) -> None:
        self.keep = check_request(self.pruner or PRUNERS[0], self.keep)
        check_budget(self.budget)
        if self.positions is not None:
            check_positions(self.positions)
        for name, low in (("tiles", 1), ("min_per_region", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{CONFIG_KEY}.{name}={value!r} must be an int >= {low}")

    @classmethod
    def from_config(cls, value: Any) -> ServeOptions:
        """From the ``vlm_focus`` entry of an HF config (a dict, or an object with fields)."""
        if value is None:
            raise ValueError(
                f"the model config has no '{CONFIG_KEY}' entry: pass --hf-overrides "
                f'\'{{"{CONFIG_KEY}": {{"pruner": "pyramid", "keep": 0.25}}}}\''
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

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def check_request(pruner: Any, keep: Any, pruners: tuple[str, ...] = PRUNERS) -> float | int:
    """``keep`` as :func:`vlm_focus.config.parse_keep` reads it; ``ValueError`` for a pruner
    (not among ``pruners``, those the class serves) or keep the plugin cannot run. An image then
    keeps ``keep_count(keep, n, clamp=True)`` of its ``n`` tokens
    (:func:`vlm_focus.config.keep_count`: a count above ``n`` keeps all ``n``)."""
    if pruner not in pruners:
        raise ValueError(f"vlm_focus pruner={pruner!r} is not one of {tuple(pruners)}")
    return parse_keep(keep)


def check_budget(budget: Any, budgets: tuple[str, ...] = BUDGETS) -> str:
    """``budget`` if it is one of ``budgets`` (those a class serves videos with), else a
    ``ValueError`` that names it."""
    if budget not in budgets:
        raise ValueError(f"vlm_focus budget={budget!r} is not one of {tuple(budgets)}")
    return budget


def check_positions(positions: Any, served: tuple[str, ...] = POSITIONS) -> str:
    """``positions`` if it is one of ``served`` (those a class serves), else a ``ValueError``
    that names it."""
    if positions not in served:
        raise ValueError(f"vlm_focus positions={positions!r} is not one of {tuple(served)}")
    return positions


def hf_overrides(model_type: str, **options: Any) -> dict[str, Any]:
    """``--hf-overrides`` for a model of ``model_type`` served pruned with ``options``
    (:class:`ServeOptions` fields)."""
    if model_type not in ARCHITECTURES:
        raise ValueError(
            f"the vLLM plugin has no pruning class for model_type={model_type!r}; "
            f"supported: {sorted(ARCHITECTURES)}"
        )
    settings = ServeOptions(**options)
    served, positions = SERVED[model_type]
    settings.pruner = settings.pruner or served[0]
    check_request(settings.pruner, settings.keep, served)
    settings.positions = check_positions(settings.positions or positions[0], positions)
    return {"architectures": [ARCHITECTURES[model_type][1]], CONFIG_KEY: settings.to_dict()}


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
    for name, path in _CLASSES.items():
        if name not in known:
            ModelRegistry.register_model(name, path)
    for model_type, (_, positions) in SERVED.items():
        if "compact" in positions:
            MODELS_CONFIG_MAP.setdefault(ARCHITECTURES[model_type][1], OriginalPositionsConfig)


__all__ = [
    "ARCHITECTURES",
    "BUDGETS",
    "CONFIG_KEY",
    "POSITIONS",
    "PRUNERS",
    "REQUEST_KEYS",
    "SERVED",
    "ServeOptions",
    "VIDEO_BUDGETS",
    "VIDEO_PRUNERS",
    "check_budget",
    "check_positions",
    "check_request",
    "hf_overrides",
    "recorded_kept",
    "register",
]
