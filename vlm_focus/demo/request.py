"""The demo's request function: one image (or one short video) and one prompt in, everything
the page shows out.

No gradio here: :func:`run_request` validates its inputs, runs the model and returns a
:class:`DemoResult`. Bad input (no image, a file that is not an image or not a video, both an
image and a video, a video for a model that takes images only, an empty prompt, an unsupported
model, an option outside its range) never raises: the result carries ``ok=False`` and a message
meant for the user.

What one request computes, all on the model the app loaded once:

1. the answer of the pruned model (``vf.wrap(model, pruner, keep, layer)``) and of the unpruned
   one, greedy; with a mitigation (by its name in ``hallucination``'s registry, with the
   registry's parameters), also the pruned model's answer under it;
2. prefill time of the same input, unpruned and pruned, measured in this request in
   ``repeats`` alternating pairs (:func:`vlm_focus.timing.paired_seconds`) and reported as the
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
   ``route="always"``, inside the same ``vf.wrap``): the answer with the crop of the prompt's
   attention, next to the plain pruned answer, and the crop box drawn on its map. An image no
   larger than the model's view has nothing to crop (the organism's 192-px scenes): a notice
   says so, and the zoomed answer is the plain one;
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
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import cv2
import numpy as np
import torch
from PIL import Image, UnidentifiedImageError
from torch import nn

import vlm_focus as vf

from .. import hallucination as hal
from .. import zoom as zm
from ..config import FocusConfig, parse_keep
from ..geometry import Frame, Size, as_size, describe_seen, seen_region
from ..grounding import (
    Box,
    GroundingPass,
    HeatMap,
    Mention,
    box_share,
    boxes,
    presence,
    presence_threshold,
    unknown_words,
)
from ..loading import build_inputs, build_video_inputs, decode_new_tokens, load_video, to_model
from ..model_adapters import (
    ImageLayout,
    ModelAdapter,
    get_adapter,
    supported_models,
)
from ..setting import RunSetting
from ..timing import PairedTiming, prefill_report, pruned_prefill_timing
from ..trace import FocusTrace
from .overlays import (
    draw_boxes,
    frame_strip,
    heat_overlay,
    kept_mask_overlay,
    label_overlay,
    shade_unseen,
)

logger = logging.getLogger(__name__)

MITIGATIONS = hal.mitigation_choices()
#: Longest image side the demo feeds the model; larger images are downscaled (with a notice).
MAX_SIDE = 1344
#: Images with more pixels than this are refused before decoding (decompression bombs).
MAX_PIXELS = 100_000_000
MAX_PROMPT_CHARS = 1000
MAX_BOXES = 3
MAX_FIXATION_STEPS = 12  # decoding steps drawn in the fixation strip
#: Boxes of larger maps are found on the map resized to this many pixels (longest side).
BOX_SIDE = 384
#: What the page shows for a phrase whose presence score is below the model's threshold.
NOT_FOUND = "not found"

#: wrap() and the attention probes hook the model instance, and a fast tokenizer refuses
#: concurrent calls: one request uses the model and its processor at a time.
MODEL_LOCK = threading.Lock()


class DemoInputError(ValueError):
    """A problem with the user's input, worded for the user."""


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
class DecodedVideo:
    """A video's frames as :func:`vlm_focus.loading.load_video` decoded them, with the metadata
    that places them in time (``fps``, ``frames_indices``)."""

    frames: np.ndarray  # [T, H, W, 3] uint8 RGB
    metadata: Any  # transformers' VideoMetadata

    @property
    def size(self) -> Size:
        return Size(int(self.frames.shape[2]), int(self.frames.shape[1]))

    def index(self, position: int) -> int:
        """The frame's index in the video file (``position``: its place in :attr:`frames`)."""
        return int(self.metadata.frames_indices[position])

    def seconds(self, position: int) -> float:
        return self.index(position) / float(self.metadata.fps)


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


