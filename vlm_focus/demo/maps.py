"""The demo's drawings: the kept-token mask and the fixation strip, the attention maps of the
prompt and of the answer's objects with their boxes, presence and region scores, a video's map
per frame, and the zoom's crop on its map. Every map sits on the image through
``vlm_focus.geometry``; what the processor cropped away is shaded."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import cv2
import numpy as np
import torch
from PIL import Image
from torch import nn

from .. import zoom as zm
from ..geometry import Frame, as_size, describe_seen, seen_region
from ..grounding import (
    Box,
    GroundingPass,
    HeatMap,
    Mention,
    box_share,
    boxes,
    presence,
    presence_threshold,
)
from ..model_adapters import ImageLayout, get_adapter
from .inputs import DecodedVideo
from .overlays import (
    draw_boxes,
    frame_strip,
    heat_overlay,
    kept_mask_overlay,
    label_overlay,
    shade_unseen,
)
from .result import NOT_FOUND, FrameMap, GroundedMap

MAX_BOXES = 3
MAX_FIXATION_STEPS = 12  # decoding steps drawn in the fixation strip
#: Boxes of larger maps are found on the map resized to this many pixels (longest side).
BOX_SIDE = 384


@dataclass
class ImageView:
    """The image as the model saw it: its pixels, the layout of its visual tokens, where each
    view's grid sits on it (``vlm_focus.geometry``) and the part the processor kept."""

    image: np.ndarray  # [H, W, 3] uint8
    layout: ImageLayout
    frames: list[Frame]
    seen: Frame
    seen_share: float

    @classmethod
    def of(
        cls, model: nn.Module, processor: Any, inputs: dict[str, Any], picture: Image.Image
    ) -> ImageView:
        adapter = get_adapter(model)
        layout = adapter.layout(model, inputs["input_ids"], inputs)[0][0]
        frames = adapter.frames(layout, as_size(picture), processor=processor)
        seen, seen_share = seen_region(as_size(picture), frames)  # what the processor kept
        return cls(np.asarray(picture, dtype=np.uint8), layout, frames, seen, seen_share)

    def kept_overlay(self, kept: torch.Tensor, **style: Any) -> np.ndarray:
        """The image with the tokens at ``kept`` (original sequence positions) outlined and
        the rest darkened (``style``: :func:`.overlays.kept_mask_overlay`'s), the unseen part
        shaded."""
        grid, frame = kept_grid(self.layout, kept, self.frames)
        return shade_unseen(kept_mask_overlay(self.image, grid, frame, **style), self.seen)

    def fixation_strip(
        self, fixations: Sequence[list[torch.Tensor]], tokens: Sequence[str]
    ) -> np.ndarray:
        """Where each decoding step of a decode-time pruner looked (``fixations``: the
        trace's, each step's row 0 drawn), one panel per step with the token it wrote
        (``tokens``: the answer's; the first is written before any fixation)."""
        panels = [self.kept_overlay(step[0], dim=0.35) for step in fixations[:MAX_FIXATION_STEPS]]
        return frame_strip(panels, [str(t) for t in tokens[1 : len(panels) + 1]])

    def notices(self) -> list[str]:
        if self.seen_share >= 1.0:
            return []
        seen = describe_seen(as_size(self.image), self.seen, self.seen_share)
        return [
            f"The model saw only {seen}: its processor crops the photo, so the shaded part was "
            "never seen and nothing there can be found."
        ]


def prompt_map_notices(prompt_map: GroundedMap | None) -> list[str]:
    """What the page says about a prompt without a map, or with a map of no object."""
    if prompt_map is None:
        return ["The prompt has no words to map onto the image."]
    if prompt_map.presence is None:
        return [
            "The prompt names no object: its map shows where the whole question looks, "
            "without boxes."
        ]
    return []


