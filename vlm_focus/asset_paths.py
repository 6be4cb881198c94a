"""The shipped assets (``vlm_focus/assets/``): the embedded models, the sample scenes and the
held-out evaluation set.

This is the one place that knows where they lie. The loaders, the CLI, the evaluations and the
demo read them through here; the organism package (their training recipe) re-exports these
functions. Everything is offline: the models are Hugging Face folders loaded with
``from_pretrained(path)``, and the held-out images are regenerated from their seeds.
"""

from __future__ import annotations

import json
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


def write_heldout_set(folder: str | Path, n_images: int | None = None) -> Path:
    """Write the held-out set into ``folder`` as a COCO-format set: ``instances.json`` and
    ``captions.json`` (the shipped files, cut to the first ``n_images`` images) and one PNG per
    image, rendered from its seed (the image id). Returns the instances path.

    The set is the first 500 held-out scenes with at least three objects, in seed order."""
    from PIL import Image

    from .eval.scenes import generate_scene

    instances = json.loads(heldout_path("instances.json").read_text())
    captions = json.loads(heldout_path("captions.json").read_text())
    available = len(instances["images"])
    if n_images is not None:
        if isinstance(n_images, bool) or not isinstance(n_images, int) or not 1 <= n_images:
            raise ValueError(f"n_images={n_images!r} must be an int >= 1")
        if n_images > available:
            raise ValueError(f"n_images={n_images}: the held-out set has {available} images")
        instances["images"] = instances["images"][:n_images]
        keep = {img["id"] for img in instances["images"]}
        instances["annotations"] = [a for a in instances["annotations"] if a["image_id"] in keep]
        captions = [c for c in captions if c["image_id"] in keep]
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    for img in instances["images"]:
        scene = generate_scene(int(img["id"]))
        Image.fromarray(scene.image()).save(folder / img["file_name"])
    path = folder / "instances.json"
    path.write_text(json.dumps(instances))
    (folder / "captions.json").write_text(json.dumps(captions))
    return path


__all__ = [
    "ASSETS",
    "CAPTION_PROMPT",
    "EMBEDDED",
    "HELDOUT_FILES",
    "deep_model_path",
    "default_model_path",
    "guide_model_path",
    "heldout_path",
    "is_embedded",
    "sample_scene_paths",
    "write_heldout_set",
]
