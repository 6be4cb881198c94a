"""High-resolution organism scenes: the generator's scenes drawn on a large canvas.

The organism sees a 192 x 192 view (CLIP-style: shortest side to 192, then the central 192 x 192),
cut into 12 x 12 cells of 16 pixels. A scene drawn at its own pixel size on a ``canvas x canvas``
image (576 and up) is shrunk by ``canvas / 192`` before the model sees it, so its objects (radius
14-26 px) fall below one visual cell: 4.7-8.7 px at 576, 3.5-6.5 px at 768. Cropping the region
that holds an object back to about 192 px restores the scale the model was trained at.

A :class:`HighResScene` keeps the native scene and where it sits on the canvas:

* ``layout="tile"``: the 192 x 192 scene is placed whole at a seeded offset; every object keeps
  its radius and its place relative to the others. The same objects at native size are
  :attr:`HighResScene.native` (the original scene), which is the reference of "the accuracy lost
  to downscaling".
* ``layout="spread"``: object centres are scaled to the canvas (``c * canvas / 192``), radii kept,
  so the objects lie far apart on the canvas.

Either way the canvas is rendered by the scene renderer itself (the same background, texture,
shading and noise model, drawn at the canvas size), objects never overlap, and each object's
mask and box are exact on the canvas. POPE questions come from the canvas scenes' COCO
instances by the POPE rules (:func:`organism.pope.pope_questions`).

    from organism import highres
    scenes = highres.highres_scenes(50, canvas=576)          # >= 3 objects each
    rows = highres.highres_pope(scenes, "adversarial")       # POPE rows on the canvas images
    image = scenes[0].image()                                # [576, 576, 3] uint8
    python -m organism.highres write OUT --images 50 --canvas 576
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .pope import pope_questions
from .scenes import (
    IMAGE_SIZE,
    Scene,
    SceneObject,
    coco_instances,
    heldout_scenes,
    scenes_from,
)

LAYOUTS = ("tile", "spread")
#: Offsets are drawn from their own seed stream, apart from the scenes' seeds.
_OFFSET_SEED = 17_000_017


@dataclass
class HighResScene:
    """A native scene and its placement on a ``canvas x canvas`` image.

    Attributes:
        native: the scene at its own size (192 x 192), the native-size reference.
        canvas_scene: the same objects placed on the canvas (a :class:`Scene` of size
            ``canvas``); its masks and boxes are exact canvas pixels.
        offset: ``(x, y)`` of the native scene's top-left corner on the canvas (``tile``), or
            ``(0, 0)`` (``spread``).
        layout: ``"tile"`` or ``"spread"``.
    """

    native: Scene
    canvas_scene: Scene
    offset: tuple[int, int]
    layout: str

    @property
    def seed(self) -> int:
        return self.native.seed

    @property
    def canvas(self) -> int:
        return self.canvas_scene.size

    @property
    def objects(self) -> list[SceneObject]:
        """The objects in canvas pixels, in the native scene's order."""
        return self.canvas_scene.objects

    def image(self) -> np.ndarray:
        """The canvas image ``[canvas, canvas, 3]`` uint8."""
        return self.canvas_scene.image()

    def native_image(self) -> np.ndarray:
        """The native scene's image ``[192, 192, 3]`` uint8."""
        return self.native.image()

    def box(self, category: int) -> tuple[int, int, int, int] | None:
        """The exact canvas box ``[x, y, w, h]`` of the object of ``category``, or ``None``."""
        found = self.canvas_scene.find(category)
        return None if found is None else found.box(self.canvas)

    @property
    def downscale(self) -> float:
        """How many times smaller objects become in the model's 192-pixel view."""
        return self.canvas / IMAGE_SIZE


