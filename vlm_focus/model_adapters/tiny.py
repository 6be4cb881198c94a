"""Tiny random-weight configs and models of the real VLM classes, for tests and benchmarks.

One entry per ``config.model_type`` with an adapter: the real transformers classes at a size that
runs in milliseconds on a CPU (text hidden 64, 4 decoder layers, GQA with 4 query heads over
2 kv heads; Qwen3-VL at hidden 96 with DeepStack). Nothing is downloaded. A benchmark that
needs a larger shape passes overrides::

    tiny_model("qwen2_5_vl", text=dict(hidden_size=512, num_hidden_layers=8))

``text`` and ``vision`` update the text and vision sub-configs (``rope_parameters`` key by key),
the other keywords the top-level config. The token ids of the tiny vocabulary (``IMAGE``,
``VIDEO``, ...) are module constants.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import transformers

VOCAB = 128
PAD, BOS, EOS = 0, 1, 2
IMAGE, VIDEO, VISION_START, VISION_END = 120, 121, 122, 123
# Gemma 3's <start_of_image> and <end_of_image> around each image's tokens
IMAGE_START, IMAGE_END = 126, 127
# Gemma 4's audio token and its markers (the tiny models take no audio; the config names them)
AUDIO, AUDIO_START, AUDIO_END = 117, 118, 119

_LLAMA = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    pad_token_id=PAD,
    bos_token_id=BOS,
    eos_token_id=EOS,
)
# Every tiny vision tower is 32 wide with a 64-wide MLP and 2 heads (the classes name the
# depth and the heads their own way).
_VISION = dict(hidden_size=32, intermediate_size=64)
_CLIP = dict(
    _VISION,
    num_hidden_layers=2,
    num_attention_heads=2,
    image_size=32,
    patch_size=8,
    projection_dim=32,
)
# Qwen2-VL / Qwen2.5-VL: M-RoPE over (temporal, height, width) sections of the rotary half.
_QWEN2_TEXT = dict(
    _LLAMA,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
)
_QWEN_VISION = dict(
    _VISION, num_heads=2, spatial_merge_size=2, temporal_patch_size=2, in_channels=3
)
_QWEN2_5_VISION = dict(
    _QWEN_VISION,
    depth=2,
    embed_dim=32,
    patch_size=4,
    out_hidden_size=64,
    fullatt_block_indexes=[1],
    window_size=16,
)
# Qwen2-VL's tower has no windows and its merger outputs `hidden_size` (the text width).
_QWEN2_VISION = {
    **{
        k: v
        for k, v in _QWEN2_5_VISION.items()
        if k not in ("out_hidden_size", "intermediate_size", "fullatt_block_indexes", "window_size")
    },
    "mlp_ratio": 2,
    "hidden_size": _LLAMA["hidden_size"],
}
# Qwen3-VL: per-head q/k norms, interleaved M-RoPE, DeepStack after decoder layers 0, 1, 2.
_QWEN3_TEXT = dict(
    _LLAMA,
    hidden_size=96,
    head_dim=16,
    rope_parameters={**_QWEN2_TEXT["rope_parameters"], "mrope_interleaved": True},
)
_QWEN3_VISION = dict(
    _QWEN_VISION,
    depth=3,
    patch_size=14,
    out_hidden_size=96,
    num_position_embeddings=64,
    deepstack_visual_indexes=[0, 1, 2],
)
# every layer sparse: 4 experts, 2 per token
_QWEN3_MOE_TEXT = dict(_QWEN3_TEXT, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
# OneVision: 1x2 / 2x1 / 2x2 crops, and 4x4 crops whose grid is downscaled (anyres_max_9).
_ONEVISION_PINPOINTS = [[32, 64], [64, 32], [64, 64], [128, 128]]
# Qwen3.5: a hybrid decoder, Gated DeltaNet (linear) layers around one full-attention layer
# (gated queries, q/k norms, RoPE over half the head dim, interleaved M-RoPE); the real 3:1
# pattern would put the full layer last, this one has a linear layer after it too.
_QWEN3_5_TEXT = dict(
    _LLAMA,
    hidden_size=96,
    head_dim=16,
    layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
    linear_conv_kernel_dim=4,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    rope_parameters={
        "rope_type": "default",
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.5,
        "mrope_section": [2, 1, 1],
        "mrope_interleaved": True,
    },
)
_QWEN3_5_MOE_TEXT = dict(
    _QWEN3_5_TEXT,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=32,
)
_QWEN3_5_VISION = {k: v for k, v in _QWEN3_VISION.items() if k != "deepstack_visual_indexes"}

# InternVL: 32-pixel tiles of 8x8 patches, pixel-shuffled (downsample_ratio 0.5) to 4x4 = 16
# tokens per tile; the decoder is Qwen2 (1-D RoPE).
_INTERNVL_VISION = dict(
    _VISION, num_hidden_layers=2, num_attention_heads=2, image_size=32, patch_size=4
)

# Gemma 3: per-head q/k norms, query_pre_attn_scalar scaling, sliding-window layers (window 8)
# mixed with full ones, each type with its own RoPE; a SigLIP tower of 8x8 patches pooled to
# a 4x4 grid (16 tokens per image).
_GEMMA3_TEXT = dict(
    _LLAMA,
    head_dim=16,
    query_pre_attn_scalar=24,
    sliding_window=8,
    layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
)
_GEMMA3_VISION = dict(
    _VISION,
    num_hidden_layers=2,
    num_attention_heads=2,
    image_size=32,
    patch_size=4,
    vision_use_head=False,
)
# Gemma 4 as the 26B-A4B lays it out (no KV sharing, no per-layer embeddings, K=V on the full
# layers, image blocks both ways on the sliding ones): sliding layers (window 8, head 16)
# mixed with full ones (head 32, one kv head, partial RoPE); a tower of 4-pixel patches pooled
# 2 x 2, so an image gives its own rows x cols grid.
_GEMMA4_TEXT = dict(
    _LLAMA,
    head_dim=16,
    global_head_dim=32,
    num_global_key_value_heads=1,
    attention_k_eq_v=True,
    sliding_window=8,
    layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
    use_bidirectional_attention="vision",
    hidden_size_per_layer_input=0,
    vocab_size_per_layer_input=VOCAB,
    num_kv_shared_layers=0,
    final_logit_softcapping=30.0,
)
_GEMMA4_VISION = dict(
    _VISION,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=2,
    head_dim=16,
    patch_size=4,
    pooling_kernel_size=2,
    position_embedding_size=64,
)

_QWEN_TOKENS = dict(
    image_token_id=IMAGE,
    video_token_id=VIDEO,
    vision_start_token_id=VISION_START,
    vision_end_token_id=VISION_END,
)


@dataclass(frozen=True)
class _Tiny:
    """A tiny model of one type: transformers class names and config fields. Sub-configs with a
    class name are built as that class; the others are passed as dicts."""

    config: str
    model: str
    text: dict[str, Any]
    vision: dict[str, Any]
    fields: dict[str, Any] = field(default_factory=dict)
    text_class: str | None = None
    vision_class: str | None = None


_LLAVA = dict(text_class="LlamaConfig", vision_class="CLIPVisionConfig")
_TINY: dict[str, _Tiny] = {
    "llava": _Tiny(
        "LlavaConfig",
        "LlavaForConditionalGeneration",
        _LLAMA,
        _CLIP,
        dict(image_token_id=IMAGE, vision_feature_layer=-1),
        **_LLAVA,
    ),
    "llava_next": _Tiny(
        "LlavaNextConfig",
        "LlavaNextForConditionalGeneration",
        _LLAMA,
        _CLIP,
        dict(
            image_token_id=IMAGE,
            vision_feature_layer=-1,
            image_grid_pinpoints=[[32, 64], [64, 32], [64, 64]],
        ),
        **_LLAVA,
    ),
    "llava_onevision": _Tiny(
        "LlavaOnevisionConfig",
        "LlavaOnevisionForConditionalGeneration",
        _LLAMA,
        _CLIP,
        dict(
            image_token_id=IMAGE,
            video_token_id=VIDEO,
            vision_feature_layer=-1,
            vision_feature_select_strategy="default",
            image_grid_pinpoints=_ONEVISION_PINPOINTS,
        ),
        **_LLAVA,
    ),
    "qwen2_vl": _Tiny(
        "Qwen2VLConfig", "Qwen2VLForConditionalGeneration", _QWEN2_TEXT, _QWEN2_VISION, _QWEN_TOKENS
    ),
    "qwen2_5_vl": _Tiny(
        "Qwen2_5_VLConfig",
        "Qwen2_5_VLForConditionalGeneration",
        _QWEN2_TEXT,
        _QWEN2_5_VISION,
        _QWEN_TOKENS,
    ),
    "qwen3_vl": _Tiny(
        "Qwen3VLConfig", "Qwen3VLForConditionalGeneration", _QWEN3_TEXT, _QWEN3_VISION, _QWEN_TOKENS
    ),
    "qwen3_vl_moe": _Tiny(
        "Qwen3VLMoeConfig",
        "Qwen3VLMoeForConditionalGeneration",
        _QWEN3_MOE_TEXT,
        _QWEN3_VISION,
        _QWEN_TOKENS,
    ),
    "internvl": _Tiny(
        "InternVLConfig",
        "InternVLForConditionalGeneration",
        _LLAMA,
        _INTERNVL_VISION,
        dict(image_token_id=IMAGE, image_seq_length=16, vision_feature_layer=-1),
        text_class="Qwen2Config",
        vision_class="InternVLVisionConfig",
    ),
    "qwen3_5": _Tiny(
        "Qwen3_5Config",
        "Qwen3_5ForConditionalGeneration",
        _QWEN3_5_TEXT,
        _QWEN3_5_VISION,
        _QWEN_TOKENS,
    ),
    "qwen3_5_moe": _Tiny(
        "Qwen3_5MoeConfig",
        "Qwen3_5MoeForConditionalGeneration",
        _QWEN3_5_MOE_TEXT,
        _QWEN3_5_VISION,
        _QWEN_TOKENS,
    ),
    "gemma3": _Tiny(
        "Gemma3Config",
        "Gemma3ForConditionalGeneration",
        _GEMMA3_TEXT,
        _GEMMA3_VISION,
        dict(
            mm_tokens_per_image=16,
            image_token_index=IMAGE,
            boi_token_index=IMAGE_START,
            eoi_token_index=IMAGE_END,
        ),
        text_class="Gemma3TextConfig",
        vision_class="SiglipVisionConfig",
    ),
    "gemma4": _Tiny(
        "Gemma4Config",
        "Gemma4ForConditionalGeneration",
        _GEMMA4_TEXT,
        _GEMMA4_VISION,
        dict(
            audio_config=None,
            image_token_id=IMAGE,
            video_token_id=VIDEO,
            boi_token_id=IMAGE_START,
            eoi_token_id=IMAGE_END,
            audio_token_id=AUDIO,
            boa_token_id=AUDIO_START,
            eoa_token_index=AUDIO_END,
        ),
        text_class="Gemma4TextConfig",
        vision_class="Gemma4VisionConfig",
    ),
}


def tiny_types() -> list[str]:
    """The model types :func:`tiny_config` and :func:`tiny_model` build."""
    return sorted(_TINY)


def _entry(model_type: str) -> _Tiny:
    if model_type not in _TINY:
        raise ValueError(
            f"model_type={model_type!r} has no tiny config; allowed: {', '.join(tiny_types())}"
        )
    return _TINY[model_type]


def _updated(values: dict[str, Any], changes: dict[str, Any] | None) -> dict[str, Any]:
    """``values`` with ``changes``; a dict field (``rope_parameters``) is updated key by key, so
    an override names only what it changes."""
    out = dict(values)
    for key, value in (changes or {}).items():
        both = isinstance(value, dict) and isinstance(out.get(key), dict)
        out[key] = {**out[key], **value} if both else value
    return out


def _sub_config(values: dict[str, Any], class_name: str | None) -> Any:
    return dict(values) if class_name is None else getattr(transformers, class_name)(**values)


def tiny_config(
    model_type: str,
    *,
    text: dict[str, Any] | None = None,
    vision: dict[str, Any] | None = None,
    **overrides: Any,
) -> transformers.PreTrainedConfig:
    """The tiny config of ``model_type``; ``text`` and ``vision`` update its sub-configs'
    fields (a dict field such as ``rope_parameters`` key by key), ``overrides`` its top-level
    fields (e.g. ``image_token_id``)."""
    entry = _entry(model_type)
    return getattr(transformers, entry.config)(
        vision_config=_sub_config(_updated(entry.vision, vision), entry.vision_class),
        text_config=_sub_config(_updated(entry.text, text), entry.text_class),
        **{**entry.fields, **overrides},
    )


def tiny_model(
    model_type: str,
    *,
    attn: str = "sdpa",
    seed: int = 0,
    text: dict[str, Any] | None = None,
    vision: dict[str, Any] | None = None,
    **overrides: Any,
) -> torch.nn.Module:
    """A random-weight model of ``model_type`` (weights drawn after ``torch.manual_seed(seed)``)
    on :func:`tiny_config`, in eval mode, with attention implementation ``attn`` on every
    sub-config."""
    torch.manual_seed(seed)
    config = tiny_config(model_type, text=text, vision=vision, **overrides)
    model = getattr(transformers, _entry(model_type).model)(config)
    model.config._attn_implementation = attn
    for sub in model.modules():
        if hasattr(sub, "config") and hasattr(sub.config, "_attn_implementation"):
            sub.config._attn_implementation = attn
    return model.eval()
