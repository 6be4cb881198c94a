"""Object-hallucination mitigation from a VLM's own attention, and the visual attention score.

    from vlm_focus import hallucination as hal
    with hal.attention_reweight(model, strength=1.0, layers=[0, 1]):
        model.generate(**inputs)
    with hal.visual_beam(model, weight=2.0) as proc:
        model.generate(**inputs, num_beams=3, logits_processor=[proc])
    with hal.instruction_contrast(model, inputs, generic_inputs) as proc:
        model.generate(**inputs, logits_processor=[proc])
    with hal.visual_contrast(model, inputs, branch="noise") as proc:   # VCD / M3ID
        model.generate(**inputs, logits_processor=[proc])
    hal.vas(model, inputs).overall

    with hal.mitigate(model, "visual_beam", inputs) as active:   # by name, with the defaults
        model.generate(**inputs, **active.generate_kwargs())   # that every entry point uses
    hal.mitigations()   # ['attention_reweight', 'content_free', 'instruction_contrast', ...]
    hal.mitigation_options("attention_reweight")   # each option: name, type, default, help

Each method installs instance hooks only while active and removes them on exit, under SDPA or
eager attention. A method registers like a pruner: a :class:`Mitigation` subclass with an
``Options`` dataclass, under ``@register_mitigation`` (:mod:`.registry`).
"""

# Importing each built-in registers it (``@register_mitigation`` on its class).
from ._beam import VisualBeam, VisualBeamOptions, visual_beam
from ._calibrate import CONTENT_FREE_PROMPT, ContentFree, ContentFreeOptions, content_free
from ._contrast import InstructionContrast, InstructionContrastOptions, instruction_contrast
from ._reweight import AttentionReweight, AttentionReweightOptions, attention_reweight
from ._vas import VisualAttention, vas
from ._visual_contrast import (
    VisualContrast,
    VisualContrastOptions,
    contrast_centre,
    visual_contrast,
)
from .registry import (
    Mitigation,
    get_mitigation,
    mitigate,
    mitigation_choices,
    mitigation_name,
    mitigation_options,
    mitigation_options_markdown,
    mitigations,
    register_mitigation,
)

__all__ = [
    "AttentionReweight",
    "AttentionReweightOptions",
    "CONTENT_FREE_PROMPT",
    "ContentFree",
    "ContentFreeOptions",
    "InstructionContrast",
    "InstructionContrastOptions",
    "Mitigation",
    "VisualAttention",
    "VisualBeam",
    "VisualBeamOptions",
    "VisualContrast",
    "VisualContrastOptions",
    "attention_reweight",
    "content_free",
    "contrast_centre",
    "get_mitigation",
    "instruction_contrast",
    "mitigate",
    "mitigation_choices",
    "mitigation_name",
    "mitigation_options",
    "mitigation_options_markdown",
    "mitigations",
    "register_mitigation",
    "vas",
    "visual_beam",
    "visual_contrast",
]