# --- input checks ---------------------------------------------------------------------------
def prepare_image(
    image: Any, max_side: int = MAX_SIDE, max_pixels: int = MAX_PIXELS
) -> tuple[Image.Image, list[str]]:
    """An RGB image no larger than ``max_side`` on its longest side, and notices for the user.

    ``image`` is a file path, a PIL image or an ``[H, W, 3]``/``[H, W]`` uint8 array. Raises
    :class:`DemoInputError` with a user-facing message for anything else.
    """
    notices: list[str] = []
    if image is None or (isinstance(image, str) and not image.strip()):
        raise DemoInputError("No image: upload an image or pick a sample scene.")
    if isinstance(image, np.ndarray):
        if image.ndim not in (2, 3) or image.size == 0 or (image.ndim == 3 and image.shape[2] > 4):
            raise DemoInputError(f"The image array has an unusable shape {list(image.shape)}.")
        image = Image.fromarray(np.asarray(image).astype(np.uint8))
    if isinstance(image, (str, Path)):
        image = _open(Path(image), max_side, max_pixels)
    if not isinstance(image, Image.Image):
        raise DemoInputError(f"Unsupported image input of type {type(image).__name__}.")
    width, height = image.size
    if width < 1 or height < 1:
        raise DemoInputError("The image is empty (0 pixels).")
    if width * height > max_pixels:
        raise DemoInputError(_too_large(width, height, max_pixels))
    original = image.size
    rgb = image.convert("RGB")
    if max(rgb.size) > max_side:
        rgb.thumbnail((max_side, max_side), Image.Resampling.LANCZOS)
    if rgb.size != original:
        notices.append(
            f"The image was {original[0]}x{original[1]} pixels; it was downscaled to "
            f"{rgb.size[0]}x{rgb.size[1]} for this demo."
        )
    return rgb, notices


def _too_large(width: int, height: int, max_pixels: int) -> str:
    return (
        f"The image is too large to process ({width}x{height} = {width * height / 1e6:.0f} "
        f"megapixels; the limit is {max_pixels / 1e6:.0f})."
    )


def _open(path: Path, max_side: int, max_pixels: int) -> Image.Image:
    """Open and decode a file, refusing non-images and oversized images before decoding."""
    if not path.is_file():
        raise DemoInputError(f"Image file not found: {path.name}")
    try:
        with warnings.catch_warnings():  # the pixel limit is checked here, before decoding
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            opened = Image.open(path)
        with opened:
            width, height = opened.size
            if width * height > max_pixels:
                raise DemoInputError(_too_large(width, height, max_pixels))
            opened.draft("RGB", (max_side, max_side))  # JPEG: decode at a reduced scale
            opened.load()
            return opened.copy()
    except DemoInputError:
        raise
    except Image.DecompressionBombError as err:
        raise DemoInputError(f"The image is too large to process: {err}") from err
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as err:
        kind = "not an image" if isinstance(err, UnidentifiedImageError) else "corrupt"
        raise DemoInputError(
            f"The file '{path.name}' is {kind}: it could not be read as an image."
        ) from err


def given(value: Any) -> bool:
    """Whether an input slot holds something (gradio sends ``None`` or ``""`` for empty)."""
    return value is not None and not (isinstance(value, str) and not value.strip())


def prepare_video(video: Any, max_side: int = MAX_SIDE) -> tuple[DecodedVideo, list[str]]:
    """A video file's frames, as :func:`vlm_focus.loading.load_video` takes them (at even
    steps), no larger than ``max_side`` on their longest side, and notices for the user.

    Raises :class:`DemoInputError` with a user-facing message for anything that is not a
    readable video file.
    """
    if not isinstance(video, (str, Path)) or not given(str(video)):
        raise DemoInputError(f"Unsupported video input of type {type(video).__name__}.")
    path = Path(video)
    if not path.is_file():
        raise DemoInputError(f"Video file not found: {path.name}")
    try:
        frames, metadata = load_video(path)
    except Exception as err:  # OpenCV and transformers each raise their own kind for a bad file
        logger.info("could not decode %s: %s", path.name, err)
        raise DemoInputError(f"The file '{path.name}' could not be read as a video.") from err
    return _fit_frames(DecodedVideo(np.asarray(frames, dtype=np.uint8), metadata), max_side)


def _fit_frames(video: DecodedVideo, max_side: int) -> tuple[DecodedVideo, list[str]]:
    """Downscale frames longer than ``max_side`` (area interpolation), as images are."""
    width, height = video.size
    scale = max_side / max(width, height)
    if scale >= 1:
        return video, []
    small = (max(1, round(width * scale)), max(1, round(height * scale)))
    frames = np.stack([cv2.resize(f, small, interpolation=cv2.INTER_AREA) for f in video.frames])
    notice = (
        f"The video's frames were {width}x{height} pixels; they were downscaled to "
        f"{small[0]}x{small[1]} for this demo."
    )
    return DecodedVideo(frames, video.metadata), [notice]


def takes_video(model: nn.Module) -> bool:
    """Whether the model reads videos, as its adapter declares."""
    return _adapter(model).video


