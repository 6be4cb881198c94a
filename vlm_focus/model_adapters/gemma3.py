"""Gemma 3 (``gemma3``): one square grid of ``mm_tokens_per_image`` tokens per image block.

The SigLIP tower's patches are average-pooled to a ``sqrt(mm_tokens_per_image)`` square grid
(16 x 16 on the released checkpoints) and the prompt holds each image as
``<start_of_image>`` + the grid's tokens + ``<end_of_image>``. With pan-and-scan the processor
adds each crop as one more such block after the image's own; the model's inputs do not say
which blocks are crops of which image (the processor keeps ``num_crops`` to itself), so each
block is laid out as an image of its own. Grounding, which knows how many images a row holds
(``images=``), joins a row's one image and its crops into one image of several views
(``processor_rule="pan_and_scan"``, :meth:`~vlm_focus.model_adapters.ModelAdapter.crop_groups`):
view 0 the whole image, then the crops, placed by
:func:`vlm_focus.geometry.pan_and_scan_crops` from their count.

What differs from LLaMA-style decoders, and where the core reads it:

* the prefill mask is not causal: an image block's tokens see each other both ways when the
  call carries ``token_type_ids`` (so pruning needs them), ``mask_rule="image_blocks"``;
* sliding-window layers (``layer_types``) alternate with full ones, each type with its own
  RoPE tables; the window sits on the attention module (``attention_window``);
* per-head q/k RMSNorms before RoPE (``qk_norms``); the softmax scale is
  ``query_pre_attn_scalar ** -0.5``, the attention module's own ``scaling``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from .base import ImageLayout, ModelAdapter, grid_cells, runs


def _grid_side(model: nn.Module) -> int:
    """Tokens per side of one image block's pooled grid."""
    tokens = model.config.mm_tokens_per_image
    side = math.isqrt(tokens)
    if side * side != tokens:
        raise ValueError(f"gemma3: mm_tokens_per_image={tokens} is not a square grid")
    return side


def gemma3_layout(
    model: nn.Module, input_ids: torch.Tensor, inputs: Mapping[str, Any]
) -> list[list[ImageLayout]]:
    if getattr(model.config.get_text_config(), "attn_logit_softcapping", None) is not None:
        # the core's attention math is softmax(q k^T * scaling) without a tanh cap
        raise ValueError(
            "gemma3 with attn_logit_softcapping set: vlm_focus recomputes attention without "
            "the soft-cap, so its scores would differ from the model's; the released Gemma 3 "
            "checkpoints leave it None"
        )
    side = _grid_side(model)
    per_block = side * side
    cells = grid_cells(side, side)
    visual = GEMMA3.visual_mask(model, input_ids).cpu()  # one copy to the host for all rows
    layouts = []
    for b in range(input_ids.shape[0]):
        blocks = runs(torch.nonzero(visual[b]).flatten())
        sizes = [block.numel() for block in blocks]
        if any(n != per_block for n in sizes):
            raise ValueError(
                f"gemma3 row {b}: image blocks of {sizes} tokens, but each image holds "
                f"mm_tokens_per_image={per_block}; input_ids and the config disagree"
            )
        layouts.append([ImageLayout(block, cells.clone(), [(side, side)]) for block in blocks])
    return layouts


GEMMA3 = ModelAdapter(
    model_type="gemma3",
    layout=gemma3_layout,
    image_token_attrs=("image_token_id", "image_token_index"),
    # without them the model's own prefill mask is causal over the image blocks
    required_with_images=("token_type_ids",),
    vision_layers=None,  # SigLIP has no CLS token
    fallback_geometry={0: ("resize",)},  # Gemma3ImageProcessor resizes to the square side
    processor_rule="pan_and_scan",  # the image whole, then its crops as blocks of their own
    mask_rule="image_blocks",
    attention_window="sliding_window",
    qk_norms=("q_norm", "k_norm"),
    visual_marker_attrs=("boi_token_id", "eoi_token_id"),
    multi_image_views=True,
    # 1-D RoPE, but its windows and image blocks are masked by original positions, so the
    # kept tokens are never renumbered (positions="compact" is refused)
    consecutive_positions=False,
)
