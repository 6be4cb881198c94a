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
    LlavaOnevisionConfig,
    LlavaOnevisionForConditionalGeneration,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2VLConfig,
    Qwen2VLForConditionalGeneration,
    Qwen3VLConfig,
    Qwen3VLForConditionalGeneration,
    Qwen3VLMoeConfig,
    Qwen3VLMoeForConditionalGeneration,
)

from vlm_focus.model_adapters.llava_next import _image_cells

VOCAB = 128
PAD, BOS = 0, 1
IMAGE, VIDEO, VISION_START, VISION_END = 120, 121, 122, 123
KINDS = ("llava", "llava_next", "qwen2_vl", "qwen2_5_vl")
NEW_KINDS = ("llava_onevision", "qwen3_vl")

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
# Qwen3-VL: per-head q/k norms, interleaved M-RoPE, DeepStack after decoder layers 0, 1, 2.
_QWEN3_TEXT = dict(
    _TEXT,
    hidden_size=96,
    head_dim=16,
    rope_parameters={
        "rope_type": "default",
        "rope_theta": 10000.0,
        "mrope_section": [2, 3, 3],
        "mrope_interleaved": True,
    },
)
_QWEN3_VISION = dict(
    depth=3,
    hidden_size=32,
    intermediate_size=64,
    num_heads=2,
    patch_size=14,
    spatial_merge_size=2,
    temporal_patch_size=2,
    in_channels=3,
    out_hidden_size=96,
    num_position_embeddings=64,
    deepstack_visual_indexes=[0, 1, 2],
)
QWEN3_PATCH_DIM = 3 * 2 * 14 * 14
# OneVision: 1x2 / 2x1 / 2x2 crops, and 4x4 crops whose grid is downscaled (anyres_max_9).
ONEVISION_PINPOINTS = [[32, 64], [64, 32], [64, 64], [128, 128]]
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
    elif kind == "llava_onevision":
        config = LlavaOnevisionConfig(
            vision_config=CLIPVisionConfig(**_CLIP),
            text_config=LlamaConfig(**_TEXT),
            image_token_id=IMAGE,
            video_token_id=VIDEO,
            vision_feature_layer=-1,
            vision_feature_select_strategy="default",
            image_grid_pinpoints=ONEVISION_PINPOINTS,
        )
        model = LlavaOnevisionForConditionalGeneration(config)
    elif kind in ("qwen3_vl", "qwen3_vl_moe"):
        moe = kind == "qwen3_vl_moe"
        text = dict(_QWEN3_TEXT)
        if moe:  # every layer sparse: 4 experts, 2 per token
            text.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
        config = (Qwen3VLMoeConfig if moe else Qwen3VLConfig)(
            vision_config=dict(_QWEN3_VISION),
            text_config=text,
            image_token_id=IMAGE,
            video_token_id=VIDEO,
            vision_start_token_id=VISION_START,
            vision_end_token_id=VISION_END,
        )
        cls = Qwen3VLMoeForConditionalGeneration if moe else Qwen3VLForConditionalGeneration
        model = cls(config)
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
    allows it, cycling through three), then ``prompt_len + b`` instruction tokens."""
    gen = torch.Generator().manual_seed(seed)
    rows, extra = [], {}
    if kind == "llava":
        n = (_CLIP["image_size"] // _CLIP["patch_size"]) ** 2
        for b in range(batch):
            rows.append([BOS] + _text(3, gen) + [IMAGE] * n + _text(prompt_len + b, gen))
        extra["pixel_values"] = torch.randn(batch, 3, 32, 32, generator=gen)
    elif kind == "llava_next":
        sizes = [[[40, 70], [64, 30], [50, 50]][b % 3] for b in range(batch)]
        for b, size in enumerate(sizes):
            cells, _ = _image_cells(model, size, anyres=True)
            rows.append(
                [BOS] + _text(2, gen) + [IMAGE] * cells.shape[0] + _text(prompt_len + b, gen)
            )
        extra["pixel_values"] = torch.randn(batch, 5, 3, 32, 32, generator=gen)
        extra["image_sizes"] = torch.tensor(sizes)
    else:
        grids = [[[1, 8, 6], [1, 4, 8], [1, 4, 4]][b % 3] for b in range(batch)]
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


# --- the newer layouts: OneVision anyres, videos, several images in one prompt -------------
CASES = (
    ("qwen3_vl", "image"),
    ("qwen3_vl", "video"),
    ("llava_onevision", "image"),
    ("llava_onevision", "video"),
    ("qwen2_5_vl", "video"),
    ("llava", "two_images"),
)


def _left_pad(rows: list[list[int]], types: list[list[int]] | None = None) -> dict:
    width = max(len(r) for r in rows)
    batch = len(rows)
    out = dict(
        input_ids=torch.full((batch, width), PAD),
        attention_mask=torch.zeros(batch, width, dtype=torch.long),
    )
    if types is not None:
        out["mm_token_type_ids"] = torch.zeros(batch, width, dtype=torch.long)
    for b, row in enumerate(rows):
        out["input_ids"][b, width - len(row) :] = torch.tensor(row)
        out["attention_mask"][b, width - len(row) :] = 1
        if types is not None:
            out["mm_token_type_ids"][b, width - len(row) :] = torch.tensor(types[b])
    return out


def _qwen_types(row: list[int]) -> list[int]:
    return [1 if t == IMAGE else 2 if t == VIDEO else 0 for t in row]


def make_case(kind: str, case: str, model, batch: int = 1, seed: int = 0, prompt_len: int = 6):
    """Left-padded inputs for one (kind, case) of :data:`CASES` (or ``"image"`` on a new kind);
    rows differ in their visual-token counts where the model allows it."""
    gen = torch.Generator().manual_seed(seed)
    if case == "image" and kind in KINDS:
        return make_inputs(kind, model, batch=batch, seed=seed, prompt_len=prompt_len)
    rows: list[list[int]] = []
    extra: dict = {}
    if kind in ("qwen3_vl", "qwen3_vl_moe", "qwen2_5_vl"):
        patch_dim = 3 * 2 * 4 * 4 if kind == "qwen2_5_vl" else QWEN3_PATCH_DIM
        grids = [[1, 8, 6], [1, 4, 8]] if case == "image" else [[3, 4, 4], [2, 4, 6]]
        grids = grids[:batch]
        token = IMAGE if case == "image" else VIDEO
        for b, (t, h, w) in enumerate(grids):
            per_frame = h * w // 4
            row = [BOS] + _text(2, gen)
            if case == "video" and kind != "qwen2_5_vl":  # Qwen3: a block per temporal group
                for _ in range(t):
                    row += _text(2, gen) + [VISION_START] + [token] * per_frame + [VISION_END]
            else:
                row += [VISION_START] + [token] * (t * per_frame) + [VISION_END]
            rows.append(row + _text(prompt_len + b, gen))
        pixels = torch.randn(sum(t * h * w for t, h, w in grids), patch_dim, generator=gen)
        key = "image" if case == "image" else "video"
        extra[f"pixel_values{'' if case == 'image' else '_videos'}"] = pixels
        extra[f"{key}_grid_thw"] = torch.tensor(grids)
        out = _left_pad(rows, [_qwen_types(r) for r in rows])
        return {**out, **extra}
    if kind == "llava_onevision":
        from vlm_focus.model_adapters.llava_onevision import _anyres_tokens, _video_tokens

        if case == "image":
            sizes = [[40, 70], [128, 120]][:batch]  # 1x2 crops; 4x4 crops, downscaled
            n_crops = []
            for b, size in enumerate(sizes):
                cells, _, _, crops = _anyres_tokens(model, size)
                n_crops.append(crops)
                rows.append(
                    [BOS] + _text(2, gen) + [IMAGE] * cells.shape[0] + _text(prompt_len + b, gen)
                )
            extra["pixel_values"] = torch.randn(batch, max(n_crops), 3, 32, 32, generator=gen)
            extra["image_sizes"] = torch.tensor(sizes)
            extra["batch_num_images"] = torch.ones(batch, dtype=torch.long)
        elif case == "video":
            frames = 3
            cells, _ = _video_tokens(model, frames)
            for b in range(batch):
                rows.append(
                    [BOS] + _text(2 + b, gen) + [VIDEO] * cells.shape[0] + _text(prompt_len, gen)
                )
            extra["pixel_values_videos"] = torch.randn(batch, frames, 3, 32, 32, generator=gen)
        return {**_left_pad(rows), **extra}
    if kind == "llava" and case == "two_images":
        n = (_CLIP["image_size"] // _CLIP["patch_size"]) ** 2
        for b in range(batch):
            rows.append(
                [BOS]
                + _text(2, gen)
                + [IMAGE] * n
                + _text(2 + b, gen)
                + [IMAGE] * n
                + _text(prompt_len, gen)
            )
        extra["pixel_values"] = torch.randn(2 * batch, 3, 32, 32, generator=gen)
        return {**_left_pad(rows), **extra}
    raise ValueError(f"no case {case!r} for {kind!r}")
