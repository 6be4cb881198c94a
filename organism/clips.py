"""Clips of moving objects, organism-qwen's videos: :data:`FRAMES` frames (:data:`GROUPS`
temporal patches of :data:`TEMPORAL`) of 2-3 scene objects that move in straight lines, each on
screen for a run of temporal patches, so that questions about time ("which object appears
first", "at the end of the video, is there a red_circle?") have one true answer. A clip is a
pure function of its seed, and its masks are exact per frame.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .scenes import CATEGORIES, COLOURS, SHAPES, shape_mask

FRAMES = 8  # frames per clip
TEMPORAL = 2  # frames per temporal patch
CLIP_SIZE = 196  # px per side of a clip's frames (7 x 7 merged tokens)
GROUPS = FRAMES // TEMPORAL  # temporal patches per clip


@dataclass
class Track:
    """One object of a clip: category, radius, centre at frame 0, velocity (px per frame), and
    the temporal patches [start, stop) it is on screen."""

    category: int
    radius: float
    centre: tuple[float, float]
    velocity: tuple[float, float]
    start: int
    stop: int

    def centre_at(self, frame: int) -> tuple[float, float]:
        return (
            self.centre[0] + self.velocity[0] * frame,
            self.centre[1] + self.velocity[1] * frame,
        )

    def visible(self, frame: int) -> bool:
        return self.start <= frame // TEMPORAL < self.stop

    def mask(self, frame: int) -> np.ndarray:
        cx, cy = self.centre_at(frame)
        shape = SHAPES[self.category % len(SHAPES)]
        return shape_mask(shape, cx, cy, self.radius, CLIP_SIZE)


@dataclass
class Clip:
    """A clip of :data:`FRAMES` frames: its seed, tracks and background."""

    seed: int
    tracks: list[Track]
    background: tuple[int, int, int]
    _frames: np.ndarray | None = field(default=None, repr=False, compare=False)

    @property
    def categories(self) -> list[int]:
        return [t.category for t in self.tracks]

    def first(self) -> Track:
        """The object that appears first (start patches are distinct)."""
        return min(self.tracks, key=lambda t: t.start)

    def frames(self) -> np.ndarray:
        """RGB uint8 frames `[T, H, W, 3]` (cached): flat shapes on a noisy grey background."""
        if self._frames is None:
            rng = np.random.default_rng([self.seed, 2])
            out = np.empty((FRAMES, CLIP_SIZE, CLIP_SIZE, 3), dtype=np.float32)
            out[:] = np.asarray(self.background, dtype=np.float32)
            for t in range(FRAMES):
                for track in self.tracks:
                    if track.visible(t):
                        colour = COLOURS[CATEGORIES[track.category].split("_")[0]]
                        out[t][track.mask(t)] = colour
            out += 5.0 * rng.standard_normal(size=out.shape, dtype=np.float32)
            self._frames = np.clip(np.rint(out), 0, 255).astype(np.uint8)
        return self._frames

    def group_masks(self, group: int) -> list[np.ndarray]:
        """Each track's mask over the two frames of temporal patch `group` (empty when off)."""
        frames = range(group * TEMPORAL, (group + 1) * TEMPORAL)
        return [
            np.logical_or.reduce([t.mask(f) for f in frames])
            if t.visible(frames[0])
            else np.zeros((CLIP_SIZE, CLIP_SIZE), dtype=bool)
            for t in self.tracks
        ]


def make_clip(seed: int) -> Clip:
    """Deterministic clip for `seed`: 2-3 distinct categories with distinct start patches (so one
    appears first), each on screen until a later patch or the end, moving at most 3 px per frame
    and never touching another object."""
    rng = np.random.default_rng([seed, 8])
    k = int(rng.integers(2, 4))
    cats = rng.choice(len(CATEGORIES), size=k, replace=False)
    starts = sorted(rng.choice(GROUPS - 1, size=k, replace=False))
    tracks: list[Track] = []
    for cat, start in zip(cats, starts, strict=True):
        for _ in range(200):
            r = float(rng.uniform(12, 20))
            v = tuple(float(x) for x in rng.uniform(-3, 3, size=2))
            c = rng.uniform(r + 2 + 3 * FRAMES, CLIP_SIZE - r - 2 - 3 * FRAMES, size=2)
            stop = int(rng.integers(start + 1, GROUPS + 1))
            track = Track(int(cat), r, (float(c[0]), float(c[1])), v, int(start), stop)
            if all(_apart(track, other) for other in tracks):
                tracks.append(track)
                break
    grey = int(rng.integers(180, 225))
    return Clip(seed, tracks, (grey, grey, grey))


def _apart(a: Track, b: Track) -> bool:
    gap = a.radius + b.radius + 4
    return all(np.hypot(*np.subtract(a.centre_at(f), b.centre_at(f))) >= gap for f in range(FRAMES))
