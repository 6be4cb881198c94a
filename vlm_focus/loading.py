"""Load a supported VLM and its processor (offline-friendly) as a command's options say, and
build its inputs for images or one video."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch
from PIL import Image, UnidentifiedImageError

from .asset_paths import default_model_path, is_embedded
from .core.options import check_choices, option
from .model_adapters import get_adapter

#: Seconds to wait for the hub before saying it cannot be reached.
HUB_TIMEOUT = 10.0
#: The torch / torchvision pair the video processors are tested with (a torchvision built for
#: another torch fails at import); pyproject's ``video`` extra pins the same pair.
VIDEO_INSTALL = "pip install torch==2.14.1 torchvision==0.29.1"
ATTENTION = ("sdpa", "eager", "flash_attention_2")


def resolve_model_path(model: str | None) -> str:
    """``None``/``"embedded"`` → the shipped organism model; anything else is a path or hub id."""
    if is_embedded(model):
        path = default_model_path()
        if not (path / "config.json").exists():
            raise FileNotFoundError(
                f"the embedded default model is missing at {path}; reinstall vlm-focus or pass "
                "--model PATH_OR_HUB_ID"
            )
        return str(path)
    return model


def resolve_device(device: str | None) -> str:
    """``device``, or for ``None`` the default of every command: cuda when available, else cpu."""
    if device is not None:
        return device
    return "cuda" if torch.cuda.is_available() else "cpu"


def load_model(
    model: str | None = None,
    *,
    dtype: torch.dtype | str = "auto",
    device: str = "cpu",
    attn_implementation: str = "sdpa",
    trust_remote_code: bool = False,
) -> tuple[torch.nn.Module, Any]:
    """``(model, processor)`` for a supported VLM, loaded with safetensors only.

    Raises ``ValueError`` for a model type without an adapter, and :class:`MissingExtra` for a
    model whose processor needs torchvision where it is missing or does not match torch
    (before loading any weights).
    """
    check_torchvision()  # one that does not load breaks transformers' own imports
    path = resolve_model_path(model)
    config = _config(path, trust_remote_code)
    adapter = get_adapter(_ConfigHolder(config))  # unsupported model types fail here, named
    if adapter.video:  # the model reads videos: its processor has a video processor
        check_torchvision(config.model_type)
    from transformers import AutoModelForImageTextToText

    vlm = AutoModelForImageTextToText.from_pretrained(
        path,
        dtype=dtype,
        attn_implementation=attn_implementation,
        use_safetensors=True,
        trust_remote_code=trust_remote_code,
    )
    processor = load_processor(path, trust_remote_code=trust_remote_code)
    return vlm.to(device).eval(), processor


def load_processor(path: str, trust_remote_code: bool = False) -> Any:
    """``AutoProcessor`` of `path`, with the tokenizer class its ``tokenizer_config.json``
    names when that is the generic ``TokenizersBackend``.

    transformers gives some model types (``qwen3_5`` among them) their own tokenizer class
    whatever the folder declares, and that class rebuilds a byte-level BPE from the vocabulary,
    which misreads any other ``tokenizer.json`` (organism-qwen35's word-level one becomes unknown
    tokens). ``TokenizersBackend`` reads ``tokenizer.json`` as written, so honouring a folder
    that declares it is right for every model."""
    from transformers import AutoProcessor

    tokenizer = declared_tokenizer(path)
    extra = {} if tokenizer is None else {"tokenizer": tokenizer}
    return AutoProcessor.from_pretrained(path, trust_remote_code=trust_remote_code, **extra)


def declared_tokenizer(path: str) -> Any:
    """The tokenizer of `path` read as written when its ``tokenizer_config.json`` declares the
    generic ``TokenizersBackend`` (see :func:`load_processor`); ``None`` otherwise."""
    from transformers import TokenizersBackend
    from transformers.models.auto.tokenization_auto import get_tokenizer_config

    if get_tokenizer_config(path).get("tokenizer_class") != "TokenizersBackend":
        return None
    return TokenizersBackend.from_pretrained(path)


@dataclass
class LoadOptions:
    """How a command loads its model (``vlm-focus run``, ``bench``, ``eval``, ``demo``)."""

    model: str | None = option(
        None,
        "model folder or hub id",
        default_text="embedded, the shipped organism model",
        metavar="PATH_OR_ID",
    )
    device: str | None = option(
        None,
        "torch device",
        default_text="cuda when available, else cpu; under accelerate launch, the "
        "process's own device",
    )
    attn: str = option("sdpa", "attention implementation", choices=ATTENTION)
    trust_remote_code: bool = option(False, "allow code from the model repository to run")

    def __post_init__(self) -> None:
        check_choices(self, LoadOptions)
        if self.model is not None and not str(self.model).strip():
            raise ValueError("model is empty: pass a model folder or hub id, or leave it out")

    def load(self, device: str) -> tuple[torch.nn.Module, Any]:
        """``(model, processor)`` of these options on ``device`` (:func:`load_model`)."""
        return load_model(
            self.model,
            device=device,
            attn_implementation=self.attn,
            trust_remote_code=self.trust_remote_code,
        )


class MissingExtra(ModuleNotFoundError):
    """A module a command or a model needs is missing, or installed but unable to load; the
    message names it and the install that fixes it, in one line."""


def check_torchvision(video_model: str | None = None) -> None:
    """Raise :class:`MissingExtra` naming :data:`VIDEO_INSTALL` when torchvision is installed
    but does not load (a build for another torch: "operator torchvision::nms does not exist";
    transformers imports it wherever it is installed, so every model fails), or when it is
    missing and ``video_model`` (a ``model_type``) needs it: the processors of the models that
    read videos (Qwen-VL, LLaVA-OneVision) hold a video processor that cannot load without
    it."""
    import importlib
    import importlib.metadata
    import importlib.util

    if importlib.util.find_spec("torchvision") is None:
        if video_model is not None:
            raise MissingExtra(
                f"the {video_model} processor reads videos with torchvision, which is not "
                f"installed: {VIDEO_INSTALL}",
                name="torchvision",
            )
        return
    try:
        importlib.import_module("torchvision")
    except (ImportError, RuntimeError, OSError) as err:
        try:
            installed = f"torchvision {importlib.metadata.version('torchvision')}"
        except importlib.metadata.PackageNotFoundError:
            installed = "torchvision"
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise MissingExtra(
            f"{installed} does not load with torch {torch.__version__} ({first}); torch and "
            f"torchvision must be a matching pair: {VIDEO_INSTALL}",
            name="torchvision",
        ) from None


class ModelNotFoundError(OSError):
    """A model that is neither a local folder, nor in the Hugging Face cache, nor reachable on
    the hub: one line that says which and what to pass instead."""


def _config(path: str, trust_remote_code: bool) -> Any:
    """The model's config: from a local folder, else the Hugging Face cache, else the hub. An
    unreachable hub is asked once, with a short timeout, instead of retrying for half a
    minute, and gives a :class:`ModelNotFoundError`."""
    from transformers import AutoConfig

    if Path(path).is_dir():
        if not (Path(path) / "config.json").is_file():
            raise ModelNotFoundError(f"{path} is a folder without config.json: not a model folder")
        return AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    try:
        return AutoConfig.from_pretrained(
            path, trust_remote_code=trust_remote_code, local_files_only=True
        )
    except OSError:
        pass  # not in the cache: ask the hub
    from huggingface_hub import HfApi, constants
    from huggingface_hub.errors import HFValidationError, RepositoryNotFoundError

    where = f"model {path!r} is not a local folder and not in the Hugging Face cache"
    if constants.HF_HUB_OFFLINE:
        raise ModelNotFoundError(f"{where}, and HF_HUB_OFFLINE is set")
    try:
        HfApi().model_info(path, timeout=HUB_TIMEOUT)
    except HFValidationError:
        raise ModelNotFoundError(f"no model folder {path!r}, and it is not a hub id") from None
    except RepositoryNotFoundError:
        raise ModelNotFoundError(f"{where}, and the hub has no such model") from None
    except Exception as err:  # the hub's client raises its HTTP library's own errors
        raise ModelNotFoundError(
            f"{where}, and the hub cannot be reached ({type(err).__name__}: {err}); pass a "
            "local model folder (or leave --model out for the embedded model)"
        ) from None
    return AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)


class _ConfigHolder:
    def __init__(self, config: Any) -> None:
        self.config = config


def load_image(image: str | Path | Image.Image) -> Image.Image:
    """An RGB PIL image from a path or a PIL image; clear errors for missing or unreadable files."""
    if isinstance(image, Image.Image):
        return image.convert("RGB")
    if not isinstance(image, (str, Path)):
        raise TypeError(f"image must be a path or a PIL image, got {type(image).__name__}")
    path = Path(image)
    if not path.is_file():
        raise FileNotFoundError(f"image file not found: {path}")
    try:
        with Image.open(path) as opened:
            return opened.convert("RGB")
    except (UnidentifiedImageError, OSError) as err:
        raise ValueError(f"{path} is not a readable image: {err}") from err


class Video(NamedTuple):
    """One decoded video: its frames ``[T, H, W, 3]`` (uint8 RGB) and the metadata a processor
    needs to place them in time."""

    frames: Any
    metadata: Any


def is_video(media: Any) -> bool:
    """``media`` is one decoded video (its ``frames`` and ``metadata``), not a list of images."""
    return hasattr(media, "frames") and hasattr(media, "metadata")


def load_video(video: str | Path, frames: int = 8) -> Video:
    """``(frames [T, H, W, 3] uint8 RGB, metadata)`` of a video file, ``frames`` of them taken
    at even steps (all of a shorter video), decoded by transformers' ``load_video`` with its
    OpenCV back end; the metadata (``fps``, ``total_num_frames``, ``frames_indices``, ...) is
    what a processor needs to place the frames in time (Qwen3-VL writes each frame's
    timestamp)."""
    import numpy as np
    from transformers.video_utils import load_video as decode

    path = Path(video)
    if not path.is_file():
        raise FileNotFoundError(f"video file not found: {path}")
    if isinstance(frames, bool) or not isinstance(frames, int) or frames < 1:
        raise ValueError(f"frames={frames!r} must be an int >= 1")

    def even_steps(metadata, **_) -> list[int]:
        if metadata.total_num_frames < 1:
            raise ValueError(f"{path} is not a readable video (OpenCV decoded no frame)")
        if not metadata.fps or metadata.fps <= 0:
            raise ValueError(f"{path} states no frame rate; re-encode it with one")
        count = min(frames, metadata.total_num_frames)
        steps = np.linspace(0, metadata.total_num_frames - 1, count).round().astype(int)
        return steps.tolist()

    return Video(*decode(str(path), backend="opencv", sample_indices_fn=even_steps))


def build_video_inputs(
    processor: Any, video: Any, metadata: dict[str, Any], prompt: str
) -> dict[str, torch.Tensor]:
    """Processor inputs for one video (:func:`load_video`'s frames and metadata) and one user
    question, in the model's chat format; the frames are the ones given (no resampling)."""
    if not isinstance(prompt, str) or not prompt.strip():
        raise ValueError("the prompt is empty: type a question or a phrase")
    if getattr(processor, "video_processor", None) is None:
        raise ValueError(
            f"{type(processor).__name__} has no video processor: this model takes images only"
        )
    messages = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": prompt}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True)
    out = processor(
        videos=[video],
        text=[text],
        video_metadata=[metadata],
        do_sample_frames=False,
        return_tensors="pt",
    )
    return dict(out)


def build_inputs(
    processor: Any, images: Image.Image | list[Image.Image], prompts: str | list[str]
) -> dict[str, torch.Tensor]:
    """Processor inputs for one image and one user question per row, in the model's chat
    format, left-padded so that a batch can be generated from."""
    images = images if isinstance(images, list) else [images]
    prompts = prompts if isinstance(prompts, list) else [prompts]
    if len(images) != len(prompts):
        raise ValueError(f"{len(images)} images but {len(prompts)} prompts")
    for prompt in prompts:
        if not isinstance(prompt, str) or not prompt.strip():
            raise ValueError("the prompt is empty: type a question or a phrase")
    texts = [_chat_text(processor, p) for p in prompts]
    tokenizer = getattr(processor, "tokenizer", None)
    if tokenizer is not None:
        tokenizer.padding_side = "left"
    return dict(processor(images=images, text=texts, return_tensors="pt", padding=True))


def _chat_text(processor: Any, prompt: str) -> str:
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": prompt}]}]
    if getattr(processor, "chat_template", None):
        return processor.apply_chat_template(messages, add_generation_prompt=True)
    token = getattr(processor, "image_token", "<image>")
    return f"{token}\n{prompt}"


def to_model(model: torch.nn.Module, inputs: Any) -> dict[str, Any]:
    """``inputs`` on the model's device, floating-point tensors (pixels) in its dtype."""
    weight = next(model.parameters())
    return {
        key: value.to(weight.device, weight.dtype if value.is_floating_point() else value.dtype)
        if isinstance(value, torch.Tensor)
        else value
        for key, value in inputs.items()
    }


def decode_new_tokens(processor: Any, inputs: dict, sequences: torch.Tensor) -> list[str]:
    """The generated continuation of each row, as text."""
    new = sequences[:, inputs["input_ids"].shape[1] :]
    return [t.strip() for t in processor.batch_decode(new, skip_special_tokens=True)]


def model_inputs(
    model: torch.nn.Module, processor: Any, media: Any, prompts: list[str]
) -> dict[str, Any]:
    """``processor``'s inputs of one image per prompt (PIL images or paths), or of one
    :class:`Video` and one prompt, on ``model``'s device and in its dtype."""
    if is_video(media):
        if len(prompts) != 1:
            raise ValueError(f"a video takes one prompt, got {len(prompts)}")
        video = build_video_inputs(processor, media.frames, media.metadata, prompts[0])
        return to_model(model, video)
    return to_model(model, build_inputs(processor, [load_image(i) for i in media], list(prompts)))


def visual_counts(model: torch.nn.Module, inputs: dict[str, Any]) -> list[int]:
    """Visual tokens per row; ``ValueError`` when a row has none (no image in the inputs)."""
    visual = get_adapter(model).visual_mask(model, inputs["input_ids"])
    mask = inputs.get("attention_mask")
    if mask is not None:
        visual = visual & mask.bool()
    counts = visual.sum(1).tolist()
    if min(counts) == 0:
        raise ValueError(
            "the model's inputs hold no image tokens (check that the processor inserts the "
            "image placeholder: a vision-language model and its own processor are needed)"
        )
    return counts
