"""Drawing for the demo: attention heatmaps (OpenCV colormap), boxes, and the kept-token mask.

Every function takes and returns ``np.uint8 [H, W, 3]`` RGB images of the input image's size.
"""

from __future__ import annotations

from collections.abc import Sequence

import cv2
import numpy as np
import torch

from ..geometry import Frame

#: Box colours (RGB), best box first.
BOX_COLOURS = ((255, 255, 255), (255, 220, 0), (0, 230, 255), (255, 120, 255))
KEPT_COLOUR = (60, 255, 60)


def _check_image(image: np.ndarray) -> np.ndarray:
    if not isinstance(image, np.ndarray) or image.ndim != 3 or image.shape[2] != 3:
        raise ValueError(f"image must be an [H, W, 3] array, got {getattr(image, 'shape', image)}")
    return np.ascontiguousarray(image, dtype=np.uint8)


def heat_overlay(
    image: np.ndarray,
    density: np.ndarray | torch.Tensor,
    *,
    alpha: float = 0.5,
    colormap: int = cv2.COLORMAP_JET,
    peak: float | None = None,
) -> np.ndarray:
    """Blend ``density [H, W]`` (any non-negative scale) onto ``image`` with an OpenCV colormap.

    ``out = (1 - alpha) * image + alpha * colormap(round(255 * min(density / peak, 1)))``

    ``peak`` defaults to ``max(density)``; maps drawn with one ``peak`` share a colour scale
    (a video's frames), so a frame the model barely attended to stays cold.
    """
    image = _check_image(image)
    if isinstance(density, torch.Tensor):
        density = density.detach().cpu().numpy()
    density = np.asarray(density, dtype=np.float64)
    if density.shape != image.shape[:2]:
        raise ValueError(f"map shape {density.shape} != image shape {image.shape[:2]}")
    density = np.nan_to_num(density, nan=0.0, posinf=0.0, neginf=0.0).clip(min=0)
    peak = float(density.max()) if peak is None else float(peak)
    if peak <= 0:
        scaled = np.zeros(density.shape, np.uint8)
    else:
        scaled = np.round(255 * np.minimum(density / peak, 1.0))
    coloured = cv2.applyColorMap(scaled.astype(np.uint8), colormap)  # BGR
    coloured = cv2.cvtColor(coloured, cv2.COLOR_BGR2RGB)
    return cv2.addWeighted(image, 1.0 - alpha, coloured, alpha, 0.0)


def _thickness(image: np.ndarray) -> int:
    return max(1, round(min(image.shape[:2]) / 160))


def draw_boxes(
    image: np.ndarray, boxes: Sequence[Frame], labels: Sequence[str] | None = None
) -> np.ndarray:
    """Rectangles around ``boxes`` (:class:`~vlm_focus.geometry.Frame` values in the image's
    pixels: grounding boxes, zoom crops) with an optional label each."""
    out = _check_image(image).copy()
    thick = _thickness(out)
    scale = max(0.35, min(out.shape[:2]) / 500)
    for i, box in enumerate(boxes):
        colour = BOX_COLOURS[i % len(BOX_COLOURS)]
        x0, y0 = int(round(box.x0)), int(round(box.y0))
        x1, y1 = int(round(box.x1)) - 1, int(round(box.y1)) - 1
        cv2.rectangle(out, (x0, y0), (max(x0, x1), max(y0, y1)), colour, thick)
        if labels is not None and i < len(labels) and labels[i]:
            (tw, th), base = cv2.getTextSize(labels[i], cv2.FONT_HERSHEY_SIMPLEX, scale, 1)
            ty = y0 - 2 if y0 - th - base - 2 >= 0 else min(out.shape[0] - 1, y0 + th + 2)
            cv2.rectangle(out, (x0, ty - th - 1), (x0 + tw + 1, ty + base - 1), (0, 0, 0), -1)
            cv2.putText(
                out,
                labels[i],
                (x0, ty - 1),
                cv2.FONT_HERSHEY_SIMPLEX,
                scale,
                colour,
                1,
                cv2.LINE_AA,
            )
    return out


