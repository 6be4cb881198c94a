"""Ship a trained organism model of either architecture into `vlm_focus/assets/`: HF files,
metrics, card and (where measured) the fixed questions."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from vlm_focus.asset_paths import ASSETS

from .architectures import saved_architecture
from .pope import pope_eligible, pope_questions, write_heldout
from .scenes import heldout_scenes

HF_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "processor_config.json",
    "chat_template.jinja",
    "learning_curves.png",
    "train_summary.json",
    "train_log.jsonl",
)


def fixed_questions(n_images: int = 500) -> list[dict]:
    """20 POPE random-split rows spread over the held-out set (the shipped-model test set)."""
    rows = pope_questions(pope_eligible(n_images), "random")
    step = len(rows) // 20
    return [rows[i * step + (i % 6)] for i in range(20)]


def ship(train_dir: Path, name: str, metrics: dict, dest: Path | None = None) -> Path:
    """Copy `train_dir`'s HF files to `dest` (default assets/organism-<name>) with metrics.json,
    fixed_questions.json (reported accuracy = the model's accuracy on those 20 questions) and
    the model card README.md (the card of the architecture saved in `train_dir`)."""
    model_card = saved_architecture(train_dir).part("model_card")
    dest = Path(dest or ASSETS / f"organism-{name}")
    dest.mkdir(parents=True, exist_ok=True)
    for f in HF_FILES:  # the ones the run wrote (organism-qwen draws no curves)
        if (Path(train_dir) / f).exists():
            shutil.copy2(Path(train_dir) / f, dest / f)
    (dest / "metrics.json").write_text(json.dumps(metrics, indent=1))
    fixed = metrics.get("fixed_questions")
    if fixed is not None:
        if "accuracy_here" in fixed:  # older metrics files: reported = POPE random accuracy
            fixed = dict(fixed, pope_random_accuracy=fixed["reported_accuracy"])
            fixed["reported_accuracy"] = fixed.pop("accuracy_here")
        (dest / "fixed_questions.json").write_text(json.dumps(fixed, indent=1))
    (dest / "README.md").write_text(model_card(name, metrics, dest))
    return dest


def ship_heldout(n: int = 500) -> None:
    """Held-out COCO json, captions and POPE files (no PNGs: scenes regenerate from their seeds)
    plus four sample PNGs for the demo."""
    from PIL import Image

    write_heldout(ASSETS / "heldout", n=n, images=False)
    samples = ASSETS / "samples"
    samples.mkdir(parents=True, exist_ok=True)
    for s in heldout_scenes(8, min_objects=3)[:4]:
        Image.fromarray(s.image()).save(samples / f"scene_{s.seed}.png")
