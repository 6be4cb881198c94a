"""Organism VLMs: small LLaVA- and Qwen2.5-VL-architecture models trained here on generated scenes.

They are the embedded default of the library's demo, `run` and `eval` commands, and a reproducible
CPU benchmark for pruning and grounding. They are test organisms, not general VLMs.

This folder is their recipe, and it lives beside the ``vlm_focus`` package, outside the wheel: a
user of the plugin never trains an organism, and the runtime (core, evaluations, demo) reaches
the shipped weights and held-out set through ``vlm_focus.asset_paths`` alone, so the weights
ship with the wheel and their recipe stays with the repository. It is importable from a clone
(an editable install puts the clone on ``sys.path``; pytest's ``pythonpath``), and
``python -m organism`` (or ``vlm-focus organism`` in a clone) trains, measures and ships.

Both architectures share one loop (:mod:`.loop`), one set of questions (:mod:`.questions`), one
vocabulary (:mod:`.vocab`), one shipping step (:mod:`.export`) and one command line; what
differs is declared per architecture in :mod:`.architectures` and lives in ``llava_train`` /
``qwen_train`` (stages and losses), ``data`` / ``qwen_data`` (model inputs), ``evaluate`` /
``qwen_eval`` (measurements) and ``card`` / ``qwen_card`` (model cards).
"""

from __future__ import annotations

from vlm_focus.asset_paths import (
    cooccur_model_path,
    deep_model_path,
    default_model_path,
    guide_model_path,
    qwen35_model_path,
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
    "qwen35_model_path",
    "qwen_model_path",
    "sample_scene_paths",
    "twohop_guide_model_path",
]
