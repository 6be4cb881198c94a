"""The demo's inputs: an image or a video decoded and fitted to the demo's limits, the prompt
and the pruning options checked, each problem worded for the user (:class:`DemoInputError`),
and the processor's inputs built from them."""

from __future__ import annotations

import logging
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import cv2
import numpy as np
from PIL import Image, UnidentifiedImageError
from torch import nn

import vlm_focus as vf

from .. import hallucination as hal
from ..config import FocusConfig, parse_keep
from ..core.options import options
from ..geometry import Size
from ..grounding import unknown_words
from ..loading import load_video
from ..model_adapters import ModelAdapter, get_adapter, supported_models

logger = logging.getLogger(__name__)

MITIGATIONS = hal.mitigation_choices()
#: Longest image side the demo feeds the model; larger images are downscaled (with a notice).
MAX_SIDE = 1344
#: Images with more pixels than this are refused before decoding (decompression bombs).
MAX_PIXELS = 100_000_000
MAX_PROMPT_CHARS = 1000


class DemoInputError(ValueError):
    """A problem with the user's input, worded for the user."""


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
    return supported_adapter(model).video


def video_request(
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


def supported_adapter(model: nn.Module) -> ModelAdapter:
    """The model's adapter, or a message naming the supported model types."""
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
    adapter = supported_adapter(model)
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


def check_focus_options(focus_options: Mapping[str, Any]) -> None:
    """Every name is a command-line option of ``FocusConfig`` (its values are checked by
    ``FocusConfig`` itself)."""
    known = [o.name for o in options(FocusConfig, cli_only=True)]
    unknown = sorted(set(focus_options) - set(known))
    if unknown:
        raise DemoInputError(
            f"Unknown pruning option {', '.join(map(repr, unknown))}; the options are "
            f"{', '.join(known)}."
        )


def unknown_words_notice(prompt: str, processor: Any) -> list[str]:
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


__all__ = [
    "MAX_PIXELS",
    "MAX_PROMPT_CHARS",
    "MAX_SIDE",
    "MITIGATIONS",
    "DecodedVideo",
    "DemoInputError",
    "check_focus_options",
    "check_options",
    "check_prompt",
    "given",
    "prepare_image",
    "prepare_video",
    "supported_adapter",
    "takes_video",
    "unknown_words_notice",
    "video_request",
]
