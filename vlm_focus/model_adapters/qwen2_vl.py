"""Qwen2-VL and Qwen2.5-VL: ``t*h*w / merge^2`` tokens per image or video between
``<vision_start>`` and ``<vision_end>``, laid out on the merged ``image_grid_thw`` grid; M-RoPE."""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from .base import (
    ImageLayout,
    ModelAdapter,
    chunk_positions,
    grid_cells,
    has_video,
    rows_per_prompt,
)


def _grid_layouts(grid_thw: torch.Tensor, merge: int) -> list[tuple[int, list, torch.Tensor]]:
    """(token count, grids, cells) per image/video; each temporal slice is one view."""
    out = []
    for t, h, w in torch.as_tensor(grid_thw).tolist():
        rows, cols = h // merge, w // merge
        cells = torch.cat([grid_cells(rows, cols, view=i) for i in range(t)])
        out.append((t * rows * cols, [(rows, cols)] * t, cells))
    return out


def qwen_layout(
    model: nn.Module, input_ids: torch.Tensor, inputs: Mapping[str, Any]
) -> list[list[ImageLayout]]:
    """Each row's image (video) tokens are consumed in order, grid by grid, from
    ``image_grid_thw`` (``video_grid_thw``) across the batch. A video's tokens need not be
    contiguous: Qwen3-VL puts a timestamp and ``<vision_start>``/``<vision_end>`` around each
    temporal group, so one video layout spans several runs, one view per frame."""
    image_id, video_id = QWEN2_VL.token_ids(model)
    merge = model.config.vision_config.spatial_merge_size
    grids = {
        "image": deque(_grid_layouts(inputs.get("image_grid_thw", torch.zeros(0, 3)), merge)),
        "video": deque(_grid_layouts(inputs.get("video_grid_thw", torch.zeros(0, 3)), merge)),
    }
    ids = input_ids.cpu()
    if not has_video(inputs):  # a video-token id without video inputs is text
        video_id = None
    batch = ids.shape[0]
    repeat = {
        kind: rows_per_prompt(
            int((ids == token).sum()) if token is not None else 0,
            sum(n for n, _, _ in grids[kind]),
            batch,
            f"{kind} tokens",
            f"{kind}_grid_thw",
        )
        for kind, token in (("image", image_id), ("video", video_id))
    }
    layouts: list[list[ImageLayout]] = []
    for b in range(batch):
        if any(b % k for k in repeat.values()):  # a repeat of the row before (beams)
            layouts.append([_repeated(layout, ids[b], ids[b - 1]) for layout in layouts[-1]])
            continue
        row_layouts = []
        for kind, token in (("image", image_id), ("video", video_id)):
            if token is None:
                continue
            positions = torch.nonzero(ids[b] == token).flatten()
            while positions.numel():
                if not grids[kind]:
                    raise ValueError(
                        f"row {b}: more {kind} tokens than {kind}_grid_thw describes; "
                        f"pass the processor's {kind}_grid_thw"
                    )
                n, view_grids, cells = grids[kind].popleft()
                chunk, *_ = chunk_positions(positions[:n], [n], f"row {b} {kind}")
                row_layouts.append(ImageLayout(chunk, cells, view_grids, kind=kind))
                positions = positions[n:]
        layouts.append(sorted(row_layouts, key=lambda layout: int(layout.positions[0])))
    return layouts


def _repeated(layout: ImageLayout, row: torch.Tensor, previous: torch.Tensor) -> ImageLayout:
    """The layout of a row that repeats the previous one (``generate()``'s beam copies)."""
    if not torch.equal(row, previous):
        raise ValueError("rows that share a prompt's images must hold the same tokens")
    return layout


def mrope_decode_positions(
    model: nn.Module, positions: torch.Tensor, attention_mask: torch.Tensor | None
) -> torch.Tensor:
    """As Qwen positions a decode call itself: text positions (counted over the attention mask
    when there is one) shifted by the ``rope_deltas`` stored at prefill, ``[3, B, T]``."""
    if attention_mask is not None:
        counted = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
        positions = counted[:, -positions.shape[1] :]
    deltas = getattr(model.model, "rope_deltas", None)
    if deltas is not None:
        positions = positions + deltas.to(positions.device)
    return positions[None].expand(3, -1, -1)


QWEN2_VL = ModelAdapter(
    model_type="qwen2_vl",
    multi_image_views=True,
    layout=qwen_layout,
    decode_positions=mrope_decode_positions,
    consecutive_positions=False,  # M-RoPE: a visual token's position is its grid cell's
    video=True,
    video_token_attrs=("video_token_id",),
    pixel_inputs=("pixel_values", "pixel_values_videos"),
    # Without it Qwen2-VL raises and Qwen2.5-VL silently falls back to 1-D positions.
    required_with_images=("mm_token_type_ids",),
    layout_inputs=("image_grid_thw", "video_grid_thw"),
    encoders=("get_image_features", "get_video_features"),
    visual_marker_attrs=("vision_start_token_id", "vision_end_token_id"),
    patch_grids={"pixel_values": "image_grid_thw", "pixel_values_videos": "video_grid_thw"},
    # Dynamic resolution: the whole image squashed to a grid that keeps its aspect ratio.
    fallback_geometry={0: ("resize",)},
    processor_rule="dynamic",
    aspect_grids=True,
)
# Qwen2.5-VL lays out and positions visual tokens exactly as Qwen2-VL does.
QWEN2_5_VL = dataclasses.replace(QWEN2_VL, model_type="qwen2_5_vl")
