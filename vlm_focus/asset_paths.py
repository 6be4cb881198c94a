"""The shipped assets (``vlm_focus/assets/``): the embedded models, the sample scenes and the
held-out evaluation set.

This is the one place that knows where they lie. The loaders, the CLI, the evaluations and the
demo read them through here; the organism package (their training recipe) re-exports these
functions. Everything is offline: the models are Hugging Face folders loaded with
``from_pretrained(path)``, and the held-out images are regenerated from their seeds
(:func:`vlm_focus.eval.scenes.write_heldout_set`).
"""

from __future__ import annotations

from pathlib import Path

ASSETS = Path(__file__).resolve().parent / "assets"
#: The name that stands for the embedded default model wherever a model path is taken.
EMBEDDED = "embedded"
#: The prompt the embedded models were trained to caption with (``vlm-focus run``'s default).
CAPTION_PROMPT = "Describe the image."
#: The held-out set's files: COCO instances and captions, and the POPE questions per split.
HELDOUT_FILES = (
    "instances.json",
    "captions.json",
    "pope_random.jsonl",
    "pope_popular.jsonl",
    "pope_adversarial.jsonl",
)


def default_model_path() -> Path:
    """Folder of the default organism model (12 x 12 visual tokens), HF format."""
    return ASSETS / "organism-default"


def guide_model_path() -> Path:
    """Folder of the small guide model (6 x 6 visual tokens), HF format."""
    return ASSETS / "organism-guide"


def deep_model_path() -> Path:
    """Folder of the deep model (12 x 12 visual tokens, 8 LM layers, two-hop family), HF format."""
    return ASSETS / "organism-deep"


def twohop_guide_model_path() -> Path:
    """Folder of the deep model's two-hop guide (8 x 8 visual tokens, 4 LM layers), HF format."""
    return ASSETS / "organism-twohop-guide"


def cooccur_model_path() -> Path:
    """Folder of the co-occurrence organism (the guide fine-tuned on a co-occurrence prior, so
    that it hallucinates an anchor's companion), HF format."""
    return ASSETS / "organism-cooccur"


def prior_model_path() -> Path:
    """organism-prior: organism-deep with a co-occurrence prior learned by its language model
    from text, for measuring hallucination mitigation."""
    return ASSETS / "organism-prior"


def qwen_model_path() -> Path:
    """Folder of organism-qwen (a Qwen2.5-VL at dynamic resolution, images and video), HF format."""
    return ASSETS / "organism-qwen"


def qwen35_model_path() -> Path:
    """Folder of organism-qwen35 (a Qwen3.5: the hybrid Gated-DeltaNet decoder, images at
    dynamic resolution and clips), HF format. Load its processor with
    :func:`vlm_focus.loading.load_processor` (or ``load_model``): its tokenizer is word-level."""
    return ASSETS / "organism-qwen35"


def is_embedded(model: str | Path | None) -> bool:
    """True for ``None`` and ``"embedded"``: the shipped default model."""
    return model is None or str(model) == EMBEDDED


def sample_scene_paths() -> list[Path]:
    """Bundled sample scene PNGs (held-out scenes), sorted by name."""
    return sorted((ASSETS / "samples").glob("*.png"))


def heldout_path(name: str) -> Path:
    """One file of the shipped held-out set (see :data:`HELDOUT_FILES`)."""
    if name not in HELDOUT_FILES:
        allowed = ", ".join(HELDOUT_FILES)
        raise ValueError(f"name={name!r} is not a held-out file; allowed: {allowed}")
    path = ASSETS / "heldout" / name
    if not path.is_file():
        raise FileNotFoundError(f"the held-out file is missing at {path}; reinstall vlm-focus")
    return path


__all__ = [
    "ASSETS",
    "CAPTION_PROMPT",
    "EMBEDDED",
    "HELDOUT_FILES",
    "cooccur_model_path",
    "deep_model_path",
    "default_model_path",
    "guide_model_path",
    "heldout_path",
    "is_embedded",
    "prior_model_path",
    "sample_scene_paths",
]