def kept_mask_overlay(
    image: np.ndarray,
    kept: np.ndarray | torch.Tensor,
    frame: Frame,
    *,
    dim: float = 0.25,
    outline: bool = True,
) -> np.ndarray:
    """Darken the pixels of pruned grid cells and outline the kept ones.

    ``kept [rows, cols]`` bool is one view's grid; ``frame`` the
    :class:`~vlm_focus.geometry.Frame` ``(x0, y0, width, height)`` that grid spans in the image's
    pixels (``ModelAdapter.frames``). Pixels of a pruned cell are scaled by
    ``dim``; pixels outside the frame stay as they are.
    """
    if not isinstance(frame, Frame):
        raise TypeError(
            f"frame must be a vlm_focus.geometry.Frame(x0, y0, width, height), got {frame!r}"
        )
    out = _check_image(image).copy()
    kept_t = torch.as_tensor(np.asarray(kept, dtype=bool))
    if kept_t.dim() != 2:
        raise ValueError(f"kept must be a [rows, cols] bool grid, got {list(kept_t.shape)}")
    height, width = out.shape[:2]
    rects = frame.cells(tuple(kept_t.shape)).round().long()  # [rows, cols, 4] x_lo y_lo x_hi y_hi
    pruned = np.zeros((height, width), dtype=bool)
    boxes = []
    for r in range(kept_t.shape[0]):
        for c in range(kept_t.shape[1]):
            x_lo, y_lo, x_hi, y_hi = (int(v) for v in rects[r, c])
            y_lo, y_hi = max(0, y_lo), min(height, y_hi)
            x_lo, x_hi = max(0, x_lo), min(width, x_hi)
            if y_hi <= y_lo or x_hi <= x_lo:
                continue
            if bool(kept_t[r, c]):
                boxes.append((x_lo, y_lo, x_hi - 1, y_hi - 1))
            else:
                pruned[y_lo:y_hi, x_lo:x_hi] = True
    out[pruned] = np.round(out[pruned].astype(np.float64) * dim).astype(np.uint8)
    if outline:
        for x0, y0, x1, y1 in boxes:
            cv2.rectangle(out, (x0, y0), (x1, y1), KEPT_COLOUR, 1)
    return out


def frame_strip(
    panels: Sequence[np.ndarray], labels: Sequence[str], height: int = 150
) -> np.ndarray:
    """Panels side by side at one ``height``, each with its label written underneath
    ([H, W, 3] uint8): one panel per decoding step, the token it produced as the label."""
    if not panels:
        raise ValueError("frame_strip needs at least one panel")
    if len(labels) != len(panels):
        raise ValueError(f"{len(panels)} panels but {len(labels)} labels")
    tiles = []
    for panel, label in zip(panels, labels, strict=True):
        panel = _check_image(panel)
        width = max(1, round(panel.shape[1] * height / panel.shape[0]))
        tile = cv2.resize(panel, (width, height), interpolation=cv2.INTER_NEAREST)
        caption = np.full((22, width, 3), 255, dtype=np.uint8)
        cv2.putText(caption, label[:14], (3, 16), cv2.FONT_HERSHEY_SIMPLEX, 0.4, (0, 0, 0), 1)
        gap = np.full((height + 22, 4, 3), 255, dtype=np.uint8)
        tiles += [np.concatenate([tile, caption], axis=0), gap]
    return np.concatenate(tiles[:-1], axis=1)


def shade_unseen(image: np.ndarray, seen: Frame, *, dim: float = 0.35) -> np.ndarray:
    """Shade the pixels outside ``seen`` (the part of the photo the model saw,
    ``vlm_focus.geometry.seen_region``): scaled by ``dim`` and hatched with grey diagonal lines
    every 8 pixels, so that they differ from pruned cells (darkened, no hatching). A ``seen``
    covering the whole image returns it unchanged."""
    if not isinstance(seen, Frame):
        raise TypeError(f"seen must be a vlm_focus.geometry.Frame, got {seen!r}")
    out = _check_image(image).copy()
    height, width = out.shape[:2]
    x0, y0 = max(0, int(seen.x0)), max(0, int(seen.y0))
    x1, y1 = min(width, int(seen.x1)), min(height, int(seen.y1))
    outside = np.ones((height, width), dtype=bool)
    outside[y0:y1, x0:x1] = False
    if not outside.any():
        return out
    ys, xs = np.indices((height, width))
    hatch = outside & ((xs + ys) % 8 == 0)
    out[outside] = np.round(out[outside].astype(np.float64) * dim).astype(np.uint8)
    out[hatch] = (150, 150, 150)
    return out


def label_overlay(image: np.ndarray, text: str) -> np.ndarray:
    """``text`` in white on a black band across the image's top-left corner."""
    out = _check_image(image).copy()
    scale = max(0.35, min(out.shape[:2]) / 500)
    (tw, th), base = cv2.getTextSize(text, cv2.FONT_HERSHEY_SIMPLEX, scale, 1)
    cv2.rectangle(out, (0, 0), (tw + 4, th + base + 4), (0, 0, 0), -1)
    cv2.putText(
        out, text, (2, th + 2), cv2.FONT_HERSHEY_SIMPLEX, scale, (255, 255, 255), 1, cv2.LINE_AA
    )
    return out