def zoom_view(
    found: zm.ZoomAnswer | None,
    image: np.ndarray,
    processor: Any,
    notices: list[str],
    seen: Frame,
) -> dict[str, Any]:
    """The :class:`DemoResult` fields of a zoom (none without one); a notice when the image is
    too small to crop."""
    if found is None:
        return {}
    height, width = image.shape[:2]
    if not found.zoomed:
        notices.append(
            f"Look closer: the image ({width}x{height} px) is no larger than the model's view "
            f"({zm.native_side(processor)} px), so there is nothing to crop; the zoomed answer "
            "is the plain one."
        )
    crops = list(found.crops) if found.zoomed else []
    base = image if found.map is None else heat_overlay(image, found.map.pixels)
    labels = [f"zoom #{i + 1}" for i in range(len(crops))]
    return {
        "answer_zoomed": found.answer,
        "zoomed": found.zoomed,
        "zoom_crops": list(found.crops),
        "zoom_overlay": shade_unseen(draw_boxes(base, crops, labels), seen),
    }


def kept_grid(
    layout: ImageLayout, kept: torch.Tensor, frames: Sequence[Frame]
) -> tuple[np.ndarray, Frame]:
    """``[rows, cols]`` bool of the image's finest view (True = token kept) and that view's
    :class:`~vlm_focus.geometry.Frame` (``frames``: one per view, from
    ``vlm_focus.geometry``). ``kept`` are original sequence positions (``trace.kept[row]``)."""
    view = max(range(len(layout.grids)), key=lambda v: layout.grids[v][0] * layout.grids[v][1])
    rows, cols = layout.grids[view]
    survived = torch.isin(layout.positions, kept.to(layout.positions.device))
    cells = layout.cells
    sel = (cells[:, 0] == view) & (cells[:, 1] >= 0)
    grid = torch.zeros(rows, cols, dtype=torch.bool)
    grid[cells[sel, 1].cpu(), cells[sel, 2].cpu()] = survived[sel].cpu()
    return grid.numpy(), frames[view]


def boxes_of(heat: HeatMap, max_boxes: int) -> list[Box]:
    """``grounding.boxes`` of the map; above ``BOX_SIDE`` pixels it runs on the map resized to
    ``BOX_SIDE`` (area interpolation) and the boxes are scaled back, since its smoothing kernel
    grows with the image's pixels per grid cell."""
    width, height = heat.size
    scale = BOX_SIDE / max(height, width)
    if scale >= 1:
        return boxes(heat, max_boxes=max_boxes)
    small = (max(1, round(width * scale)), max(1, round(height * scale)))
    pixels = cv2.resize(heat.pixels.double().numpy(), small, interpolation=cv2.INTER_AREA)
    rows, cols = heat.grid.shape
    sigma = 0.5 * min(small[1] / rows, small[0] / cols)  # half a cell, as for a HeatMap
    sx, sy = width / small[0], height / small[1]
    out = []
    for b in boxes(pixels, max_boxes=max_boxes, sigma=sigma):
        x0, y0 = min(b.x0 * sx, width - 1.0), min(b.y0 * sy, height - 1.0)
        w, h = min(b.width * sx, width - x0), min(b.height * sy, height - y0)
        out.append(Box(x0, y0, w, h, b.score))
    return out


def prompt_heat(
    gp: GroundingPass, prompt: str, processor: Any
) -> tuple[HeatMap | None, str, list[Mention]]:
    """The prompt's map, its label and its words: the content words inside the user's question
    (not the chat template's words), labelled as the tokenizer spells them; without content
    words, the question as a whole, or else the whole instruction (``None``: neither maps)."""
    words = gp.mentions(source="prompt", within=prompt)[0]
    if words:
        ids = [int(gp.inputs["input_ids"][0, p]) for m in words for p in m.positions]
        tok = getattr(processor, "tokenizer", processor)
        label = tok.decode(ids, skip_special_tokens=True).strip()
        return gp.map(words), label, words
    for query in (prompt, None):
        try:
            return gp.map(query, source="prompt"), prompt, []
        except ValueError:
            continue
    return None, prompt, []


