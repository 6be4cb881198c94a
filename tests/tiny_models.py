"""Tiny random-weight models of the four real classes, and matching inputs built by hand.

Hidden 64, 4 decoder layers, GQA (4 query heads over 2 kv heads): the same code paths as the 7B
checkpoints at a size that runs in milliseconds. Nothing is downloaded.
"""

from __future__ import annotations

import torch
from transformers import (
    CLIPVisionConfig,
    LlamaConfig,
    LlavaConfig,
    LlavaForConditionalGeneration,
    LlavaNextConfig,
    LlavaNextForConditionalGeneration,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2VLConfig,
    Qwen2VLForConditionalGeneration,
)

from vlm_focus.model_adapters.llava_next import _image_cells

VOCAB = 128
PAD, BOS = 0, 1
IMAGE, VIDEO, VISION_START, VISION_END = 120, 121, 122, 123
KINDS = ("llava", "llava_next", "qwen2_vl", "qwen2_5_vl")

_TEXT = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    pad_token_id=PAD,
    bos_token_id=BOS,
    eos_token_id=2,
)
_CLIP = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    image_size=32,
    patch_size=8,
    projection_dim=32,
)
_QWEN_VISION = dict(
    depth=2,
    embed_dim=32,
    hidden_size=32,
    num_heads=2,
    patch_size=4,
    spatial_merge_size=2,
    temporal_patch_size=2,
    in_channels=3,
    out_hidden_size=64,
    intermediate_size=64,
    fullatt_block_indexes=[1],
    window_size=16,
)
_QWEN_TEXT = dict(
    _TEXT,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
)


def make_model(kind: str, attn: str = "sdpa", seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    if kind == "llava":
        config = LlavaConfig(
            vision_config=CLIPVisionConfig(**_CLIP),
            text_config=LlamaConfig(**_TEXT),
            image_token_id=IMAGE,
            vision_feature_layer=-1,
        )
        model = LlavaForConditionalGeneration(config)
    elif kind == "llava_next":
        config = LlavaNextConfig(
            vision_config=CLIPVisionConfig(**_CLIP),
            text_config=LlamaConfig(**_TEXT),
            image_token_id=IMAGE,
            vision_feature_layer=-1,
            image_grid_pinpoints=[[32, 64], [64, 32], [64, 64]],
        )
        model = LlavaNextForConditionalGeneration(config)
    elif kind in ("qwen2_vl", "qwen2_5_vl"):
        cls_config, cls_model = (
            (Qwen2VLConfig, Qwen2VLForConditionalGeneration)
            if kind == "qwen2_vl"
            else (Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration)
        )
        vision = dict(_QWEN_VISION)
        if kind == "qwen2_vl":
            vision = {
                k: v
                for k, v in vision.items()
                if k
                not in (
                    "out_hidden_size",
                    "intermediate_size",
                    "fullatt_block_indexes",
                    "window_size",
                )
            }
            vision["mlp_ratio"] = 2
            vision["hidden_size"] = _TEXT["hidden_size"]  # Qwen2-VL's merger outputs hidden_size
        config = cls_config(
            vision_config=vision,
            text_config=dict(_QWEN_TEXT),
            image_token_id=IMAGE,
            video_token_id=VIDEO,
            vision_start_token_id=VISION_START,
            vision_end_token_id=VISION_END,
        )
        model = cls_model(config)
    else:
        raise ValueError(kind)
    model.config._attn_implementation = attn
    for sub in model.modules():
        if hasattr(sub, "config") and hasattr(sub.config, "_attn_implementation"):
            sub.config._attn_implementation = attn
    return model.eval()


def _text(n: int, gen: torch.Generator) -> list[int]:
    return torch.randint(3, 100, (n,), generator=gen).tolist()


def make_inputs(
    kind: str, model: torch.nn.Module, batch: int = 1, seed: int = 0, prompt_len: int = 6
) -> dict:
    """A left-padded batch: row b has text, one image (sizes differ per row where the model
    allows it), then ``prompt_len + b`` instruction tokens."""
    gen = torch.Generator().manual_seed(seed)
    rows, extra = [], {}
    if kind == "llava":
        n = (_CLIP["image_size"] // _CLIP["patch_size"]) ** 2
        for b in range(batch):
            rows.append([BOS] + _text(3, gen) + [IMAGE] * n + _text(prompt_len + b, gen))
        extra["pixel_values"] = torch.randn(batch, 3, 32, 32, generator=gen)
    elif kind == "llava_next":
        sizes = [[40, 70], [64, 30], [50, 50]][:batch]
        for b, size in enumerate(sizes):
            cells, _ = _image_cells(model, size, anyres=True)
            rows.append(
                [BOS] + _text(2, gen) + [IMAGE] * cells.shape[0] + _text(prompt_len + b, gen)
            )
        extra["pixel_values"] = torch.randn(batch, 5, 3, 32, 32, generator=gen)
        extra["image_sizes"] = torch.tensor(sizes)
    else:
        grids = [[1, 8, 6], [1, 4, 8], [1, 4, 4]][:batch]
        type_rows = []
        for b, (t, h, w) in enumerate(grids):
            n = t * h * w // 4
            row = [BOS] + _text(2, gen) + [VISION_START] + [IMAGE] * n + [VISION_END]
            row += _text(prompt_len + b, gen)
            rows.append(row)
            type_rows.append([1 if tok == IMAGE else 0 for tok in row])
        patch_dim = 3 * 2 * 4 * 4
        extra["pixel_values"] = torch.randn(
            sum(t * h * w for t, h, w in grids), patch_dim, generator=gen
        )
        extra["image_grid_thw"] = torch.tensor(grids)
        extra["_types"] = type_rows
    width = max(len(r) for r in rows)
    input_ids = torch.full((batch, width), PAD)
    attention_mask = torch.zeros(batch, width, dtype=torch.long)
    types = torch.zeros(batch, width, dtype=torch.long)
    for b, row in enumerate(rows):
        input_ids[b, width - len(row) :] = torch.tensor(row)
        attention_mask[b, width - len(row) :] = 1
        if "_types" in extra:
            types[b, width - len(row) :] = torch.tensor(extra["_types"][b])
    if "_types" in extra:
        extra.pop("_types")
        extra["mm_token_type_ids"] = types
    return dict(input_ids=input_ids, attention_mask=attention_mask, **extra)
