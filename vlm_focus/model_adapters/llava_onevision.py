"""LLaVA-OneVision (``llava_onevision``).

* A single image per prompt (anyres-max-N): the base grid (no newline), then the anyres crops
  stitched into one grid, unpadded to the image's aspect ratio and, when that grid holds more
  than ``N`` crops' worth of cells (by more than 10%), bilinearly downscaled; one newline token
  closes each of its rows.
* Several images in one prompt: each image is its base grid plus one newline.
* A video: every frame's grid pooled to ``ceil(side / 2)`` per side, frames back to back, one
  newline after the last frame. Each frame is one view.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from ..geometry import Size
from .base import (
    ImageLayout,
    ModelAdapter,
    chunk_positions,
    grid_cells,
    has_video,
    rows_per_prompt,
)
from .llava_next import anyres_canvas


# Built per call, never at import: a module imported under ``torch.device("meta")`` (or a
# default CUDA device) would otherwise hold its constants there.
def _newline_cell() -> torch.Tensor:
    return torch.tensor([[0, -1, -1]], device="cpu")


def _no_patch() -> torch.Tensor:
    return torch.tensor([[-1, -1]], device="cpu")


def _side(model: nn.Module) -> int:
    vision = model.config.vision_config
    return vision.image_size // vision.patch_size


def _base(side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Cells and (crop, patch) of the base view."""
    patches = torch.stack([torch.zeros(side * side, dtype=torch.long), torch.arange(side**2)], 1)
    return grid_cells(side, side, view=0), patches


