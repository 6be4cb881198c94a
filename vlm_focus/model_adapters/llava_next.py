"""LLaVA-NeXT (``llava_next``): a base grid, then the anyres crops stitched into one grid,
unpadded to the image's aspect ratio, with one newline token closing each of its rows."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from ..geometry import Size
from .base import ImageLayout, ModelAdapter, chunk_positions, grid_cells, rows_per_prompt


def anyres_canvas(model: nn.Module, image_size: list[int]) -> tuple[torch.Tensor, int, int]:
    """``(canvas, crops_h, crops_w)``: the anyres crops' stitched grid unpadded to the image's
    aspect ratio, as ``[2, h, w]`` (row, col) coordinates on the padded grid. The coordinates
    go through the model's own ``unpad_image``, so cells match its features exactly."""
    from transformers.models.llava_next.modeling_llava_next import (  # heavy: import on use
        get_anyres_image_grid_shape,
        unpad_image,
    )

    config = model.config
    side = config.vision_config.image_size // config.vision_config.patch_size
    crops_h, crops_w = get_anyres_image_grid_shape(
        image_size, config.image_grid_pinpoints, config.vision_config.image_size
    )
    rows, cols = torch.meshgrid(
        torch.arange(crops_h * side), torch.arange(crops_w * side), indexing="ij"
    )
    return unpad_image(torch.stack([rows, cols]), image_size), crops_h, crops_w


def image_cells(model: nn.Module, image_size: list[int], anyres: bool):
    """``([n, 3] (view, row, col), grids)`` of one image's tokens, in the model's order: the
    base grid (view 0), then the unpadded hi-res grid (view 1) with a newline (row = col = -1)
    closing each of its rows. ``image_size`` is ``[height, width]``; ``model`` is anything with
    the model's Hugging Face config as ``.config`` (a vLLM model too)."""
    config = model.config
    side = config.vision_config.image_size // config.vision_config.patch_size
    base = grid_cells(side, side, view=0)
    if not anyres:  # a single crop: the base grid and one trailing newline
        return torch.cat([base, torch.tensor([[0, -1, -1]])]), [(side, side)]
    kept, _, _ = anyres_canvas(model, image_size)  # [2, h, w]
    h, w = kept.shape[1:]
    kept = kept - kept.amin(dim=(1, 2), keepdim=True)  # address the [h, w] unpadded grid from 0
    hires = torch.stack([torch.ones_like(kept[0]), kept[0], kept[1]], dim=-1)  # [h, w, 3]
    newline = torch.tensor([1, -1, -1]).expand(h, 1, 3)
    hires = torch.cat([hires, newline], dim=1).reshape(-1, 3)
    return torch.cat([base, hires]), [(side, side), (h, w)]


def _image_patches(model: nn.Module, image_size: list[int], anyres: bool):
    """``([n, 2] (crop, patch) per token, crops)`` in the order of :func:`image_cells`: crop 0
    is the base image, crops 1.. the anyres crops in row-major order; newlines get -1."""
    config = model.config
    side = config.vision_config.image_size // config.vision_config.patch_size
    base = torch.stack([torch.zeros(side * side, dtype=torch.long), torch.arange(side**2)], 1)
    newline = torch.tensor([[-1, -1]])
    if not anyres:
        return torch.cat([base, newline]), 1
    kept, crops_h, crops_w = anyres_canvas(model, image_size)  # [2, h, w] canvas coordinates
    crop = 1 + (kept[0] // side) * crops_w + kept[1] // side
    patch = (kept[0] % side) * side + kept[1] % side
    hires = torch.stack([crop, patch], dim=-1)  # [h, w, 2]
    hires = torch.cat([hires, newline.expand(hires.shape[0], 1, 2)], dim=1).reshape(-1, 2)
    return torch.cat([base, hires]), 1 + crops_h * crops_w


def llava_next_layout(
    model: nn.Module, input_ids: torch.Tensor, inputs: Mapping[str, Any]
) -> list[list[ImageLayout]]:
    image_sizes = inputs.get("image_sizes")
    if image_sizes is None:
        raise ValueError("llava_next needs `image_sizes` (from the processor) with pixel_values")
    sizes = [list(map(int, s)) for s in torch.as_tensor(image_sizes).tolist()]
    visual = LLAVA_NEXT.visual_mask(model, input_ids).cpu()  # one copy to the host
    tokens = visual.sum(-1).tolist()  # image tokens per row
    needed = sum(tokens)
    tiled, single = (
        sum(image_cells(model, s, anyres)[0].shape[0] for s in sizes) for anyres in (True, False)
    )
    # beam copies need k times the tokens the images give (single crops when tiled ones do not fit)
    described = tiled if needed % max(tiled, 1) == 0 else single
    repeat = rows_per_prompt(needed, described, len(tokens), "image tokens", "image_sizes")
    layouts: list[list[ImageLayout]] = []
    first = 0
    for b in range(input_ids.shape[0]):
        positions = torch.nonzero(visual[b]).flatten()
        n_images, anyres = _row_images(model, positions.numel(), sizes[first:])
        row_sizes = sizes[first : first + n_images]
        if (b + 1) % repeat == 0:  # beam copies of a prompt share its images
            first += n_images
        cells = [image_cells(model, s, anyres=anyres) for s in row_sizes]
        patches = [_image_patches(model, s, anyres) for s in row_sizes]
        chunks = chunk_positions(positions, [c.shape[0] for c, _ in cells], f"row {b}")
        layouts.append(
            [
                ImageLayout(p, c, grids, image_size=Size(s[1], s[0]), patches=pt, n_crops=n)
                for p, (c, grids), s, (pt, n) in zip(chunks, cells, row_sizes, patches, strict=True)
            ]
        )
    return layouts


def _row_images(model: nn.Module, tokens: int, sizes: list[list[int]]) -> tuple[int, bool]:
    """``(n, anyres)``: the next ``n`` images of ``sizes`` fill a row's ``tokens`` image tokens,
    tiled (anyres), else as single crops. Counted by tokens, not by runs of image tokens: a
    prompt may put images back to back (``"<image><image>"``), and the model reads it so."""
    taken = []
    for anyres in (True, False):
        n = total = 0
        while total < tokens and n < len(sizes):
            total += image_cells(model, sizes[n], anyres)[0].shape[0]
            n += 1
        if total == tokens:
            return n, anyres
        taken.append(n)
    return taken[0], True  # chunk_positions then reports the mismatch


LLAVA_NEXT = ModelAdapter(
    model_type="llava_next",
    layout=llava_next_layout,
    layout_inputs=("image_sizes",),
    vision_layers="model.vision_tower.encoder.layers",
    # Base view: the whole image squashed to the encoder's square; the unpadded anyres grid
    # spans the whole image (up to a fraction of a token).
    fallback_geometry={0: ("resize",)},
    processor_rule="anyres",
)
