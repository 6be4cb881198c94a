"""Image geometry: where each view's grid cells sit in the original image, in pixels.

This package is the one place that maps grid cells to original pixels. Grounding maps, boxes and
region scores, COCO evaluation, the demo's overlays, the debiased pruner's padding weights and
the zoom's crops all call it; it also reads the encoder's input side (:func:`native_side`).
Import everything from here; the modules are ``shapes`` (:class:`Size`, :class:`Frame`),
``sizes`` (sizes from images, per batch row), ``processors`` (each processor family's
arithmetic), ``placement`` (:func:`view_frames`, :func:`check_size`) and ``maps`` (grid maps on
the image, the seen region).

Coordinates are ``(x, y)`` throughout, and sizes are named: :class:`Size` is
``(width, height)``, as PIL's ``image.size`` is. :class:`Frame` is the one rectangle type of the
package, ``(x0, y0, width, height)`` in original pixels (COCO's ``[x, y, w, h]`` order), checked
in one place (its constructor; :func:`as_frame` reads one from ``[x, y, w, h]``). A view's grid
spans a frame, the rectangle the vision encoder's input covers; the part of the photo the model
saw is one (:func:`seen_region`), as are a zoom crop and a grounding box (a frame with a score).
A view's frame may reach outside the image (padding) or cover only part of it (a centre crop). Cell
``(r, c)`` of a ``rows x cols`` grid covers ``[x0 + c * width / cols, x0 + (c + 1) * width / cols)``
by ``[y0 + r * height / rows, y0 + (r + 1) * height / rows)``.

The frame depends on the *processor* that made the inputs, and on each image's original size.
:func:`view_frames` reads the image processor's own settings and replays its arithmetic on the
rectangle (per axis, processed = ``a * original + b``):

* single-view processors (CLIP, ``LlavaImageProcessor``): ``do_pad`` pads to a square first
  (the image pasted at ``((m - w) // 2, (m - h) // 2)`` on an ``m = max(w, h)`` square), then
  ``do_resize`` resizes to ``size`` (``shortest_edge``: the short side to that length and the long
  side to ``int(s * long / short)``; ``height``/``width``: squashed), then ``do_center_crop``
  takes ``crop_size`` from the centre (offset ``floor((n - c) / 2)``). A CLIP-style processor's
  frame is therefore the central region of side ``crop / scale``, not always the whole short side;
* anyres processors (``image_grid_pinpoints``; LLaVA-NeXT and LLaVA-OneVision): the base view is
  the whole image squashed to ``size`` (then ``size`` and ``crop_size`` as above); the
  high-resolution view is the best pinpoint resolution, the image resized into it keeping its
  aspect and centred, cut into ``crop``-pixel crops, with the rows (or columns) the model's
  ``unpad_image`` drops removed: it spans the image up to a fraction of a token. Here ``do_pad``
  means batch padding, not padding to a square. An image the processor does not tile (a
  LLaVA-OneVision prompt with several images) has one view, padded to a square first;
* dynamic-resolution processors (``merge_size`` and ``patch_size``; Qwen2-VL, Qwen2.5-VL,
  Qwen3-VL): the whole image squashed to the ``smart_resize`` size, whose merged grid follows the
  image's aspect ratio, so a size given as ``(height, width)`` instead of ``(width, height)`` is
  caught;
* tiling processors (``min_patches``/``max_patches``; InternVL's ``GotOcr2ImageProcessor`` with
  ``crop_to_patches``): :func:`tile_grid` picks the ``rows x cols`` canvas of square tiles whose
  aspect ratio is closest to the image's, the image is squashed onto it and each tile is a view
  (row-major), then a thumbnail view of the whole image squashed (:func:`tile_frames`). An image
  cut into one tile has that one view. Without the processor the tile count the visual tokens
  show picks the canvas; with it, a size whose tile count differs is caught;
* video frames are squashed to the grid (the frame is the whole frame);
* Gemma 3's pan-and-scan crops (``processor_rule="pan_and_scan"``): each crop is an image
  block of its own after the image's, squashed to the square side; its frame is its crop of
  the original image (:func:`pan_and_scan_frames` from the processor's settings,
  :func:`pan_and_scan_crops` from the crop count alone).

Views that are pieces of the image (tiles, crops) are joined on one grid over the whole image
by :func:`piece_grid` and :func:`regrid` (each cell's mass split by area).

Which of these the processor follows is the model adapter's declaration
(``ModelAdapter.processor_rule``, one of :data:`PROCESSOR_RULES`); the processor's settings give
the numbers. Without a processor the model adapter's fallback rule applies
(``ModelAdapter.fallback_geometry``; one of :data:`RULES` per view). A fallback is a guess about
the processor; pass ``processor=`` for exact frames. ``ModelAdapter.frames`` is the one entry
that reads both declarations.

When the original size is unknown (LLaVA's and Qwen's processor outputs do not carry it, while
LLaVA-NeXT's and LLaVA-OneVision's ``image_sizes`` do), pixel maps raise and say what to pass;
grid-cell maps stay available.
"""

from __future__ import annotations

from .maps import (
    box_cover,
    content_fraction,
    coverage,
    describe_seen,
    frame_aspect,
    piece_grid,
    regrid,
    seen_region,
    upsample,
)
from .placement import RULES, check_size, rule_frame, view_frames
from .processors import (
    PROCESSOR_RULES,
    best_resolution,
    check_processor_rule,
    image_processor_of,
    most_crops,
    native_side,
    pan_and_scan_crops,
    pan_and_scan_frames,
    processor_frames,
    smart_resize_grid,
    tile_frames,
    tile_grid,
)
from .shapes import Frame, Size, as_frame
from .sizes import (
    Sizes,
    as_size,
    as_sizes,
    images_per_row,
    layout_sizes,
    unknown_size_message,
)

__all__ = [
    "PROCESSOR_RULES",
    "RULES",
    "Frame",
    "Size",
    "Sizes",
    "as_frame",
    "as_size",
    "as_sizes",
    "best_resolution",
    "box_cover",
    "check_processor_rule",
    "check_size",
    "content_fraction",
    "coverage",
    "describe_seen",
    "frame_aspect",
    "image_processor_of",
    "images_per_row",
    "layout_sizes",
    "most_crops",
    "native_side",
    "pan_and_scan_crops",
    "pan_and_scan_frames",
    "piece_grid",
    "processor_frames",
    "regrid",
    "rule_frame",
    "seen_region",
    "smart_resize_grid",
    "tile_frames",
    "tile_grid",
    "unknown_size_message",
    "upsample",
    "view_frames",
]
