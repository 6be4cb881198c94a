"""LLaVA-1.5 (``llava``): one square grid of ``(image_size / patch_size)^2`` tokens per image."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from .base import ImageLayout, ModelAdapter, chunk_positions, grid_cells


def _tokens_per_image(model: nn.Module) -> tuple[int, bool]:
    """(tokens per image, whether the first one is CLS) from the vision config and strategy."""
    vision = model.config.vision_config
    side = vision.image_size // vision.patch_size
    with_cls = getattr(model.config, "vision_feature_select_strategy", "default") == "full"
    return side * side + int(with_cls), with_cls


def llava_layout(
    model: nn.Module, input_ids: torch.Tensor, inputs: Mapping[str, Any]
) -> list[list[ImageLayout]]:
    vision = model.config.vision_config
    side = vision.image_size // vision.patch_size
    per_image, with_cls = _tokens_per_image(model)
    cells = grid_cells(side, side)
    # (crop, patch index in the encoder's token order, CLS = 0 when kept)
    patches = torch.stack([torch.zeros(side * side, dtype=torch.long), torch.arange(side**2)], 1)
    if with_cls:
        cells = torch.cat([torch.tensor([[0, -1, -1]]), cells])
        patches = torch.cat([torch.tensor([[0, -1]]), patches])
    visual = LLAVA.visual_mask(model, input_ids).cpu()  # one copy to the host for all rows
    layouts = []
    for b in range(input_ids.shape[0]):
        positions = torch.nonzero(visual[b]).flatten()
        n_images = positions.numel() // per_image
        chunks = chunk_positions(positions, [per_image] * n_images, f"row {b}")
        layouts.append(
            [ImageLayout(p, cells.clone(), [(side, side)], patches=patches) for p in chunks]
        )
    return layouts


LLAVA = ModelAdapter(
    model_type="llava",
    layout=llava_layout,
    vision_layers="model.vision_tower.encoder.layers",
    # Without a processor: CLIP-style shortest-side resize and centre crop, what
    # CLIPImageProcessor and LlavaImageProcessor do by default (llava-hf's checkpoints and the
    # embedded organism). LLaVA-1.5's original expand2square, LlavaImageProcessor(do_pad=True),
    # pads instead; pass processor= and its settings decide.
    fallback_geometry={0: ("crop",)},
)
