"""The real transformers processors of the supported classes, matched to the tiny models of
:mod:`vlm_focus.model_adapters.tiny`: the real image processor class (and video processor class
where the class takes video), a chat template in the family's shape, and a word-level tokenizer
whose special tokens carry the tiny model's ids. Every size is read from the model's config;
nothing is downloaded.

Pixel budgets are small so that an image gives tens of visual tokens, yet the processors still
resize: Qwen's ``smart_resize`` rounds and rescales, and the anyres processors pick different
crop grids for different aspect ratios.
"""

from __future__ import annotations

import numpy as np
import transformers
from PIL import Image
from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

from vlm_focus.model_adapters.tiny import (
    AUDIO,
    AUDIO_END,
    AUDIO_START,
    BOS,
    EOS,
    IMAGE,
    IMAGE_END,
    IMAGE_START,
    PAD,
    VIDEO,
    VISION_END,
    VISION_START,
    VOCAB,
)

IM_START, IM_END = 124, 125  # ChatML role markers (Qwen, LLaVA-OneVision)
WORDS = (
    "user assistant system USER ASSISTANT : . , ? < > seconds describe the image video what "
    "is in this and these two frames compare left right"
).split() + [str(d) for d in range(10)]

_LLAVA_SPECIAL = {"<image>": IMAGE, "<video>": VIDEO}
_QWEN_SPECIAL = {
    "<|image_pad|>": IMAGE,
    "<|video_pad|>": VIDEO,
    "<|vision_start|>": VISION_START,
    "<|vision_end|>": VISION_END,
}
_CHATML = {"<|im_start|>": IM_START, "<|im_end|>": IM_END}
_GEMMA3_SPECIAL = {
    "<image_soft_token>": IMAGE,
    "<start_of_image>": IMAGE_START,
    "<end_of_image>": IMAGE_END,
}

_GEMMA4_SPECIAL = {
    "<image_soft_token>": IMAGE,
    "<start_of_image>": IMAGE_START,
    "<end_of_image>": IMAGE_END,
    "<audio_soft_token>": AUDIO,
    "<start_of_audio>": AUDIO_START,
    "<end_of_audio>": AUDIO_END,
}


#: What a prompt writes for one image, and for one video: the processor expands the image and
#: video tokens in it.
LLAVA_PLACEHOLDERS = ("<image>", "<video>")
GEMMA3_PLACEHOLDERS = ("<start_of_image>", "<start_of_image>")  # Gemma 3 takes no video
QWEN_PLACEHOLDERS = (
    "<|vision_start|><|image_pad|><|vision_end|>",
    "<|vision_start|><|video_pad|><|vision_end|>",
)


# Jinja templates in each family's shape: where the processor's placeholders go.
def _content(image: str, video: str) -> str:
    """A message's content items: its images and videos as placeholders, its text as is."""
    return (
        "{% for item in message['content'] %}"
        f"{{% if item['type'] == 'image' %}}{image}"
        f"{{% elif item['type'] == 'video' %}}{video}"
        "{% else %}{{ item['text'] }}{% endif %}{% endfor %}"
    )


def _chatml(content: str) -> str:
    return (
        "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
        + content
        + "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )


_LINES = tuple(p + "\n" for p in LLAVA_PLACEHOLDERS)
LLAVA_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'user' %}USER: {% else %}ASSISTANT: {% endif %}"
    + _content(*_LINES)
    + " {% endfor %}{% if add_generation_prompt %}ASSISTANT:{% endif %}"
)
ONEVISION_TEMPLATE = _chatml(_content(*_LINES))
QWEN_TEMPLATE = _chatml(_content(*QWEN_PLACEHOLDERS))
GEMMA3_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ message['role'] }}\n"
    + _content(*GEMMA3_PLACEHOLDERS)
    + "\n{% endfor %}{% if add_generation_prompt %}assistant\n{% endif %}"
)


