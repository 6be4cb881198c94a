"""InternVL (``internvl``; InternVL3 and InternVL3.5 checkpoints): a Qwen2/Qwen3 decoder with
1-D RoPE.

The processor cuts each image into up to ``max_patches`` square tiles on the canvas whose shape
is closest to the image's aspect ratio, plus a thumbnail of the whole image when there is more
than one tile, and writes ``<img>`` + ``image_seq_length`` image tokens per tile + ``</img>``.
The vision tower's patch grid of each tile is pixel-shuffled (``downsample_ratio``) into a
``side x side`` grid, ``side = image_size / patch_size * downsample_ratio``, in row-major order.
So each run of image tokens is one image, and its length counts the image's tiles: views
``0 .. n-2`` are the tiles (row-major on the canvas), view ``n-1`` the thumbnail; an image of
one tile is one view. Where the tiles sit on the image is :func:`vlm_focus.geometry.tile_grid`'s
arithmetic (``processor_rule="tiled"``).

A video reaches the model as single-tile image blocks, one per frame (``Frame1: <img>...</img>``;
the processor merges the frames into ``pixel_values``), and nothing in the model inputs tells
a frame from an image of one tile: each frame is laid out as an image of one view.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from .base import ImageLayout, ModelAdapter, grid_cells, runs


def tile_side(model: nn.Module) -> int:
    """Tokens per side of one tile's grid: the tower's patches per side after the pixel
    shuffle. ``model`` is anything with the model's Hugging Face config as ``.config``."""
    config = model.config
    image_size = config.vision_config.image_size
    patch_size = config.vision_config.patch_size
    # InternVL's vision config keeps both as (height, width); the tiles are square
    pixels = image_size[0] if isinstance(image_size, list | tuple) else image_size
    patch = patch_size[0] if isinstance(patch_size, list | tuple) else patch_size
    return int(pixels // patch * config.downsample_ratio)


def image_cells(side: int, views: int) -> tuple[torch.Tensor, list[tuple[int, int]]]:
    """``([n, 3] (view, row, col), grids)`` of an image of ``views`` tile views, each a
    row-major ``side x side`` grid, in the model's token order."""
    cells = torch.cat([grid_cells(side, side, view=v) for v in range(views)])
    return cells, [(side, side)] * views


def internvl_layout(
    model: nn.Module, input_ids: torch.Tensor, inputs: Mapping[str, Any]
) -> list[list[ImageLayout]]:
    """Each run of image tokens in a row is one image of ``len(run) / side^2`` tile views (the
    processor closes every image with ``</img>``, so two images never share a run)."""
    if getattr(model.config, "vision_feature_select_strategy", "default") != "default":
        raise ValueError(
            "internvl: vision_feature_select_strategy='full' keeps the tower's CLS token, which "
            "the model's pixel shuffle cannot place; only 'default' is supported"
        )
    side = tile_side(model)
    per_tile = side * side
    visual = INTERNVL.visual_mask(model, input_ids).cpu()  # one copy to the host
    layouts: list[list[ImageLayout]] = []
    for b in range(input_ids.shape[0]):
        row = []
        for run in runs(torch.nonzero(visual[b]).flatten()):
            if run.numel() % per_tile:
                raise ValueError(
                    f"row {b}: a block of {run.numel()} image tokens at position {int(run[0])} "
                    f"is not a whole number of tiles of {per_tile} tokens ({side}x{side}); "
                    "input_ids and the model's config (image size, patch size, "
                    "downsample_ratio) disagree"
                )
            views = run.numel() // per_tile
            cells, grids = image_cells(side, views)
            row.append(ImageLayout(run, cells, grids, n_crops=views))
        layouts.append(row)
    return layouts


INTERNVL = ModelAdapter(
    model_type="internvl",
    layout=internvl_layout,
    multi_image_views=True,
    # The fallback for a tiled image is the tile arithmetic itself on the count the tokens show
    # (vlm_focus.geometry.view_frames); an image of one tile is squashed whole.
    fallback_geometry={0: ("resize",)},
    processor_rule="tiled",
)
