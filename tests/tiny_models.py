"""Tiny random-weight models of the real classes (:mod:`vlm_focus.model_adapters.tiny`), and
matching inputs built by hand.

Hidden 64, 4 decoder layers, GQA (4 query heads over 2 kv heads): the same code paths as the 7B
checkpoints at a size that runs in milliseconds. Nothing is downloaded.
"""

from __future__ import annotations

import torch

from vlm_focus.model_adapters.llava_next import image_cells
from vlm_focus.model_adapters.tiny import (
    BOS,
    IMAGE,
    PAD,
    VIDEO,
    VISION_END,
    VISION_START,
    tiny_model,
)

KINDS = ("llava", "llava_next", "qwen2_vl", "qwen2_5_vl")
NEW_KINDS = ("llava_onevision", "qwen3_vl")


def make_model(kind: str, attn: str = "sdpa", seed: int = 0) -> torch.nn.Module:
    return tiny_model(kind, attn=attn, seed=seed)


def _patches(model) -> int:
    """Visual tokens of one LLaVA image: (image_size / patch_size)^2."""
    vision = model.config.vision_config
    return (vision.image_size // vision.patch_size) ** 2


def _patch_dim(model) -> int:
    """Flattened length of one Qwen patch: channels x temporal x patch x patch."""
    vision = model.config.vision_config
    return vision.in_channels * vision.temporal_patch_size * vision.patch_size**2


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
        n = _patches(model)
        for b in range(batch):
            rows.append([BOS] + _text(3, gen) + [IMAGE] * n + _text(prompt_len + b, gen))
        extra["pixel_values"] = torch.randn(batch, 3, 32, 32, generator=gen)
    elif kind == "llava_next":
        sizes = [[[40, 70], [64, 30], [50, 50]][b % 3] for b in range(batch)]
        for b, size in enumerate(sizes):
            cells, _ = image_cells(model, size, anyres=True)
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
        extra["pixel_values"] = torch.randn(
            sum(t * h * w for t, h, w in grids), _patch_dim(model), generator=gen
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
        pixels = torch.randn(sum(t * h * w for t, h, w in grids), _patch_dim(model), generator=gen)
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
    if kind == "internvl" and case == "image":
        from vlm_focus.model_adapters.internvl import tile_side

        per_tile = tile_side(model) ** 2
        views = [4, 3][:batch]  # 3 tiles + thumbnail; 2 tiles + thumbnail
        for b, n in enumerate(views):  # <img> and </img> are text to the layout
            block = [3] + [IMAGE] * (n * per_tile) + [4]
            rows.append([BOS] + _text(2, gen) + block + _text(prompt_len + b, gen))
        extra["pixel_values"] = torch.randn(sum(views), 3, 32, 32, generator=gen)
        return {**_left_pad(rows), **extra}
    if kind == "llava" and case == "two_images":
        n = _patches(model)
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
