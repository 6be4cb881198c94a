"""Organism VLMs: small LLaVA-architecture models trained here on generated scenes.

They are the embedded default of the library's demo, `run` and `eval` commands, and a reproducible
CPU benchmark for pruning and grounding. They are test organisms, not general VLMs.
"""

from __future__ import annotations

from pathlib import Path

_ASSETS = Path(__file__).resolve().parent.parent / "assets"


def default_model_path() -> Path:
    """Folder of the default organism model (12 x 12 visual tokens), HF format."""
    return _ASSETS / "organism-default"


def guide_model_path() -> Path:
    """Folder of the small guide model (6 x 6 visual tokens), HF format."""
    return _ASSETS / "organism-guide"


def deep_model_path() -> Path:
    """Folder of the deep model (12 x 12 visual tokens, 8 LM layers, two-hop family), HF format."""
    return _ASSETS / "organism-deep"


def sample_scene_paths() -> list[Path]:
    """Bundled sample scene PNGs (held-out scenes), sorted by name."""
    return sorted((_ASSETS / "samples").glob("*.png"))


def build_prompt(question: str) -> str:
    """The model's chat-format prompt for one image and one question (ends with 'ASSISTANT:').

    Equal to `processor.apply_chat_template` with an image and the question as one user turn.
    """
    return f"<bos>USER: <image>\n{question} ASSISTANT:"


__all__ = [
    "build_prompt",
    "deep_model_path",
    "default_model_path",
    "guide_model_path",
    "sample_scene_paths",
]
