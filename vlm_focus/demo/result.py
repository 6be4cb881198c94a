"""What the demo's page shows for one request: :class:`DemoResult`, with its attention maps
(:class:`GroundedMap` for an image, :class:`FrameMap` per view of a video)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..grounding import Box, HeatMap
from ..timing import PairedTiming, prefill_report

#: What the page shows for a phrase whose presence score is below the model's threshold.
NOT_FOUND = "not found"


@dataclass
class GroundedMap:
    """One attention map drawn on the image: the phrase, the overlay, its boxes and scores.

    ``presence`` is the model's ``P(yes)`` that the phrase is in the image
    (``grounding.presence``) and ``present`` whether it clears the model's threshold; an
    absent phrase has no boxes and its overlay says "not found". Both are ``None`` for a map
    that names no object (the whole prompt).
    """

    phrase: str
    overlay: np.ndarray  # [H, W, 3] uint8
    boxes: list[Box]
    scores: list[float]  # region score (MTLA share of the map inside each box)
    map: HeatMap | None = field(default=None, repr=False)
    presence: float | None = None
    present: bool | None = None

    @property
    def caption(self) -> str:
        """``"phrase: 0.42"`` (best box's region score), or ``"phrase: not found"``."""
        if self.present is False:
            return f"{self.phrase}: {NOT_FOUND}"
        return f"{self.phrase}: {self.scores[0]:.2f}" if self.scores else self.phrase


@dataclass
class FrameMap:
    """The prompt's attention map in one view of a video, drawn on its first frame.

    A view can cover several decoded frames (a model that merges consecutive frames into one
    temporal patch): ``frames`` are their indices in the video file and ``seconds`` their
    times. ``share`` is the view's part of the whole video's map mass.
    """

    frames: list[int]
    seconds: list[float]
    share: float
    overlay: np.ndarray  # [H, W, 3] uint8
    map: HeatMap | None = field(default=None, repr=False)

    @property
    def caption(self) -> str:
        """``"frame 5 (1.25 s): 42%"``, or ``"frames 0-2 (0.00-0.50 s): 42%"`` for a view of
        several frames."""
        if len(self.frames) == 1:
            where = f"frame {self.frames[0]} ({self.seconds[0]:.2f} s)"
        else:
            where = (
                f"frames {self.frames[0]}-{self.frames[-1]} "
                f"({self.seconds[0]:.2f}-{self.seconds[-1]:.2f} s)"
            )
        return f"{where}: {self.share:.0%}"


@dataclass
class DemoResult:
    """Everything the page shows for one request.

    ``ok=False`` means the request was refused or failed; ``message`` then says why and the other
    outputs are empty. With ``ok=True``, ``notices`` may still hold remarks (a downscaled image).
    """

    ok: bool
    message: str = ""
    notices: list[str] = field(default_factory=list)
    image: np.ndarray | None = None  # [H, W, 3] uint8: the image the model saw
    answer: str = ""  # answer of the pruned model
    answer_unpruned: str = ""
    answer_mitigated: str = ""  # pruned model under the mitigation ("" without one)
    mitigation: str = "none"
    prompt_map: GroundedMap | None = None
    object_maps: list[GroundedMap] = field(default_factory=list)
    kept_overlay: np.ndarray | None = None  # [H, W, 3] uint8
    #: decode-time pruners (``fixation``): where each decoding step looked, one panel per step
    fixation_strip: np.ndarray | None = None
    n_kept: int = 0
    n_visual: int = 0
    #: unpruned and pruned prefills of this request, alternating (``None``: nothing pruned)
    timing: PairedTiming | None = None
    seconds: float = 0.0
    #: ``zoom=True``: the pruned model's answer with the crop (``""`` without the zoom), whether
    #: a crop was asked about at all, the crops (``geometry.Frame``, image pixels) and the map
    #: they came from with the crops drawn on it
    answer_zoomed: str = ""
    zoomed: bool = False
    zoom_crops: list = field(default_factory=list)
    zoom_overlay: np.ndarray | None = None  # [H, W, 3] uint8
    #: the request asked about a video: the prompt's map per view of it, in time order
    #: (``image``, the kept-token mask, boxes and object maps stay empty)
    video: bool = False
    frame_maps: list[FrameMap] = field(default_factory=list)

    @property
    def heatmap(self) -> np.ndarray | None:
        """The prompt phrase's map overlay with its boxes ([H, W, 3] uint8)."""
        return None if self.prompt_map is None else self.prompt_map.overlay

    @property
    def prefill_ms_unpruned(self) -> float:
        """The median pair's unpruned prefill (what :attr:`speedup` divides)."""
        return 0.0 if self.timing is None else self.timing.base_seconds * 1e3

    @property
    def prefill_ms_pruned(self) -> float:
        return 0.0 if self.timing is None else self.timing.other_seconds * 1e3

    @property
    def speedup(self) -> float:
        return 0.0 if self.timing is None else self.timing.ratio

    @property
    def kept_text(self) -> str:
        if not self.n_visual:
            return ""
        share = 100.0 * self.n_kept / self.n_visual
        return f"{self.n_kept} / {self.n_visual} visual tokens kept ({share:.0f}%)"

    @property
    def timing_text(self) -> str:
        """The command lines' timing line (:func:`vlm_focus.timing.prefill_report`), measured
        in this request; with its spread warning when the pairs disagree too much."""
        if not self.n_visual:
            return ""
        text = prefill_report(self.timing, self.n_kept, self.n_visual)
        warning = None if self.timing is None else self.timing.warning()
        return text + (f"  \nwarning: {warning}" if warning else "")

    def box_rows(self) -> list[list[Any]]:
        """Table rows ``[phrase, x, y, w, h, region score, presence]``, the prompt map's first:
        one per box, or one ``[phrase, None x 5, "not found (p)"]`` for an absent phrase."""
        rows = []
        maps = ([self.prompt_map] if self.prompt_map else []) + self.object_maps
        for m in maps:
            presence = "" if m.presence is None else f"{m.presence:.3f}"
            if m.present is False:
                rows.append([m.phrase, None, None, None, None, None, f"{NOT_FOUND} ({presence})"])
                continue
            for box, score in zip(m.boxes, m.scores, strict=True):
                xywh = [int(round(v)) for v in box.xywh]
                rows.append([m.phrase, *xywh, round(score, 3), presence])
        return rows


__all__ = ["NOT_FOUND", "DemoResult", "FrameMap", "GroundedMap"]