def word_tokenizer(
    special: dict[str, int], named: dict[str, str] | None = None
) -> transformers.PreTrainedTokenizerFast:
    """A word-level tokenizer over :data:`WORDS` whose ``special`` tokens (and pad, bos, eos)
    sit at the tiny vocabulary's ids; every id is below the tiny model's ``VOCAB``. ``named``
    gives some of them the attribute names a processor reads (Gemma 3's ``boi_token``), kept
    when the tokenizer is saved."""
    vocab = {"<pad>": PAD, "<s>": BOS, "</s>": EOS, **special}
    free = (i for i in range(VOCAB) if i not in vocab.values())
    for word in [*WORDS, "\n", "<unk>"]:
        vocab[word] = next(free)
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
        padding_side="left",
        **({"extra_special_tokens": named} if named else {}),
    )
    tokenizer.add_special_tokens({"additional_special_tokens": list(special)})
    # a line break is a token, as in the real vocabularies (the pre-tokenizer drops whitespace)
    tokenizer.add_tokens([AddedToken("\n", normalized=False)])
    return tokenizer


def _encoder_side(model) -> tuple[int, int]:
    """(pixels, tokens) per side of the CLIP tower's square input."""
    vision = model.config.vision_config
    return vision.image_size, vision.image_size // vision.patch_size


def _llava(model) -> transformers.ProcessorMixin:
    """llava-hf's LLaVA-1.5: CLIP's shortest-edge resize and centre crop to the tower's side."""
    pixels, _ = _encoder_side(model)
    image_processor = transformers.CLIPImageProcessor(
        size={"shortest_edge": pixels}, crop_size={"height": pixels, "width": pixels}
    )
    return transformers.LlavaProcessor(
        image_processor=image_processor,
        tokenizer=word_tokenizer(_LLAVA_SPECIAL),
        patch_size=model.config.vision_config.patch_size,
        vision_feature_select_strategy=model.config.vision_feature_select_strategy,
        num_additional_image_tokens=1,  # CLIP's CLS
        chat_template=LLAVA_TEMPLATE,
    )


def _llava_next(model) -> transformers.ProcessorMixin:
    """llava-hf's LLaVA-NeXT: anyres on the model's pinpoints, crops of the tower's side."""
    pixels, _ = _encoder_side(model)
    image_processor = transformers.LlavaNextImageProcessor(
        size={"shortest_edge": pixels},
        crop_size={"height": pixels, "width": pixels},
        image_grid_pinpoints=model.config.image_grid_pinpoints,
    )
    return transformers.LlavaNextProcessor(
        image_processor=image_processor,
        tokenizer=word_tokenizer(_LLAVA_SPECIAL),
        patch_size=model.config.vision_config.patch_size,
        vision_feature_select_strategy=model.config.vision_feature_select_strategy,
        num_additional_image_tokens=1,
        chat_template=LLAVA_TEMPLATE,
    )


def _onevision(model) -> transformers.ProcessorMixin:
    """llava-hf's LLaVA-OneVision: anyres-max-N images, frames squashed to the tower's side."""
    pixels, side = _encoder_side(model)
    square = {"height": pixels, "width": pixels}
    return transformers.LlavaOnevisionProcessor(
        image_processor=transformers.LlavaOnevisionImageProcessor(
            size=square, image_grid_pinpoints=model.config.image_grid_pinpoints
        ),
        video_processor=transformers.LlavaOnevisionVideoProcessor(size=square),
        tokenizer=word_tokenizer({**_LLAVA_SPECIAL, **_CHATML}),
        num_image_tokens=side * side + 1,  # the tower's tokens, CLS included
        vision_feature_select_strategy=model.config.vision_feature_select_strategy,
        vision_aspect_ratio=model.config.vision_aspect_ratio,
        chat_template=ONEVISION_TEMPLATE,
    )


#: Qwen pixel budgets in merged tokens: an image holds between ``MIN_TOKENS`` and ``MAX_TOKENS``;
#: a video's ``longest_edge`` is ``VIDEO_TOKENS`` per temporal patch of frames (Qwen2-VL's video
#: processor applies it to each frame, Qwen3-VL's to all frames together).
MIN_TOKENS, MAX_TOKENS, VIDEO_TOKENS = 6, 48, 96


