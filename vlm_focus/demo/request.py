"""The demo's request function: one image (or one short video) and one prompt in, everything
the page shows out.

No gradio here: :func:`run_request` validates its inputs, runs the model and returns a
:class:`DemoResult`. Bad input (no image, a file that is not an image or not a video, both an
image and a video, a video for a model that takes images only, an empty prompt, an unsupported
model, an option outside its range) never raises: the result carries ``ok=False`` and a message
meant for the user.

What one request computes, all on the model the app loaded once, each answer through a
:class:`~vlm_focus.setting.RunSetting` (:mod:`.answers`):

1. the answer of the pruned model (``FocusConfig(pruner, keep, layer)``) and of the unpruned
   one, greedy; with a mitigation (by its name in ``hallucination``'s registry, with the
   registry's parameters), also the pruned model's answer under it;
2. prefill time of the same input, unpruned and pruned, measured in this request in
   ``repeats`` alternating pairs (``RunSetting.prefill_timing``) and reported as the
   command lines report it: the median pair's times, their ratio, the pairs' spread and a
   warning when it is too wide; nothing is timed when nothing is pruned;
3. the kept-token mask: ``trace.kept`` (original sequence positions) mapped through the
   adapter's layout to grid cells, drawn over the image;
4. attention maps from one teacher-forced pass over prompt + pruned answer on the unpruned model
   (a ``grounding.GroundingPass`` at the model's default grounding layers, TAG maps): one for
   the objects the prompt names (a prompt that names none: the question's map, no boxes), one
   per object the answer names, once each (its ``mentions()``; places are no objects), each
   with its presence score (``grounding.presence``, the model's own ``P(yes)``) and, when
   present, boxes (``grounding.boxes``) and their region score (the MTLA share of the map's
   attention inside the box, ``grounding.box_share``); an absent phrase shows "not found"
   instead of a box. The maps and the kept-token mask sit on the image through
   ``vlm_focus.geometry``, from the processor's own settings; the part of the photo the
   processor crops away is shaded, with a notice;
5. with ``zoom=True``, the pruned model looks closer (:func:`vlm_focus.zoom.look_closer`,
   ``route="always"``, a setting of its own on the same pruning): the answer with the crop of
   the prompt's attention, next to the plain pruned answer, and the crop box drawn on its map.
   An image no larger than the model's view has nothing to crop (the organism's 192-px
   scenes): a notice says so, and the zoomed answer is the plain one;
6. a video instead of an image (``video=``, a model whose adapter knows a video token): its
   frames are decoded by :func:`vlm_focus.loading.load_video` and handed to the model's own
   processor; 1 and 2 run as for an image, and the prompt's map is drawn once per frame
   (``HeatMap.frame_maps``, one colour scale for all frames), each captioned with the frames
   it covers, their times and its share of the map. Boxes, object maps, the kept-token mask
   and the zoom are image-only.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping
from typing import Any

from PIL import Image
from torch import nn

from ..config import FocusConfig, read_video_pruner
from .answers import Answers, DemoSettings, answer
from .inputs import (
    MAX_SIDE,
    DecodedVideo,
    DemoInputError,
    check_focus_options,
    check_options,
    check_prompt,
    given,
    prepare_image,
    unknown_words_notice,
    video_request,
)
from .maps import ImageView, frame_maps, ground, prompt_map_notices, zoom_view
from .result import DemoResult

logger = logging.getLogger(__name__)

#: wrap() and the attention probes hook the model instance, and a fast tokenizer refuses
#: concurrent calls: one request uses the model and its processor at a time.
MODEL_LOCK = threading.Lock()


# --- the request ----------------------------------------------------------------------------
def run_request(
    model: nn.Module,
    processor: Any,
    image: Any,
    prompt: Any,
    pruner: str = FocusConfig.pruner,
    keep: float | int = FocusConfig.keep,
    layer: int = FocusConfig.layer,
    mitigation: str = "none",
    *,
    video: Any = None,
    max_new_tokens: int = 24,
    max_side: int = MAX_SIDE,
    repeats: int = 5,
    zoom: bool = False,
    pruner_options: str | Mapping[str, Any] = "",
    **focus_options: Any,
) -> DemoResult:
    """Answer ``prompt`` about ``image`` pruned and unpruned, and draw what the model attended to;
    with ``zoom``, also the pruned model's answer when it looks closer (module docstring, 5).
    ``video``: a video file to ask about instead of an image (module docstring, 6).
    ``pruner_options``: the pruner's own options, ``"base=text, positional=false"`` (as the
    command lines' ``--pruner-option``) or a dict. ``focus_options``: the other options of
    :class:`~vlm_focus.FocusConfig` (``query_rows``, ``reduce``, ...), at its defaults.

    Never raises for bad input or a failing model call: see :class:`DemoResult`.
    """
    start = time.perf_counter()
    try:
        if given(video):
            source, notices = video_request(model, image, video, bool(zoom), max_side)
        else:
            source, notices = prepare_image(image, max_side=max_side)
        prompt = check_prompt(prompt)
        if isinstance(keep, float) and keep > 1 and keep.is_integer():
            keep = int(keep)
        layer = int(layer) if isinstance(layer, float) and layer.is_integer() else layer
        own = check_options(model, pruner, keep, layer, mitigation, pruner_options)
        check_focus_options(focus_options)
        if "video_pruner" in focus_options:  # the page's dropdown says "none" for None
            focus_options["video_pruner"] = read_video_pruner(focus_options["video_pruner"])
        settings = DemoSettings.of(
            FocusConfig(pruner=pruner, keep=keep, layer=layer, options=own, **focus_options),
            mitigation,
            bool(zoom),
            max_new_tokens,
        )
        with MODEL_LOCK:  # the processor too: a fast tokenizer refuses concurrent calls
            notices += unknown_words_notice(prompt, processor)
            answers = answer(model, processor, source, prompt, settings, repeats)
            if isinstance(source, DecodedVideo):
                result = _video_result(model, processor, source, prompt, answers)
            else:
                result = _image_result(model, processor, source, prompt, answers)
        result.notices = notices + result.notices
    except DemoInputError as err:
        return DemoResult(ok=False, message=str(err))
    except ValueError as err:  # option checks of wrap(), the processor and grounding
        return DemoResult(ok=False, message=f"The request could not be run: {err}")
    except Exception as err:  # a model failure must not take the app down
        logger.exception("demo request failed")
        return DemoResult(ok=False, message=f"The request failed ({type(err).__name__}: {err}).")
    result.seconds = time.perf_counter() - start
    return result


def _image_result(
    model: nn.Module, processor: Any, picture: Image.Image, prompt: str, answers: Answers
) -> DemoResult:
    """An image request's page: the answers, the kept-token mask, the fixation strip, the
    maps with their boxes and the zoom."""
    inputs, trace = answers.pruned.inputs, answers.pruned.trace
    view = ImageView.of(model, processor, inputs, picture)
    kept = view.layout.positions if trace is None else trace.kept[0]  # None: nothing pruned
    strip = None
    if trace is not None and trace.fixations:  # a decode-time pruner: where each step looked
        tokens = processor.tokenizer.convert_ids_to_tokens(answers.written[0].tolist())
        strip = view.fixation_strip(trace.fixations, tokens)
    prompt_map, object_maps = ground(
        model, processor, inputs, prompt, answers.written, picture, view.seen
    )
    notices = view.notices() + prompt_map_notices(prompt_map)
    zoomed = zoom_view(answers.zoom, view.image, processor, notices, view.seen)
    return DemoResult(
        ok=True,
        notices=notices,
        image=view.image,
        prompt_map=prompt_map,
        object_maps=object_maps,
        kept_overlay=view.kept_overlay(kept),
        fixation_strip=strip,
        **answers.result_fields(),
        **zoomed,
    )


def _video_result(
    model: nn.Module, processor: Any, video: DecodedVideo, prompt: str, answers: Answers
) -> DemoResult:
    """A video request's page: the answers and the prompt's map in each view of the video."""
    maps, label = frame_maps(model, processor, answers.pruned.inputs, prompt, video)
    if maps:
        notices = [f"Each frame shows the attention to '{label}', all on one colour scale."]
    else:
        notices = ["The prompt has no words to map onto the video."]
    return DemoResult(
        ok=True,
        notices=notices,
        video=True,
        frame_maps=maps,
        **answers.result_fields(),
    )


__all__ = ["MODEL_LOCK", "run_request"]
