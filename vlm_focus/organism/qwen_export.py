"""Ship organism-qwen into `vlm_focus/assets/organism-qwen`: HF files, metrics and card."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from ..asset_paths import qwen_model_path
from .export import HF_FILES
from .qwen_card import model_card


def ship_qwen(train_dir: Path, metrics: dict, dest: Path | None = None) -> Path:
    """Copy `train_dir`'s files to `dest` (default: the shipped folder) with metrics.json and
    the model card README.md."""
    dest = Path(dest or qwen_model_path())
    dest.mkdir(parents=True, exist_ok=True)
    for name in HF_FILES:  # the ones a run wrote (organism-qwen draws no curves)
        if (Path(train_dir) / name).exists():
            shutil.copy2(Path(train_dir) / name, dest / name)
    (dest / "metrics.json").write_text(json.dumps(metrics, indent=1))
    (dest / "README.md").write_text(model_card(metrics, dest))
    return dest
