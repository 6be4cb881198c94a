"""Organism VLMs: small LLaVA- and Qwen2.5-VL-architecture models trained here on generated scenes.

They are the embedded default of the library's demo, `run` and `eval` commands, and a reproducible
CPU benchmark for pruning and grounding. They are test organisms, not general VLMs.
"""

from __future__ import annotations

from vlm_focus.asset_paths import (
    cooccur_model_path,
    deep_model_path,
    default_model_path,
    guide_model_path,
    qwen_model_path,
    sample_scene_paths,
    twohop_guide_model_path,
)


def build_prompt(question: str) -> str:
    """The model's chat-format prompt for one image and one question (ends with 'ASSISTANT:').

    Equal to `processor.apply_chat_template` with an image and the question as one user turn.
    """
    return f"<bos>USER: <image>\n{question} ASSISTANT:"


__all__ = [
    "build_prompt",
    "cooccur_model_path",
    "deep_model_path",
    "default_model_path",
    "guide_model_path",
    "qwen_model_path",
    "sample_scene_paths",
    "twohop_guide_model_path",
]