def _video_request(
    model: nn.Module, image: Any, video: Any, zoom: bool, max_side: int
) -> tuple[DecodedVideo, list[str]]:
    """The decoded video, after the checks that need no decoding: one input at a time, a
    model that takes videos, no zoom."""
    if given(image):
        raise DemoInputError(
            "Both an image and a video were given: clear one of them, the demo asks about one "
            "at a time."
        )
    if not takes_video(model):
        raise DemoInputError(
            f"This model ({model.config.model_type}) takes images only, not videos: upload an "
            "image, or load a model that takes videos."
        )
    if zoom:
        raise DemoInputError("Look closer (zoom) crops an image; untick it to ask about a video.")
    return prepare_video(video, max_side)


def check_prompt(prompt: Any) -> str:
    if not isinstance(prompt, str) or not prompt.strip():
        raise DemoInputError("The prompt is empty: type a question or a phrase.")
    prompt = prompt.strip()
    if len(prompt) > MAX_PROMPT_CHARS:
        raise DemoInputError(
            f"The prompt is {len(prompt)} characters long; the limit is {MAX_PROMPT_CHARS}."
        )
    return prompt


def _adapter(model: nn.Module) -> ModelAdapter:
    try:
        return get_adapter(model)
    except ValueError:
        model_type = getattr(getattr(model, "config", None), "model_type", None)
        raise DemoInputError(
            f"This model is not supported (model type {model_type!r}); supported types: "
            f"{', '.join(supported_models())}."
        ) from None


def check_options(
    model: nn.Module, pruner: Any, keep: Any, layer: Any, mitigation: Any, pruner_options: Any = ""
) -> dict[str, Any]:
    """Model support, pruner name, keep ratio/count, layer, mitigation and the pruner's own
    options (``"NAME=VALUE, ..."``, as ``--pruner-option`` reads them), as user messages;
    returns the pruner's options."""
    adapter = _adapter(model)
    if pruner not in vf.pruners():
        raise DemoInputError(f"Unknown pruner {pruner!r}; choose one of {', '.join(vf.pruners())}.")
    try:
        parse_keep(keep)  # the one rule of keep, as in vf.wrap and every command
    except ValueError as err:
        raise DemoInputError(f"{err}.") from None
    n_layers = len(adapter.decoder_layers(model))
    if isinstance(layer, float) and layer.is_integer():
        layer = int(layer)
    if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < n_layers:
        raise DemoInputError(f"layer={layer!r}: this model prunes at a layer in [0, {n_layers}).")
    if mitigation not in MITIGATIONS:
        raise DemoInputError(
            f"Unknown mitigation {mitigation!r}; choose one of {', '.join(MITIGATIONS)}."
        )
    if isinstance(pruner_options, Mapping):
        return dict(pruner_options)
    try:
        return vf.pruners.read_pruner_options(pruner, pruner_options or "")
    except ValueError as err:
        raise DemoInputError(f"{err}.") from None


# --- the request ----------------------------------------------------------------------------
def run_request(
    model: nn.Module,
    processor: Any,
    image: Any,
    prompt: Any,
    pruner: str = "fastv",
    keep: float | int = 0.25,
    layer: int = 2,
    mitigation: str = "none",
    *,
    video: Any = None,
    max_new_tokens: int = 24,
    max_side: int = MAX_SIDE,
    repeats: int = 5,
    zoom: bool = False,
    pruner_options: str | Mapping[str, Any] = "",
) -> DemoResult:
    """Answer ``prompt`` about ``image`` pruned and unpruned, and draw what the model attended to;
    with ``zoom``, also the pruned model's answer when it looks closer (module docstring, 5).
    ``video``: a video file to ask about instead of an image (module docstring, 6).
    ``pruner_options``: the pruner's own options, ``"base=text, positional=false"`` (as the
    command lines' ``--pruner-option``) or a dict.

    Never raises for bad input or a failing model call: see :class:`DemoResult`.
    """
    start = time.perf_counter()
    try:
        if given(video):
            source, notices = _video_request(model, image, video, bool(zoom), max_side)
        else:
            source, notices = prepare_image(image, max_side=max_side)
        prompt = check_prompt(prompt)
        if isinstance(keep, float) and keep > 1 and keep.is_integer():
            keep = int(keep)
        layer = int(layer) if isinstance(layer, float) and layer.is_integer() else layer
        own = check_options(model, pruner, keep, layer, mitigation, pruner_options)
        with MODEL_LOCK:  # the processor too: a fast tokenizer refuses concurrent calls
            notices += _unknown_words_notice(prompt, processor)
            inputs = to_model(model, _model_inputs(processor, source, prompt))
            setting = RunSetting(
                focus=FocusConfig(pruner=pruner, keep=keep, layer=layer, options=own),
                mitigation=mitigation,
                max_new_tokens=max_new_tokens,
            )
            generic = None
            if setting.generic_prompt is not None:
                generic = to_model(model, _model_inputs(processor, source, setting.generic_prompt))
            if isinstance(source, DecodedVideo):
                result = _compute_video(
                    model, processor, source, prompt, inputs, generic, setting, repeats
                )
            else:
                result = _compute(
                    model, processor, source, prompt, inputs, generic, setting, repeats, bool(zoom)
                )
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


