"""Look closer: attention-guided zoom for small details, routed to the questions that need it.

A VLM sees a large photo through a coarse grid, so small objects fall below one cell, while its
attention often already points at them. Training-free zoom reads where the question looks (the
attention map of its content words, :class:`~vlm_focus.grounding.GroundingPass`), crops that
region at full resolution and asks again, with the image and the crop or with the crop alone
(SD-RPN turns mid-layer attention into such region proposals). Adaptive routing zooms only
where a routing statistic is low, with a threshold calibrated conformally on held-out questions
(LazyMCoT): the plain answer's first-token confidence (``top1``, the default, ``margin``) or a
statistic of the question's attention map (``peak``, ``entropy``, ``outside``; the map is then
read for every question the zoom can crop, before any answer).

    from vlm_focus import zoom
    found = zoom.look_closer(model, processor, image, "Is there a red_circle in the image?")
    found.answer, found.crops, found.map, found.seconds

    cal, _ = zoom.calibrate_model(model, processor, images, questions, labels, recall=0.9)
    found = zoom.look_closer(model, processor, images, questions, route="adaptive",
                             threshold=cal.threshold, statistic=cal.statistic)
    share = sum(f.routed for f in found) / len(found)

    python -m vlm_focus.zoom calibrate --questions pope_random.jsonl --image-dir DIR --out cal.json

Crops are :class:`vlm_focus.geometry.Frame` rectangles in the image's whole pixels; the crop
rules are pure functions on :mod:`vlm_focus.geometry` sizes (:func:`crop_box`);
the default re-ask per model type comes from its adapter (:func:`default_mode`). Every option,
its routes (:data:`ROUTES`) included, is a field of :class:`ZoomOptions`, listed with its type,
default and help by :func:`zoom_options`.
"""

from ..geometry import frame_aspect, native_side
from ._calibrate import answers_match, calibrate_model
from ._crop import crop_box, union_box
from ._look import ZoomAnswer, look_closer, reask
from ._options import ANCHORS, ASPECTS, ROUTES, ZoomOptions, zoom_options
from ._passes import first_pass, routing_statistics
from ._reask import MODES, chat_text, default_mode, mode_for, multi_image_inputs
from ._regions import choose_crops
from ._routing import (
    MAP_STATISTICS,
    STATISTICS,
    TOKEN_STATISTICS,
    Calibration,
    calibrate,
    cell_statistic,
    first_token_confidence,
    map_statistic,
    outside_share,
    route,
)

__all__ = [
    "ANCHORS",
    "ASPECTS",
    "MAP_STATISTICS",
    "MODES",
    "ROUTES",
    "STATISTICS",
    "TOKEN_STATISTICS",
    "Calibration",
    "ZoomAnswer",
    "ZoomOptions",
    "answers_match",
    "calibrate",
    "calibrate_model",
    "cell_statistic",
    "chat_text",
    "choose_crops",
    "crop_box",
    "default_mode",
    "first_pass",
    "first_token_confidence",
    "frame_aspect",
    "look_closer",
    "map_statistic",
    "mode_for",
    "multi_image_inputs",
    "native_side",
    "outside_share",
    "reask",
    "route",
    "routing_statistics",
    "union_box",
    "zoom_options",
]
