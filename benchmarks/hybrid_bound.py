"""Prefill FLOPs bound of in-LLM pruning on a hybrid decoder (Qwen3.5: Gated DeltaNet layers
beside full-attention layers).

Pruning at layer K lets layers >= K run on the kept tokens only. A full-attention layer's cost
grows as ``T^2`` in its attention, so dropping tokens there saves more than their share; a linear
layer's costs ``O(T)`` per layer (projections, a short convolution and a fixed-size state update
per token), so dropping tokens saves exactly their share. The bound is the ratio of the
decoder's forward FLOPs unpruned to pruned::

    bound = sum_i F_i(S) / (sum_{i<K} F_i(S) + sum_{i>=K} F_i(S'))

with ``F_i`` the layer's FLOPs at that many tokens (:func:`full_layer_flops`,
:func:`linear_layer_flops`). Counted: every matmul as 2 FLOPs per multiply-add, the causal
attention as half of ``T x T``, the depthwise convolution, and the gated delta rule's state
update as ``DELTA_RULE_FLOPS`` per state element per token; norms, activations and gates are left
out (a few FLOPs per hidden element, under 1% at these shapes).

    python benchmarks/hybrid_bound.py [--seq 1100] [--visual 1024] [--keep 0.25] [--layer 2]

``--measure`` also times prefill, pruned (fastv at ``--layer``) against unpruned in one run, on a
random-weight ``Qwen3_5ForConditionalGeneration`` with a tiny vision tower (so that the decoder
dominates) and the decoder of :data:`MEASURED` (hidden 1024, 8 layers at 3:1), and prints the
speed-up next to that decoder's bound at the same token counts:

    python benchmarks/hybrid_bound.py --measure [--keeps 0.5 0.25 0.11] [--repeats 5]
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch

#: FLOPs per recurrent-state element per token of the gated delta rule: decay (1), the read
#: ``S^T k`` (2), the rank-one write ``k (beta (v - S^T k))^T`` (2) and the output ``S^T q`` (2).
DELTA_RULE_FLOPS = 7


@dataclass(frozen=True)
class HybridShape:
    """The decoder's shape, as Qwen3.5's text config names it."""

    hidden: int
    mlp: int
    layer_types: tuple[str, ...]
    heads: int
    kv_heads: int
    head_dim: int
    linear_key_heads: int
    linear_value_heads: int
    linear_key_dim: int
    linear_value_dim: int
    conv_kernel: int
    gated_queries: bool = True  # q_proj also gives each head's output gate

    @classmethod
    def of(cls, config) -> HybridShape:
        """The shape of a Qwen3.5 text config (``model.config.text_config``)."""
        return cls(
            hidden=config.hidden_size,
            mlp=config.intermediate_size,
            layer_types=tuple(config.layer_types),
            heads=config.num_attention_heads,
            kv_heads=config.num_key_value_heads,
            head_dim=config.head_dim,
            linear_key_heads=config.linear_num_key_heads,
            linear_value_heads=config.linear_num_value_heads,
            linear_key_dim=config.linear_key_head_dim,
            linear_value_dim=config.linear_value_head_dim,
            conv_kernel=config.linear_conv_kernel_dim,
        )


def mlp_flops(shape: HybridShape, tokens: int) -> float:
    """Gate, up and down projections."""
    return 2 * tokens * 3 * shape.hidden * shape.mlp


def full_layer_flops(shape: HybridShape, tokens: int) -> float:
    """A full-attention layer: projections (q with its gate), causal attention, MLP."""
    queries = shape.heads * shape.head_dim * (2 if shape.gated_queries else 1)
    kv = 2 * shape.kv_heads * shape.head_dim
    out = shape.heads * shape.head_dim
    projections = 2 * tokens * shape.hidden * (queries + kv + out)
    attention = 2 * 2 * shape.heads * shape.head_dim * tokens * (tokens + 1) / 2
    return projections + attention + mlp_flops(shape, tokens)


def linear_layer_flops(shape: HybridShape, tokens: int) -> float:
    """A Gated DeltaNet layer: in-projections (q, k, v, the output gate z, a and b), the
    depthwise causal convolution over q/k/v, the delta rule's state, the out-projection, MLP."""
    keys = shape.linear_key_heads * shape.linear_key_dim
    values = shape.linear_value_heads * shape.linear_value_dim
    channels = 2 * keys + values
    inputs = 2 * tokens * shape.hidden * (channels + values + 2 * shape.linear_value_heads)
    conv = 2 * tokens * channels * shape.conv_kernel
    state = shape.linear_value_heads * shape.linear_key_dim * shape.linear_value_dim
    recurrence = DELTA_RULE_FLOPS * tokens * state
    out = 2 * tokens * values * shape.hidden
    return inputs + conv + recurrence + out + mlp_flops(shape, tokens)


def layer_flops(shape: HybridShape, index: int, tokens: int) -> float:
    if shape.layer_types[index] == "linear_attention":
        return linear_layer_flops(shape, tokens)
    return full_layer_flops(shape, tokens)