def _unknown_words_notice(prompt: str, processor: Any) -> list[str]:
    """A notice naming the prompt's words the model's tokenizer cannot spell (none: no notice)."""
    unknown = unknown_words(prompt, processor)
    if not unknown:
        return []
    quoted = ", ".join(f"'{w}'" for w in unknown)
    return [
        f"The model cannot read {quoted}: its tokenizer does not know "
        f"{'this word' if len(unknown) == 1 else 'these words'} (each becomes its unknown "
        "token), so it can neither answer about them nor find them."
    ]


def _model_inputs(
    processor: Any, source: Image.Image | DecodedVideo, prompt: str
) -> dict[str, Any]:
    """The processor's inputs for the image or the decoded video and one prompt."""
    if isinstance(source, DecodedVideo):
        return build_video_inputs(processor, source.frames, source.metadata, prompt)
    return build_inputs(processor, source, prompt)


@dataclass
class _Answers:
    """What :func:`_answer` returns: the three answers, the pruned run's tokens and trace, its
    timing, and the zoom's answer (``None`` without one)."""

    unpruned: str
    pruned: str
    mitigated: str
    pruned_seq: torch.Tensor  # [1, prompt + new tokens]
    trace: FocusTrace
    timing: PairedTiming | None
    zoom: zm.ZoomAnswer | None = None


def _answer(
    model: nn.Module,
    processor: Any,
    inputs: dict[str, Any],
    generic: dict[str, Any] | None,
    setting: RunSetting,
    repeats: int,
    look_closer: Callable[[], zm.ZoomAnswer] | None = None,
) -> _Answers:
    """The request's answers under ``setting`` (its pruning, then its mitigation on the
    pruned model), against the unpruned model's, and the prefill timing of both.
    ``look_closer()`` runs under the same wrap as the pruned answer."""
    plain = RunSetting(max_new_tokens=setting.max_new_tokens)
    with torch.inference_mode():
        full_seq = plain.generate(model, inputs)
    answer_unpruned = decode_new_tokens(processor, inputs, full_seq)[0]
    answer_mitigated = ""
    with torch.inference_mode(), vf.wrap(model, config=setting.focus) as handle:
        if setting.mitigation != "none":  # mitigations read and steer the pruned attention
            mitigated = setting.generate(model, inputs, handle=handle, generic_inputs=generic)
            answer_mitigated = decode_new_tokens(processor, inputs, mitigated)[0]
        pruned_seq = plain.generate(model, inputs)
        trace = handle.last_trace
        found = None if look_closer is None else look_closer()
    timing = pruned_prefill_timing(
        model,
        inputs,
        lambda: vf.wrap(model, config=setting.focus),
        trace.n_kept[0],
        trace.n_visual[0],
        max(1, repeats),
    )
    answer = decode_new_tokens(processor, inputs, pruned_seq)[0]
    return _Answers(answer_unpruned, answer, answer_mitigated, pruned_seq, trace, timing, found)


