"""Procedural scenes with exact ground truth: coloured shapes on a noisy background.

Every scene is a pure function of its seed. Objects never overlap, so each object's mask is exact
(the set of pixels whose centre lies inside the shape) and its box is the tight box of that mask.
Category co-occurrence is deliberately not uniform: categories have a popularity (Zipf-like) and
each category has two fixed companions that it is often drawn with, so POPE's popular and
adversarial negatives differ from random ones.

The embedded models were trained on these scenes, and the shipped held-out set and sample scenes
are drawn from them (their images are regenerated from the seeds, see
:func:`vlm_focus.eval.scenes.write_heldout_set`). The organism's training recipe adds
questions, captions and relations on top (``organism/scenes.py``, beside the package).
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from PIL import Image

from ..asset_paths import heldout_path

IMAGE_SIZE = 192
COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (215, 35, 35),
    "green": (35, 160, 60),
    "blue": (40, 80, 220),
    "yellow": (235, 205, 25),
    "purple": (140, 55, 185),
    "orange": (245, 135, 20),
}
SHAPES: tuple[str, ...] = ("circle", "square", "triangle", "diamond", "cross")
CATEGORIES: tuple[str, ...] = tuple(f"{c}_{s}" for c in COLOURS for s in SHAPES)
POSITIONS: tuple[str, ...] = (
    "top_left",
    "top",
    "top_right",
    "middle_left",
    "center",
    "middle_right",
    "bottom_left",
    "bottom",
    "bottom_right",
)
MIN_RADIUS, MAX_RADIUS = 14, 26
MAX_OBJECTS = 5

_STRUCTURE_SEED = 20240601


def _structure() -> tuple[np.ndarray, np.ndarray]:
    """Fixed popularity weights `[C]` and companion table `[C, 2]` for the categories."""
    rng = np.random.default_rng(_STRUCTURE_SEED)
    n = len(CATEGORIES)
    rank = rng.permutation(n)
    popularity = 1.0 / (rank + 2.0) ** 0.9
    popularity /= popularity.sum()
    companions = np.stack(
        [rng.choice([j for j in range(n) if j != i], 2, replace=False) for i in range(n)]
    )
    return popularity, companions


POPULARITY, COMPANIONS = _structure()


@dataclass
class SceneObject:
    """One object: category index into CATEGORIES, centre and radius in pixels."""

    category: int
    cx: float
    cy: float
    radius: float

    @property
    def name(self) -> str:
        return CATEGORIES[self.category]

    def mask(self, size: int = IMAGE_SIZE) -> np.ndarray:
        """Exact boolean mask `[H, W]`: pixels whose centre lies inside the shape."""
        return shape_mask(SHAPES[self.category % len(SHAPES)], self.cx, self.cy, self.radius, size)

    def box(self, size: int = IMAGE_SIZE) -> tuple[int, int, int, int]:
        """Tight box of the mask as COCO `[x, y, w, h]` in whole pixels."""
        ys, xs = np.nonzero(self.mask(size))
        return (
            int(xs.min()),
            int(ys.min()),
            int(xs.max() - xs.min() + 1),
            int(ys.max() - ys.min() + 1),
        )

    def position(self, size: int = IMAGE_SIZE) -> str:
        """Coarse position of the centre on a 3 x 3 grid."""
        col = min(int(self.cx * 3 // size), 2)
        row = min(int(self.cy * 3 // size), 2)
        return POSITIONS[row * 3 + col]


@dataclass
class Scene:
    """A generated scene: its seed, objects and background parameters."""

    seed: int
    objects: list[SceneObject]
    size: int = IMAGE_SIZE
    background: tuple[int, int, int] = (200, 200, 200)
    _image: np.ndarray | None = field(default=None, repr=False, compare=False)

    @property
    def categories(self) -> list[int]:
        return [o.category for o in self.objects]

    def image(self) -> np.ndarray:
        """RGB uint8 image `[H, W, 3]` (cached)."""
        if self._image is None:
            self._image = render(self)
        return self._image

    def find(self, category: int) -> SceneObject | None:
        for o in self.objects:
            if o.category == category:
                return o
        return None


def shape_mask(shape: str, cx: float, cy: float, r: float, size: int = IMAGE_SIZE) -> np.ndarray:
    """Boolean mask `[size, size]` of a shape inscribed in the circle (cx, cy, r), pixel centres."""
    out = np.zeros((size, size), dtype=bool)
    x0, x1 = max(int(cx - r) - 1, 0), min(int(cx + r) + 2, size)
    y0, y1 = max(int(cy - r) - 1, 0), min(int(cy + r) + 2, size)
    y, x = np.mgrid[y0:y1, x0:x1].astype(np.float64) + 0.5
    out[y0:y1, x0:x1] = _inside(shape, x - cx, y - cy, r)
    return out


def _inside(shape: str, dx: np.ndarray, dy: np.ndarray, r: float) -> np.ndarray:
    """Point-in-shape test on offsets from the centre."""
    if shape == "circle":
        return dx * dx + dy * dy <= r * r
    if shape == "square":
        return (np.abs(dx) <= 0.78 * r) & (np.abs(dy) <= 0.78 * r)
    if shape == "diamond":
        return np.abs(dx) + np.abs(dy) <= r
    if shape == "cross":
        arm = 0.32 * r
        return ((np.abs(dx) <= arm) & (np.abs(dy) <= r)) | ((np.abs(dy) <= arm) & (np.abs(dx) <= r))
    if shape == "triangle":
        # apex up at (0, -r), base corners (+-0.9r, 0.75r)
        top, base, half = -r, 0.75 * r, 0.9 * r
        frac = (dy - top) / (base - top)
        return (dy >= top) & (dy <= base) & (np.abs(dx) <= half * frac)
    raise ValueError(f"shape={shape!r}; allowed: {SHAPES}")


def _sample_categories(rng: np.random.Generator, k: int) -> list[int]:
    """k distinct categories: popularity draws, half of later ones taken from a companion."""
    chosen: list[int] = []
    while len(chosen) < k:
        if chosen and rng.random() < 0.5:
            c = int(rng.choice(COMPANIONS[int(rng.choice(chosen))]))
        else:
            c = int(rng.choice(len(CATEGORIES), p=POPULARITY))
        if c not in chosen:
            chosen.append(c)
    return chosen


def generate_scene(seed: int, n_objects: int | None = None, size: int = IMAGE_SIZE) -> Scene:
    """Deterministic scene for `seed`: 1-5 non-overlapping objects (or exactly `n_objects`)."""
    rng = np.random.default_rng(seed)
    k = int(rng.integers(1, MAX_OBJECTS + 1)) if n_objects is None else n_objects
    if not 1 <= k <= MAX_OBJECTS:
        raise ValueError(f"n_objects={n_objects}; allowed: 1..{MAX_OBJECTS}")
    cats = _sample_categories(rng, k)
    objects: list[SceneObject] = []
    for c in cats:
        for _ in range(200):
            r = float(rng.uniform(MIN_RADIUS, MAX_RADIUS))
            cx, cy = rng.uniform(r + 2, size - r - 2, size=2)
            if all(np.hypot(cx - o.cx, cy - o.cy) >= r + o.radius + 4 for o in objects):
                objects.append(SceneObject(c, float(cx), float(cy), r))
                break
    grey = int(rng.integers(180, 225))
    tint = rng.integers(-8, 9, size=3)
    background = tuple(int(np.clip(grey + t, 0, 255)) for t in tint)
    return Scene(seed=seed, objects=objects, size=size, background=background)


def render(scene: Scene) -> np.ndarray:
    """Draw the scene: textured background, flat-coloured shapes, mild pixel noise everywhere."""
    rng = np.random.default_rng([scene.seed, 1])
    size = scene.size
    img = np.empty((size, size, 3), dtype=np.float32)
    img[:] = np.asarray(scene.background, dtype=np.float32)
    # low-frequency texture: a few random plane waves of amplitude <= 6 grey levels
    y, x = _grid(size)
    for _ in range(3):
        fx, fy = rng.uniform(-0.08, 0.08, size=2)
        img += rng.uniform(1.0, 3.0) * np.sin(fx * x + fy * y + rng.uniform(0, 6.3))[..., None]
    for o in scene.objects:
        colour = np.asarray(COLOURS[CATEGORIES[o.category].split("_")[0]], dtype=np.float32)
        shade = rng.uniform(-12, 12, size=3).astype(np.float32)
        img[o.mask(size)] = colour + shade
    img += 5.0 * rng.standard_normal(size=img.shape, dtype=np.float32)
    return np.clip(np.rint(img), 0, 255).astype(np.uint8)


@functools.lru_cache(maxsize=4)
def _grid(size: int) -> tuple[np.ndarray, np.ndarray]:
    y, x = np.mgrid[0:size, 0:size].astype(np.float32)
    return y, x


HELDOUT_SEED_BASE = 9_000_000


def heldout_scenes(n: int = 500, min_objects: int = 1) -> list[Scene]:
    """The fixed held-out set: the first n scenes with >= min_objects objects from a reserved range.

    Training draws seeds >= 10,000,000 and the training probe uses 8,000,000+, so none meet.
    """
    return scenes_from(HELDOUT_SEED_BASE, n, min_objects)


def scenes_from(first_seed: int, n: int, min_objects: int = 1) -> list[Scene]:
    """The first ``n`` scenes with at least ``min_objects`` objects, from seed ``first_seed`` on."""
    out: list[Scene] = []
    seed = int(first_seed)
    while len(out) < n:
        scene = generate_scene(seed)
        if len(scene.objects) >= min_objects:
            out.append(scene)
        seed += 1
    return out


def write_heldout_set(folder: str | Path, n_images: int | None = None) -> Path:
    """Write the held-out set into ``folder`` as a COCO-format set: ``instances.json`` and
    ``captions.json`` (the shipped files, cut to the first ``n_images`` images) and one PNG per
    image, rendered from its seed (the image id). Returns the instances path.

    The set is the first 500 held-out scenes with at least three objects, in seed order."""
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
