"""POPE question files for the generated held-out set.

The questions are built by `vlm_focus.eval.pope` (the POPE rules) from the scenes' COCO instances;
images need >= 3 objects. Parsing and metrics are `vlm_focus.eval.metrics`'.
"""

from __future__ import annotations

import json
from pathlib import Path

from vlm_focus.eval.metrics import parse_yes_no, pope_metrics
from vlm_focus.eval.pope import SPLITS, build_questions

from .scenes import Scene, coco_instances, heldout_scenes, write_dataset

__all__ = ["SPLITS", "parse_yes_no", "pope_eligible", "pope_metrics", "pope_questions"]


def pope_questions(
    scenes: list[Scene], split: str, seed: int = 0, per_image: int = 3
) -> list[dict]:
    """POPE rows `{question_id, image_id, image, text, label, category, category_id}` for one
    split, built by `vlm_focus.eval.pope.build_questions` from the scenes' COCO instances."""
    eligible = [s for s in scenes if len(s.objects) >= per_image]
    return build_questions(
        coco_instances(eligible),
        split,
        n_images=max(len(eligible), 1),
        per_image=per_image,
        seed=seed,
    )


def pope_eligible(n: int) -> list[Scene]:
    """The held-out POPE image set: the first n held-out scenes with >= 3 objects."""
    return heldout_scenes(n, min_objects=3)


def write_heldout(out_dir: Path, n: int = 500, images: bool = True) -> None:
    """Write the held-out POPE set: PNGs, instances.json, captions.json and pope_<split>.jsonl."""
    out_dir = Path(out_dir)
    scenes = pope_eligible(n)
    write_dataset(scenes, out_dir, images=images)
    for split in SPLITS:
        rows = pope_questions(scenes, split)
        text = "".join(json.dumps(r) + "\n" for r in rows)
        (out_dir / f"pope_{split}.jsonl").write_text(text)