def _compute(
    model: nn.Module,
    processor: Any,
    picture: Image.Image,
    prompt: str,
    inputs: dict[str, Any],
    generic: dict[str, Any] | None,
    setting: RunSetting,
    repeats: int,
    zoom: bool = False,
) -> DemoResult:
    """An image request: the answers (:func:`_answer`), the kept-token mask, the fixation
    strip, the maps with their boxes and the zoom."""

    def look_closer() -> zm.ZoomAnswer:
        # prune the full view, zoom on a second pass: both under the same wrap
        return zm.look_closer(
            model, processor, picture, prompt, route="always", max_new_tokens=setting.max_new_tokens
        )

    answers = _answer(
        model, processor, inputs, generic, setting, repeats, look_closer if zoom else None
    )
    pruned_seq, trace = answers.pruned_seq, answers.trace
    image = np.asarray(picture, dtype=np.uint8)
    layout = get_adapter(model).layout(model, inputs["input_ids"], inputs)[0][0]
    frames = get_adapter(model).frames(layout, as_size(picture), processor=processor)
    seen, seen_share = seen_region(as_size(picture), frames)  # what the processor kept
    kept = trace.kept[0].to(layout.positions.device)
    grid, frame = kept_grid(layout, kept, frames)
    kept_overlay = shade_unseen(kept_mask_overlay(image, grid, frame), seen)

    prompt_len = inputs["input_ids"].shape[1]
    strip = None
    if trace.fixations:  # a decode-time pruner: draw each step's fixation
        tokens = processor.tokenizer.convert_ids_to_tokens(pruned_seq[0, prompt_len:].tolist())
        panels = []
        for step in trace.fixations[:MAX_FIXATION_STEPS]:
            grid, frame = kept_grid(layout, step[0], frames)
            panels.append(shade_unseen(kept_mask_overlay(image, grid, frame, dim=0.35), seen))
        strip = frame_strip(panels, [str(t) for t in tokens[1 : len(panels) + 1]])
    prompt_map, object_maps = _ground(
        model, processor, inputs, prompt, pruned_seq[:1, prompt_len:], picture, seen
    )
    notices = []
    if seen_share < 1.0:
        notices.append(
            f"The model saw only {describe_seen(as_size(picture), seen, seen_share)}: its "
            "processor crops the photo, so the shaded part was never seen and nothing there "
            "can be found."
        )
    if prompt_map is None:
        notices.append("The prompt has no words to map onto the image.")
    elif prompt_map.presence is None:
        notices.append(
            "The prompt names no object: its map shows where the whole question looks, "
            "without boxes."
        )
    zoomed = _zoom_view(answers.zoom, image, processor, notices, seen)
    return DemoResult(
        ok=True,
        notices=notices,
        image=image,
        answer=answers.pruned,
        answer_unpruned=answers.unpruned,
        answer_mitigated=answers.mitigated,
        mitigation=setting.mitigation,
        prompt_map=prompt_map,
        object_maps=object_maps,
        kept_overlay=kept_overlay,
        fixation_strip=strip,
        n_kept=int(kept.numel()),
        n_visual=int(layout.positions.numel()),
        timing=answers.timing,
        **zoomed,
    )


def _zoom_view(
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


def _boxes(heat: HeatMap, max_boxes: int) -> list[Box]:
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


def _prompt_heat(
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


def _ground(
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
    heat, label, words = _prompt_heat(gp, prompt, processor)
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
        found_boxes = _boxes(heat, max_boxes)
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


# --- video ----------------------------------------------------------------------------------
def _compute_video(
    model: nn.Module,
    processor: Any,
    video: DecodedVideo,
    prompt: str,
    inputs: dict[str, Any],
    generic: dict[str, Any] | None,
    setting: RunSetting,
    repeats: int,
) -> DemoResult:
    """A video request: the answers (:func:`_answer`) and the prompt's map in each view of the
    video."""
    answers = _answer(model, processor, inputs, generic, setting, repeats)
    frame_maps, label = _frame_maps(model, processor, inputs, prompt, video)
    if frame_maps:
        notices = [f"Each frame shows the attention to '{label}', all on one colour scale."]
    else:
        notices = ["The prompt has no words to map onto the video."]
    return DemoResult(
        ok=True,
        notices=notices,
        answer=answers.pruned,
        answer_unpruned=answers.unpruned,
        answer_mitigated=answers.mitigated,
        mitigation=setting.mitigation,
        n_kept=int(answers.trace.n_kept[0]),
        n_visual=int(answers.trace.n_visual[0]),
        timing=answers.timing,
        video=True,
        frame_maps=frame_maps,
    )


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


def _frame_maps(
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
    heat, label, _ = _prompt_heat(gp, prompt, processor)
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


__all__ = [
    "MAX_PIXELS",
    "MAX_SIDE",
    "MITIGATIONS",
    "MODEL_LOCK",
    "NOT_FOUND",
    "DecodedVideo",
    "DemoInputError",
    "DemoResult",
    "FrameMap",
    "GroundedMap",
    "check_options",
    "check_prompt",
    "frame_spans",
    "given",
    "kept_grid",
    "prepare_image",
    "prepare_video",
    "run_request",
    "takes_video",
]