def _qwen(model, processor: str, video_processor: str) -> transformers.ProcessorMixin:
    vision = model.config.vision_config
    geometry = dict(
        patch_size=vision.patch_size,
        merge_size=vision.spatial_merge_size,
        temporal_patch_size=vision.temporal_patch_size,
    )
    token = (vision.patch_size * vision.spatial_merge_size) ** 2  # pixels per merged token
    image_processor = transformers.Qwen2VLImageProcessor(
        size={"shortest_edge": MIN_TOKENS * token, "longest_edge": MAX_TOKENS * token}, **geometry
    )
    frames = vision.temporal_patch_size
    video = getattr(transformers, video_processor)(
        size={"shortest_edge": MIN_TOKENS * token, "longest_edge": VIDEO_TOKENS * token * frames},
        cap_pixels_per_frame=True,  # the reference implementation's budget (qwen-vl-utils)
        **geometry,
    )
    return getattr(transformers, processor)(
        image_processor=image_processor,
        video_processor=video,
        tokenizer=word_tokenizer({**_QWEN_SPECIAL, **_CHATML}),
        chat_template=QWEN_TEMPLATE,
    )


#: InternVL: the ``<img>`` and ``</img>`` markers around each image block (the image token is
#: ``<IMG_CONTEXT>``); a prompt writes ``<IMG_CONTEXT>`` per image and ``<video>`` per video.
IMG_START, IMG_END = 126, 127
INTERNVL_PLACEHOLDERS = ("<IMG_CONTEXT>", "<video>")
INTERNVL_TEMPLATE = _chatml(_content(*(p + "\n" for p in INTERNVL_PLACEHOLDERS)))
#: the most tiles an InternVL image is cut into (plus its thumbnail)
INTERNVL_MAX_TILES = 6


def _internvl(model) -> transformers.ProcessorMixin:
    """OpenGVLab's InternVL3 (``-hf``): tiles of the tower's side, up to
    :data:`INTERNVL_MAX_TILES` of them plus a thumbnail; video frames squashed to one tile."""
    pixels = model.config.vision_config.image_size[0]
    square = {"height": pixels, "width": pixels}
    words = word_tokenizer(
        {
            "<IMG_CONTEXT>": IMAGE,
            "<video>": VIDEO,
            "<img>": IMG_START,
            "</img>": IMG_END,
            **_CHATML,
        }
    )
    # the processor reads its markers from the tokenizer's named special tokens
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=words._tokenizer,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
        padding_side="left",
        extra_special_tokens={
            "start_image_token": "<img>",
            "end_image_token": "</img>",
            "context_image_token": "<IMG_CONTEXT>",
            "video_token": "<video>",
        },
    )
    return transformers.InternVLProcessor(
        image_processor=transformers.GotOcr2ImageProcessor(
            size=square, crop_to_patches=True, min_patches=1, max_patches=INTERNVL_MAX_TILES
        ),
        video_processor=transformers.InternVLVideoProcessor(size=square),
        tokenizer=tokenizer,
        image_seq_length=model.config.image_seq_length,
        chat_template=INTERNVL_TEMPLATE,
    )


def _gemma3(model) -> transformers.ProcessorMixin:
    """Gemma 3: a plain resize to the tower's square side, pan-and-scan crops when asked (at
    this tiny side, crops of at least 8 pixels), ``mm_tokens_per_image`` tokens per block."""
    pixels = model.config.vision_config.image_size
    # Gemma3Processor reads these names from the tokenizer, as the real Gemma tokenizer has them
    names = dict(zip(("image_token", "boi_token", "eoi_token"), _GEMMA3_SPECIAL, strict=True))
    tokenizer = word_tokenizer(_GEMMA3_SPECIAL, names)
    image_processor = transformers.Gemma3ImageProcessor(
        size={"height": pixels, "width": pixels}, pan_and_scan_min_crop_size=8
    )
    return transformers.Gemma3Processor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        image_seq_length=model.config.mm_tokens_per_image,
        chat_template=GEMMA3_TEMPLATE,
    )