def ground(
    model: nn.Module,
    processor: Any,
    inputs: dict[str, Any],
    prompt: str,
    answer: torch.Tensor,
    picture: Image.Image,
    seen: Frame,
) -> tuple[GroundedMap | None, list[GroundedMap]]:
    """Prompt and answer-object maps from one teacher-forced pass over prompt + answer (the
    model's default grounding layers), each phrase with its presence score: an absent phrase
    gets its map and "not found", no box. Only objects are grounded: a prompt that names none
    keeps the question's map without boxes or presence, and each object the answer names gets
    one map, of all its mentions (places such as ``top_right`` are no objects,
    :data:`~vlm_focus.grounding.STOP_WORDS`). The part of the photo the model never saw is
    shaded."""
    image = np.asarray(picture, dtype=np.uint8)
    gp = GroundingPass(model, inputs, processor=processor, images=[picture], answer=answer)
    threshold = presence_threshold(model)
    heat, label, words = prompt_heat(gp, prompt, processor)
    objects: dict[str, list[Mention]] = {}  # each object once, with all its mentions
    for mention in gp.mentions(source="answer")[0]:
        objects.setdefault(mention.text, []).append(mention)
    phrases = sorted({m.text for m in words} | set(objects))
    scores = dict(zip(phrases, presence(model, processor, picture, phrases), strict=True))

    def grounded(heat: HeatMap, phrase: str, max_boxes: int, named: list[Mention]) -> GroundedMap:
        # a map of several words is present when one of them is
        score = max(scores[m.text] for m in named)
        present = score > threshold
        base = shade_unseen(heat_overlay(image, heat.pixels), seen)
        if not present:
            overlay = label_overlay(base, f"{phrase}: {NOT_FOUND} ({score:.2f})")
            return GroundedMap(phrase, overlay, [], [], heat, score, present)
        found_boxes = boxes_of(heat, max_boxes)
        box_scores = [box_share(heat, b) for b in found_boxes]
        labels = [
            f"{phrase} {s:.2f}" if max_boxes == 1 else f"#{i + 1} {s:.2f}"
            for i, s in enumerate(box_scores)
        ]
        overlay = draw_boxes(base, found_boxes, labels)
        return GroundedMap(phrase, overlay, found_boxes, box_scores, heat, score, present)

    prompt_map = None
    if heat is not None and words:
        prompt_map = grounded(heat, label, MAX_BOXES, words)
    elif heat is not None:  # no object named: where the question looks, nothing to box
        prompt_map = GroundedMap(
            label, shade_unseen(heat_overlay(image, heat.pixels), seen), [], [], heat
        )
    object_maps = [grounded(gp.map(named), text, 1, named) for text, named in objects.items()]
    return prompt_map, object_maps


def frame_spans(n_views: int, n_frames: int) -> list[list[int]]:
    """The decoded frames (positions ``0 .. n_frames - 1``) each of a video's ``n_views`` grid
    views covers, in order.

    A model that merges ``k`` consecutive frames into one temporal patch has
    ``ceil(n_frames / k)`` views, so each view covers ``ceil(n_frames / n_views)`` frames; the
    processor repeats the last frame to fill the last patch, so the last view may cover fewer.
    """
    if n_views < 1 or n_frames < 1:
        raise ValueError(f"n_views={n_views} and n_frames={n_frames} must both be >= 1")
    per_view = -(-n_frames // n_views)
    spans = [range(v * per_view, min((v + 1) * per_view, n_frames)) for v in range(n_views)]
    return [list(span) or [n_frames - 1] for span in spans]


def frame_maps(
    model: nn.Module,
    processor: Any,
    inputs: dict[str, Any],
    prompt: str,
    video: DecodedVideo,
) -> tuple[list[FrameMap], str]:
    """The prompt's map (chosen as an image's, :func:`_prompt_heat`) in each view of the video
    (``HeatMap.frame_maps``), drawn on the view's first frame; one colour scale for all views,
    so that the frames the model attended to less look colder."""
    gp = GroundingPass(model, inputs, processor=processor, sizes=[video.size])
    heat, label, _ = prompt_heat(gp, prompt, processor)
    if heat is None:
        return [], label
    views = heat.frame_maps
    peak = max(float(view.pixels.max()) for view in views)
    total = heat.mass
    out = []
    for view, span in zip(views, frame_spans(len(views), len(video.frames)), strict=True):
        drawn = heat_overlay(video.frames[span[0]], view.pixels, peak=peak)
        out.append(
            FrameMap(
                frames=[video.index(p) for p in span],
                seconds=[video.seconds(p) for p in span],
                share=view.mass / total if total > 0 else 0.0,
                overlay=shade_unseen(drawn, view.seen),
                map=view,
            )
        )
    return out, label