def hybrid_flops_bound(
    shape: HybridShape, seq: int, n_visual: int, keep: float, layer: int
) -> float:
    """Decoder-only prefill speedup bound when layers ``>= layer`` see ``seq - n_visual +
    round(keep * n_visual)`` tokens."""
    kept = seq - n_visual + round(keep * n_visual)
    n_layers = len(shape.layer_types)
    full = sum(layer_flops(shape, i, seq) for i in range(n_layers))
    pruned = sum(layer_flops(shape, i, seq if i < layer else kept) for i in range(n_layers))
    return full / pruned


#: Qwen3.5-9B-like text decoder: 32 layers, one full-attention layer in every 4.
QWEN3_5_LIKE = HybridShape(
    hidden=4096,
    mlp=12288,
    layer_types=tuple(
        "full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(32)
    ),
    heads=16,
    kv_heads=4,
    head_dim=256,
    linear_key_heads=16,
    linear_value_heads=32,
    linear_key_dim=128,
    linear_value_dim=128,
    conv_kernel=4,
)


#: The decoder :func:`measured_speedups` times: Qwen3.5's layout at a size a CPU runs.
MEASURED = dict(
    hidden_size=1024,
    intermediate_size=3072,
    num_hidden_layers=8,
    layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(8)],
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=128,
    linear_num_key_heads=8,
    linear_num_value_heads=16,
    linear_key_head_dim=64,
    linear_value_head_dim=64,
    rope_parameters={"mrope_section": [8, 12, 12]},  # 64 rotary dims of 128, as Qwen3.5
)


def measured_speedups(
    keeps: list[float], layer: int, side: int = 32, text: int = 76, repeats: int = 5
) -> list[dict]:
    """Prefill wall time unpruned against fastv at `layer` for each keep, in one run, on one
    image of `side` x `side` merged tokens and `text` text tokens, with each setting's bound."""
    from prefill import median_seconds  # the benchmarks' one timer

    import vlm_focus as vf
    from vlm_focus.model_adapters.tiny import BOS, IMAGE, VISION_END, VISION_START, tiny_model
    from vlm_focus.timing import prefill_fn

    model = tiny_model(
        "qwen3_5", text=MEASURED, vision={"out_hidden_size": MEASURED["hidden_size"]}
    )
    n_visual = side * side
    ids = [BOS] + [5] * (text // 2) + [VISION_START] + [IMAGE] * n_visual + [VISION_END]
    ids += [6] * (text - len(ids) + n_visual + 2)
    vision = model.config.vision_config
    patch = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
    inputs = dict(
        input_ids=torch.tensor([ids]),
        attention_mask=torch.ones(1, len(ids), dtype=torch.long),
        mm_token_type_ids=torch.tensor([[int(t == IMAGE) for t in ids]]),
        pixel_values=torch.randn(4 * n_visual, patch),
        image_grid_thw=torch.tensor([[1, 2 * side, 2 * side]]),
    )
    shape = HybridShape.of(model.config.text_config)
    base = median_seconds(prefill_fn(model, inputs), repeats)
    rows = []
    for keep in keeps:
        handle = vf.wrap(model, vf.FocusConfig(pruner="fastv", keep=keep, layer=layer))
        try:
            pruned = median_seconds(prefill_fn(model, inputs), repeats)
        finally:
            handle.remove()
        rows.append(
            {
                "keep": keep,
                "layer": layer,
                "tokens": len(ids),
                "visual": n_visual,
                "unpruned_s": base,
                "pruned_s": pruned,
                "speedup": base / pruned,
                "bound": hybrid_flops_bound(shape, len(ids), n_visual, keep, layer),
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seq", type=int, default=1100)
    parser.add_argument("--visual", type=int, default=1024)
    parser.add_argument("--keep", type=float, default=0.25)
    parser.add_argument("--layer", type=int, default=2)
    parser.add_argument("--measure", action="store_true", help="also time prefill (see above)")
    parser.add_argument("--keeps", type=float, nargs="+", default=[0.5, 0.25, 0.11])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    bound = hybrid_flops_bound(QWEN3_5_LIKE, args.seq, args.visual, args.keep, args.layer)
    kept = args.seq - args.visual + round(args.keep * args.visual)
    print(f"hybrid 3:1 decoder, {args.seq} -> {kept} tokens from layer {args.layer}: {bound:.3f}x")
    if args.measure:
        torch.set_num_threads(args.threads)
        print(f"measured ({args.threads} threads), fastv at layer {args.layer}:")
        for row in measured_speedups(args.keeps, args.layer, repeats=args.repeats):
            print(
                f"  keep {row['keep']}: {row['tokens']} tokens, {row['visual']} visual: "
                f"prefill {row['speedup']:.2f}x faster, bound {row['bound']:.2f}x"
            )


if __name__ == "__main__":
    main()
