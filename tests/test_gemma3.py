"""Gemma 3 (``gemma3``): bidirectional image blocks, sliding-window layers with their own RoPE,
q/k norms and ``query_pre_attn_scalar`` scaling, against the masked reference.

The tiny model alternates sliding-window (window 8) and full layers, so every prompt here is
longer than the window and every decode step reads a sliding cache that dropped keys."""

from __future__ import annotations

import pytest
import torch
from reference import ATOL, assert_pruned_equals_masked

import vlm_focus as vf
from vlm_focus.core.attention import allowed_keys, image_blocks
from vlm_focus.model_adapters import get_adapter
from vlm_focus.model_adapters.tiny import BOS, IMAGE, IMAGE_END, IMAGE_START, PAD, tiny_model

TOKENS = 16  # the tiny model's pooled 4x4 grid


def gemma_model(attn: str = "sdpa", **text) -> torch.nn.Module:
    return tiny_model("gemma3", attn=attn, text=text or None)


def gemma_inputs(batch: int = 2, images: int = 2, seed: int = 0) -> dict:
    """A left-padded batch: row b has text, ``images`` image blocks with text between them,
    then ``4 + b`` instruction tokens; ``token_type_ids`` mark the image tokens."""
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for b in range(batch):
        row = [BOS] + torch.randint(3, 100, (3,), generator=gen).tolist()
        for _ in range(images):
            row += [IMAGE_START] + [IMAGE] * TOKENS + [IMAGE_END]
            row += torch.randint(3, 100, (2,), generator=gen).tolist()
        rows.append(row + torch.randint(3, 100, (4 + b,), generator=gen).tolist())
    width = max(map(len, rows))
    ids = torch.tensor([[PAD] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    return {
        "input_ids": ids,
        "attention_mask": mask,
        "token_type_ids": (ids == IMAGE).long(),
        "pixel_values": torch.randn(batch * images, 3, 32, 32, generator=gen),
    }


def test_layout_one_grid_per_block():
    model = gemma_model()
    inputs = gemma_inputs()
    layout = get_adapter(model).layout(model, inputs["input_ids"], inputs)
    for b, images in enumerate(layout):
        assert len(images) == 2
        visual = torch.nonzero(inputs["input_ids"][b] == IMAGE).flatten()
        assert torch.equal(torch.cat([i.positions for i in images]), visual)
        assert all(i.grids == [(4, 4)] for i in images)
        assert torch.equal(images[1].cells[5], torch.tensor([0, 1, 1]))


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("layer", [0, 2])
@pytest.mark.parametrize(
    "pruner,options",
    [
        ("fastv", {}),
        ("random", {}),
        ("debiased", {}),
        ("diverse", {}),
        ("pyramid", {}),
    ],
)
def test_pruned_equals_masked_reference(pruner, options, layer, attn):
    """Every pruner, one stage (pyramid: two, at K and K + 1), at K = 0 (layer 0 is a
    sliding one) and K = 2: prefill logits, 6 cached greedy steps and their logits."""
    model = gemma_model(attn)
    wrap = dict(pruner=pruner, keep=0.5, layer=layer, **options)
    if pruner == "pyramid":
        wrap.update(layer=(layer, layer + 1), keep=(0.5, 0.25))
    trace = assert_pruned_equals_masked(model, gemma_inputs(), steps=6, **wrap)
    assert len(trace.stages) == (2 if pruner == "pyramid" else 1)
