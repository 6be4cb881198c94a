"""Evaluation data: a COCO-format set (image folder + instances json + optional captions json),
either the user's (``--images``, ``--instances``, ``--captions``) or the shipped held-out set of
the embedded models (:mod:`vlm_focus.asset_paths`), written once into the output folder with its
images rendered from their seeds."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

EMBEDDED_IMAGES = 500  # the organism's fixed held-out set: the first 500 scenes with >= 3 objects


@dataclass
class CocoSet:
    """A COCO-format set. ``instances`` is the parsed json; ``captions`` maps image id to its
    reference captions (may be empty)."""

    images_dir: Path
    instances_path: Path
    instances: dict
    captions: dict[int, list[str]] = field(default_factory=dict)
    name: str = "coco"

    def __post_init__(self) -> None:
        self.images_by_id = {img["id"]: img for img in self.instances["images"]}
        self.category_names = {c["id"]: c["name"] for c in self.instances["categories"]}

    def image_path(self, image_id: int) -> Path:
        return self.images_dir / self.images_by_id[image_id]["file_name"]

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "images_dir": str(self.images_dir),
            "instances": str(self.instances_path),
            "n_images": len(self.images_by_id),
            "n_categories": len(self.category_names),
        }


def check_instances(data: Any, path: Path | str) -> dict:
    """A parsed COCO instances dict, checked for the fields the evaluation reads."""
    if not isinstance(data, dict):
        raise ValueError(f"{path}: a COCO instances file is a JSON object")
    for key in ("images", "annotations", "categories"):
        if not isinstance(data.get(key), list):
            raise ValueError(f"{path}: a COCO instances file needs a list under {key!r}")
    for img in data["images"]:
        if not isinstance(img, dict) or "id" not in img or "file_name" not in img:
            raise ValueError(f"{path}: every image needs 'id' and 'file_name', got {img!r}")
    cats = {c.get("id") for c in data["categories"]}
    for ann in data["annotations"]:
        if not isinstance(ann, dict) or not {"image_id", "category_id", "bbox"} <= set(ann):
            raise ValueError(f"{path}: an annotation needs image_id, category_id and bbox: {ann!r}")
        if ann["category_id"] not in cats:
            raise ValueError(f"{path}: annotation {ann.get('id')} has unknown category id")
    return data


def _read_json(path: Path, what: str) -> Any:
    if not path.is_file():
        raise FileNotFoundError(f"{what} not found: {path}")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{path} is not valid JSON: {err}") from err


def read_captions(path: Path) -> dict[int, list[str]]:
    """Reference captions by image id from a COCO captions json (``{"annotations": [...]}``) or a
    plain list of ``{image_id, caption}``."""
    data = _read_json(path, "captions file")
    rows = data.get("annotations") if isinstance(data, dict) else data
    if not isinstance(rows, list):
        raise ValueError(f"{path}: expected a list of {{image_id, caption}} or COCO captions json")
    out: dict[int, list[str]] = {}
    for r in rows:
        if not isinstance(r, dict) or "image_id" not in r or "caption" not in r:
            raise ValueError(f"{path}: a caption row needs image_id and caption, got {r!r}")
        out.setdefault(r["image_id"], []).append(str(r["caption"]))
    return out


def load_coco_set(
    images_dir: str | Path, instances: str | Path, captions: str | Path | None = None
) -> CocoSet:
    """A user's COCO-format set; clear errors for a missing folder or a malformed file."""
    images_dir, instances = Path(images_dir), Path(instances)
    if not images_dir.is_dir():
        raise FileNotFoundError(f"image directory not found: {images_dir}")
    data = check_instances(_read_json(instances, "instances file"), instances)
    caps = read_captions(Path(captions)) if captions else {}
    return CocoSet(images_dir, instances, data, caps, name=instances.stem)


def embedded_set(root: str | Path, n_images: int = EMBEDDED_IMAGES, state: Any = None) -> CocoSet:
    """The shipped held-out set (PNGs, instances.json, captions.json) under ``root``, written on
    first use (by the main process; the others wait)."""
    from .scenes import write_heldout_set

    folder = Path(root) / f"organism-heldout-{n_images}"
    done = folder / "COMPLETE"
    is_main = state is None or state.is_main_process
    if is_main and not done.exists():
        write_heldout_set(folder, n_images)
        done.write_text("ok\n")
    if state is not None:
        state.wait_for_everyone()
    instances = folder / "instances.json"
    data = check_instances(_read_json(instances, "instances file"), instances)
    caps = read_captions(folder / "captions.json")
    return CocoSet(folder, instances, data, caps, name="organism-heldout")


def resolve_set(args: Any, state: Any = None) -> CocoSet:
    """``--images/--instances/--captions`` when given, else the embedded held-out set."""
    if getattr(args, "images", None) or getattr(args, "instances", None):
        if not (args.images and args.instances):
            raise ValueError("pass both --images DIR and --instances FILE (or neither)")
        return load_coco_set(args.images, args.instances, getattr(args, "captions", None))
    return embedded_set(Path(args.out) / "data", state=state)


def split_missing(items: list[dict], cocoset: CocoSet, on_missing: str) -> tuple[list, list]:
    """``(items whose image exists, items whose image is missing)``; ``on_missing="stop"``
    raises ``FileNotFoundError`` on the first missing image instead."""
    if on_missing not in ("skip", "stop"):
        raise ValueError(f"on_missing={on_missing!r}; allowed: skip, stop")
    present, missing = [], []
    exists: dict[Path, bool] = {}
    for it in items:
        path = cocoset.images_dir / it["image"]
        if path not in exists:
            exists[path] = path.is_file()
        if exists[path]:
            present.append(it)
        elif on_missing == "stop":
            raise FileNotFoundError(
                f"image of question {it.get('question_id', it.get('id'))} not found: {path} "
                "(pass --on-missing skip to skip and count such questions)"
            )
        else:
            missing.append(it)
    return present, missing