def place(scene: Scene, canvas: int, layout: str = "tile", seed: int | None = None) -> HighResScene:
    """``scene`` (drawn at ``scene.size``) placed on a ``canvas x canvas`` image.

    ``tile``: the scene's square pasted at an offset drawn from ``seed`` (default: the scene's
    seed), uniformly over the canvas. ``spread``: every centre multiplied by
    ``canvas / scene.size``, radii unchanged.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r}; allowed: {LAYOUTS}")
    if not isinstance(canvas, int) or canvas < scene.size:
        raise ValueError(f"canvas={canvas!r} must be an int >= the scene's size {scene.size}")
    if layout == "tile":
        rng = np.random.default_rng([_OFFSET_SEED, scene.seed if seed is None else seed])
        ox, oy = (int(v) for v in rng.integers(0, canvas - scene.size + 1, size=2))
        objects = [SceneObject(o.category, o.cx + ox, o.cy + oy, o.radius) for o in scene.objects]
        offset = (ox, oy)
    else:
        s = canvas / scene.size
        objects = [SceneObject(o.category, o.cx * s, o.cy * s, o.radius) for o in scene.objects]
        offset = (0, 0)
    placed = Scene(seed=scene.seed, objects=objects, size=canvas, background=scene.background)
    return HighResScene(scene, placed, offset, layout)


def native_scenes(n: int, min_objects: int = 3, first_seed: int | None = None) -> list[Scene]:
    """The first ``n`` scenes with at least ``min_objects`` objects from seed ``first_seed`` on
    (default: the held-out set, the POPE images of the normal organism evaluation)."""
    if first_seed is None:
        return heldout_scenes(n, min_objects=min_objects)
    return scenes_from(first_seed, n, min_objects)


def highres_scenes(
    n: int,
    canvas: int = 576,
    layout: str = "tile",
    min_objects: int = 3,
    first_seed: int | None = None,
) -> list[HighResScene]:
    """:func:`native_scenes` (default: the held-out POPE images), each placed on a ``canvas``
    image."""
    return [place(s, canvas, layout) for s in native_scenes(n, min_objects, first_seed)]


def highres_pope(scenes: list[HighResScene], split: str, seed: int = 0) -> list[dict]:
    """POPE rows ``{question_id, image_id, image, text, label, category, category_id}`` on the
    canvas images (the same questions as the native scenes get: placement keeps categories)."""
    return pope_questions([s.canvas_scene for s in scenes], split, seed=seed)


def write_highres(
    out_dir: Path, n: int = 50, canvas: int = 576, layout: str = "tile", images: bool = True
) -> Path:
    """Write the canvas PNGs, ``instances.json`` (exact canvas boxes), ``placement.json`` and
    ``pope_{split}.jsonl`` for every split; return ``out_dir``."""
    from PIL import Image

    from .pope import SPLITS

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    scenes = highres_scenes(n, canvas, layout)
    names = [f"scene_{s.seed}.png" for s in scenes]
    if images:
        for s, name in zip(scenes, names, strict=True):
            Image.fromarray(s.image()).save(out_dir / name)
    instances = coco_instances([s.canvas_scene for s in scenes], names)
    (out_dir / "instances.json").write_text(json.dumps(instances))
    placement = [
        {"image_id": s.seed, "canvas": canvas, "layout": layout, "offset": list(s.offset)}
        for s in scenes
    ]
    (out_dir / "placement.json").write_text(json.dumps(placement))
    for split in SPLITS:
        rows = highres_pope(scenes, split)
        (out_dir / f"pope_{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return out_dir


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m organism.highres",
        description="Write the high-resolution organism set (canvas PNGs, exact boxes, POPE).",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    write = sub.add_parser("write", help="write the set to a folder")
    write.add_argument("out", type=Path)
    write.add_argument("--images", type=int, default=50, help="scenes (>= 3 objects each)")
    write.add_argument("--canvas", type=int, default=576, help="canvas side in pixels")
    write.add_argument("--layout", choices=LAYOUTS, default="tile")
    args = parser.parse_args(argv)
    out = write_highres(args.out, args.images, args.canvas, args.layout)
    print(f"wrote {args.images} scenes on a {args.canvas}-pixel canvas to {out}")


__all__ = [
    "LAYOUTS",
    "HighResScene",
    "highres_pope",
    "highres_scenes",
    "native_scenes",
    "place",
    "write_highres",
]

if __name__ == "__main__":
    main()
