"""The FLOPs bound of a hybrid decoder (``benchmarks/hybrid_bound.py``): its arithmetic by hand
on a small shape, and how linear and full layers scale."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from hybrid_bound import (  # noqa: E402
    DELTA_RULE_FLOPS,
    QWEN3_5_LIKE,
    HybridShape,
    full_layer_flops,
    hybrid_flops_bound,
    linear_layer_flops,
)

from vlm_focus.model_adapters.tiny import tiny_config  # noqa: E402

SMALL = HybridShape(
    hidden=8,
    mlp=16,
    layer_types=("linear_attention", "full_attention"),
    heads=2,
    kv_heads=1,
    head_dim=4,
    linear_key_heads=1,
    linear_value_heads=2,
    linear_key_dim=4,
    linear_value_dim=4,
    conv_kernel=4,
)


def test_layer_flops_by_hand():
    tokens = 3
    mlp = 2 * 3 * 3 * 8 * 16  # 2304
    # q + gate 16, k + v 8, o 8 -> 32 outputs per token of an 8-wide input
    full = 2 * 3 * 8 * 32 + 2 * 2 * 2 * 4 * 3 * 4 / 2 + mlp
    assert full_layer_flops(SMALL, tokens) == full
    # q, k 4 each, v 8 -> 16 conv channels; z 8; a, b 2 each -> 28 outputs; out 8 -> 8
    linear = (
        2 * 3 * 8 * 28 + 2 * 3 * 16 * 4 + DELTA_RULE_FLOPS * 3 * 2 * 4 * 4 + 2 * 3 * 8 * 8 + mlp
    )
    assert linear_layer_flops(SMALL, tokens) == linear
    bound = hybrid_flops_bound(SMALL, seq=10, n_visual=8, keep=0.25, layer=1)  # 10 -> 4 tokens
    expected = (linear_layer_flops(SMALL, 10) + full_layer_flops(SMALL, 10)) / (
        linear_layer_flops(SMALL, 10) + full_layer_flops(SMALL, 4)
    )
    assert bound == pytest.approx(expected)


def test_linear_layers_scale_with_tokens_and_full_layers_faster():
    assert linear_layer_flops(SMALL, 200) == 2 * linear_layer_flops(SMALL, 100)
    assert full_layer_flops(SMALL, 200) > 2 * full_layer_flops(SMALL, 100)
    all_linear = dataclasses.replace(QWEN3_5_LIKE, layer_types=("linear_attention",) * 32)
    all_full = dataclasses.replace(QWEN3_5_LIKE, layer_types=("full_attention",) * 32)
    args = dict(seq=1100, n_visual=1024, keep=0.25, layer=2)
    linear, hybrid, full = (
        hybrid_flops_bound(s, **args) for s in (all_linear, QWEN3_5_LIKE, all_full)
    )
    # an all-linear stack saves exactly the token share of the pruned layers
    share = (2 * 1100 + 30 * (1100 - 768)) / (32 * 1100)
    assert linear == pytest.approx(1 / share)
    assert linear < hybrid < full
    assert hybrid_flops_bound(QWEN3_5_LIKE, 1100, 1024, 1.0, 2) == 1.0


def test_shape_reads_the_qwen3_5_text_config():
    shape = HybridShape.of(tiny_config("qwen3_5").text_config)
    assert shape.layer_types == (
        "linear_attention",
        "linear_attention",
        "full_attention",
        "linear_attention",
    )
    assert (shape.hidden, shape.head_dim, shape.linear_value_heads) == (96, 16, 4)
    assert hybrid_flops_bound(shape, 100, 80, 0.25, 1) > 1.0
