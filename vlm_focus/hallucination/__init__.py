"""Object-hallucination mitigation from a VLM's own attention, and the visual attention score.

    from vlm_focus import hallucination as hal
    with hal.attention_reweight(model, strength=1.0, layers=[0, 1]):
        model.generate(**inputs)
    with hal.visual_beam(model, weight=2.0) as proc:
        model.generate(**inputs, num_beams=3, logits_processor=[proc])
    with hal.instruction_contrast(model, inputs, generic_inputs) as proc:
        model.generate(**inputs, logits_processor=[proc])
    hal.vas(model, inputs).overall

    with hal.mitigate(model, "visual_beam", inputs) as active:   # by name, with the defaults
        model.generate(**inputs, **active.generate_kwargs())   # that every entry point uses
    hal.mitigations()   # ['attention_reweight', 'instruction_contrast', 'visual_beam']
    hal.mitigation_options("attention_reweight")   # each option: name, type, default, help

Each method installs instance hooks only while active and removes them on exit, under SDPA or
eager attention. A method registers like a pruner: a :class:`Mitigation` subclass with an
``Options`` dataclass, under ``@register_mitigation`` (:mod:`.registry`).
"""

# Importing each built-in registers it (``@register_mitigation`` on its class).
from ._beam import VisualBeam, VisualBeamOptions, visual_beam
from ._contrast import InstructionContrast, InstructionContrastOptions, instruction_contrast
from ._reweight import AttentionReweight, AttentionReweightOptions, attention_reweight
from ._vas import VisualAttention, vas
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
    "InstructionContrast",
    "InstructionContrastOptions",
    "Mitigation",
    "VisualAttention",
    "VisualBeam",
    "VisualBeamOptions",
    "attention_reweight",
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
]