_BUILDERS = {
    "llava": _llava,
    "llava_next": _llava_next,
    "llava_onevision": _onevision,
    "qwen2_vl": lambda m: _qwen(m, "Qwen2VLProcessor", "Qwen2VLVideoProcessor"),
    "qwen2_5_vl": lambda m: _qwen(m, "Qwen2_5_VLProcessor", "Qwen2VLVideoProcessor"),
    "qwen3_vl": lambda m: _qwen(m, "Qwen3VLProcessor", "Qwen3VLVideoProcessor"),
    "internvl": _internvl,
    "gemma3": _gemma3,
}
KINDS = tuple(_BUILDERS)
VIDEO_KINDS = ("llava_onevision", "qwen2_vl", "qwen2_5_vl", "qwen3_vl")
#: (image, video) placeholders a prompt writes, per class
PLACEHOLDERS = {
    "llava": LLAVA_PLACEHOLDERS,
    "llava_next": LLAVA_PLACEHOLDERS,
    "llava_onevision": LLAVA_PLACEHOLDERS,
    "qwen2_vl": QWEN_PLACEHOLDERS,
    "qwen2_5_vl": QWEN_PLACEHOLDERS,
    "qwen3_vl": QWEN_PLACEHOLDERS,
    "internvl": INTERNVL_PLACEHOLDERS,
    "gemma3": GEMMA3_PLACEHOLDERS,
}


def tiny_processor(model) -> transformers.ProcessorMixin:
    """The real processor of ``model``'s class, matched to its tiny config."""
    return _BUILDERS[model.config.model_type](model)


# --- pictures ----------------------------------------------------------------------------------
def ramp_image(width: int, height: int) -> Image.Image:
    """Red encodes x and green encodes y (each pixel centre's share of the side, in 0..255), so
    any region of a resized or cropped copy tells which original pixels it came from; blue is
    mid-grey."""
    x = (np.arange(width) + 0.5) / width
    y = (np.arange(height) + 0.5) / height
    pixels = np.empty((height, width, 3), np.uint8)
    pixels[..., 0] = np.round(255 * x)[None, :]
    pixels[..., 1] = np.round(255 * y)[:, None]
    pixels[..., 2] = 128
    return Image.fromarray(pixels)


def ramp_video(frames: int, width: int, height: int) -> np.ndarray:
    """``[frames, height, width, 3]`` uint8: :func:`ramp_image` in every frame."""
    return np.stack([np.asarray(ramp_image(width, height))] * frames)


def noise_image(width: int, height: int, seed: int) -> Image.Image:
    """A ``width x height`` RGB picture of uniform noise."""
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def noise_video(frames: int, width: int, height: int, seed: int) -> np.ndarray:
    """``[frames, height, width, 3]`` uint8."""
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, (frames, height, width, 3), dtype=np.uint8)


GEMMA4_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ message['role'] }}\n"
    + _content("<image_soft_token>", "<|video|>")
    + "\n{% endfor %}{% if add_generation_prompt %}assistant\n{% endif %}"
)


def gemma4_processor(model) -> transformers.ProcessorMixin:
    """Gemma 4's real processor, matched to its tiny config: an aspect-preserving resize to at
    most 70 pooled tokens (the smallest budget it allows), so each image gets its own grid.
    Kept out of :data:`KINDS` (its tests live in ``tests/test_gemma4.py``)."""
    vision = model.config.vision_config
    names = ("image_token", "boi_token", "eoi_token", "audio_token", "boa_token", "eoa_token")
    tokenizer = word_tokenizer(_GEMMA4_SPECIAL, dict(zip(names, _GEMMA4_SPECIAL, strict=True)))
    sizes = dict(patch_size=vision.patch_size, pooling_kernel_size=vision.pooling_kernel_size)
    return transformers.Gemma4Processor(
        feature_extractor=transformers.Gemma4AudioFeatureExtractor(),
        image_processor=transformers.Gemma4ImageProcessor(**sizes, max_soft_tokens=70),
        tokenizer=tokenizer,
        video_processor=transformers.Gemma4VideoProcessor(**sizes),
        chat_template=GEMMA4_TEMPLATE,
        image_seq_length=70,
    )


def hybrid_processor(model) -> transformers.ProcessorMixin:
    """Qwen3.5's real processor (``AutoProcessor`` maps ``qwen3_5`` to ``Qwen3VLProcessor``),
    matched to its tiny config. Kept out of :data:`KINDS`, whose tests compare with the masked
    reference, which a hybrid decoder has none of (``tests/reference_hybrid.py``)."""
    return _qwen(model, "Qwen3VLProcessor", "Qwen3VLVideoProcessor")