def _anyres_tokens(model: nn.Module, image_size: list[int]):
    """(cells, patches, grids, crops) of one anyres image, in the model's token order."""
    config = model.config
    side = _side(model)
    canvas, crops_h, crops_w = anyres_canvas(model, image_size)  # [2, h, w]
    h, w = canvas.shape[1:]
    aspect = getattr(config, "vision_aspect_ratio", "anyres_max_9")
    max_crops = int(aspect.removeprefix("anyres_max_"))
    ratio = math.sqrt(h * w / (max_crops * side**2))
    if ratio > 1.1:  # the model interpolates the grid down to this size
        out_h, out_w = int(h // ratio), int(w // ratio)
    else:
        out_h, out_w = h, w
    r, c = torch.meshgrid(torch.arange(out_h), torch.arange(out_w), indexing="ij")
    # Each (possibly downscaled) cell reads the unpadded cell under its centre.
    src_r = ((r.double() + 0.5) * h / out_h).long().clamp(max=h - 1)
    src_c = ((c.double() + 0.5) * w / out_w).long().clamp(max=w - 1)
    y, x = canvas[0][src_r, src_c], canvas[1][src_r, src_c]
    crop = 1 + (y // side) * crops_w + x // side
    patch = (y % side) * side + x % side
    hires_cells = torch.stack([torch.ones_like(r), r, c], dim=-1)  # [out_h, out_w, 3]
    newline = torch.tensor([1, -1, -1]).expand(out_h, 1, 3)
    hires_cells = torch.cat([hires_cells, newline], dim=1).reshape(-1, 3)
    hires_patches = torch.stack([crop, patch], dim=-1)
    hires_patches = torch.cat([hires_patches, _no_patch().expand(out_h, 1, 2)], dim=1)
    base_cells, base_patches = _base(side)
    cells = torch.cat([base_cells, hires_cells])
    patches = torch.cat([base_patches, hires_patches.reshape(-1, 2)])
    return cells, patches, [(side, side), (out_h, out_w)], 1 + crops_h * crops_w


def image_cells(model: nn.Module, image_size: list[int]):
    """``([n, 3] (view, row, col), grids)`` of the tokens of an image that is its prompt's only
    image (anyres: base grid, then the unpadded, maybe downscaled grid with row newlines).
    ``image_size`` is ``[height, width]``; ``model`` is anything with the model's Hugging Face
    config as ``.config`` (a vLLM model too)."""
    cells, _, grids, _ = _anyres_tokens(model, image_size)
    return cells, grids


def _single_view_tokens(model: nn.Module):
    """(cells, patches, grids, crops) of an image shown as its base grid plus one newline."""
    side = _side(model)
    cells, patches = _base(side)
    return torch.cat([cells, _newline_cell()]), torch.cat([patches, _no_patch()]), [(side, side)], 1


def _video_tokens(model: nn.Module, frames: int):
    """(cells, grids) of one video: ``frames`` pooled grids, then one newline."""
    pooled = math.ceil(_side(model) / 2)
    cells = torch.cat([grid_cells(pooled, pooled, view=f) for f in range(frames)])
    newline = torch.tensor([[frames - 1, -1, -1]])
    return torch.cat([cells, newline]), [(pooled, pooled)] * frames


def _image_items(model: nn.Module, inputs: Mapping[str, Any]) -> deque:
    sizes = inputs.get("image_sizes")
    if sizes is None:
        return deque()
    sizes = [list(map(int, s)) for s in torch.as_tensor(sizes).tolist()]
    per_prompt = inputs.get("batch_num_images")
    # The model tiles an image only when its prompt holds one image (or when the count is
    # unknown, as the model itself assumes).
    tiled = (
        [True] * len(sizes)
        if per_prompt is None
        else [int(n) == 1 for n in torch.as_tensor(per_prompt).tolist() for _ in range(int(n))]
    )
    if len(tiled) != len(sizes):
        raise ValueError(
            f"batch_num_images sums to {len(tiled)} images but image_sizes lists {len(sizes)}"
        )
    items = deque()
    for size, tile in zip(sizes, tiled):
        tokens = _anyres_tokens(model, size) if tile else _single_view_tokens(model)
        items.append((size, *tokens))
    return items


def onevision_layout(
    model: nn.Module, input_ids: torch.Tensor, inputs: Mapping[str, Any]
) -> list[list[ImageLayout]]:
    image_id, video_id = LLAVA_ONEVISION.token_ids(model)
    images = _image_items(model, inputs)
    videos = inputs.get("pixel_values_videos")
    frames = None if videos is None else int(videos.shape[1])  # [videos, frames, C, H, W]
    ids = input_ids.cpu()
    batch = ids.shape[0]
    described = sum(item[1].shape[0] for item in images)
    repeat = rows_per_prompt(
        int((ids == image_id).sum()), described, batch, "image tokens", "image_sizes"
    )
    layouts: list[list[ImageLayout]] = []
    for b in range(batch):
        if b % repeat:  # a beam copy of the previous row shares its images
            layouts.append(list(layouts[-1]))
            continue
        row: list[ImageLayout] = []
        positions = torch.nonzero(ids[b] == image_id).flatten()
        while positions.numel():  # consume images in order across the batch
            if not images:
                raise ValueError(f"row {b}: more image tokens than image_sizes describes")
            size, cells, patches, grids, crops = images.popleft()
            chunk, *_ = chunk_positions(positions[: cells.shape[0]], [cells.shape[0]], f"row {b}")
            row.append(
                ImageLayout(
                    chunk,
                    cells,
                    grids,
                    image_size=Size(size[1], size[0]),  # image_sizes are (height, width)
                    patches=patches,
                    n_crops=crops,
                )
            )
            positions = positions[cells.shape[0] :]
        # a video-token id in a prompt without video inputs is text, as the model reads it
        reads_video = video_id is not None and has_video(inputs)
        positions = torch.nonzero(ids[b] == video_id).flatten() if reads_video else None
        while positions is not None and positions.numel():
            if frames is None:
                raise ValueError("llava_onevision: video tokens without pixel_values_videos")
            cells, grids = _video_tokens(model, frames)
            chunk, *_ = chunk_positions(positions[: cells.shape[0]], [cells.shape[0]], f"row {b}")
            row.append(ImageLayout(chunk, cells, grids, kind="video"))
            positions = positions[cells.shape[0] :]
        layouts.append(sorted(row, key=lambda layout: int(layout.positions[0])))
    return layouts


LLAVA_ONEVISION = ModelAdapter(
    model_type="llava_onevision",
    multi_image_views=True,
    layout=onevision_layout,
    image_token_attrs=("image_token_id", "image_token_index"),
    video=True,
    video_token_attrs=("video_token_id", "video_token_index"),
    pixel_inputs=("pixel_values", "pixel_values_videos"),
    layout_inputs=("image_sizes", "batch_num_images", "pixel_values_videos"),
    encoders=("get_image_features", "get_video_features"),
    vision_layers="model.vision_tower.encoder.layers",
    # A tiled image: base view squashed, anyres grid over the whole image; an untiled one (a
    # prompt with several images) is padded to a square first.
    fallback_geometry={0: ("resize",), 1: ("pad",)},
    processor_rule="anyres",
)
