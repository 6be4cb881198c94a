"""Prefill speed of in-LLM pruning on a Qwen3-VL-shaped model, against its FLOPs bound.

Model: a random-weight ``Qwen3VLForConditionalGeneration`` whose text model is 7B-like in shape
but small (hidden 1024, 8 layers, 16 heads of 64 over 8 kv heads, MLP 2816, q/k norms,
interleaved M-RoPE) with a tiny 3-layer vision tower feeding DeepStack after decoder layers
0, 1 and 2; one 896 x 896 image -> 64 x 64 patches -> 1,024 visual tokens. fastv at K = 2.
Pruned and unpruned prefills alternate, so each ratio pairs two runs taken back to back; the
table gives the median ratio, its min-max over the pairs and the run count.

    python benchmarks/qwen3_vl_prefill.py [--pairs 7] [--threads 2] [--keep 0.25] [--layer 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from prefill import machine

import vlm_focus as vf
from vlm_focus.model_adapters.tiny import IMAGE, VISION_END, VISION_START, tiny_model
from vlm_focus.timing import prefill_fn

HIDDEN, LAYERS, HEADS, KV_HEADS, HEAD_DIM, MLP, VOCAB = 1024, 8, 16, 8, 64, 2816, 32000
GRID = (1, 64, 64)  # temporal, height, width patches -> 1,024 merged visual tokens
PROMPT_TEXT = 40


def build_model() -> torch.nn.Module:
    """The tiny Qwen3-VL (its token ids, interleaved M-RoPE, DeepStack) at the shape above."""
    return tiny_model(
        "qwen3_vl",
        text=dict(
            vocab_size=VOCAB,
            hidden_size=HIDDEN,
            intermediate_size=MLP,
            num_hidden_layers=LAYERS,
            num_attention_heads=HEADS,
            num_key_value_heads=KV_HEADS,
            head_dim=HEAD_DIM,
            rope_parameters={"rope_theta": 1e6, "mrope_section": [12, 10, 10]},  # 32 = Dh / 2
        ),
        vision=dict(
            hidden_size=64,
            intermediate_size=128,
            out_hidden_size=HIDDEN,
            num_position_embeddings=256,
        ),
    )


def build_inputs() -> tuple[dict, int]:
    gen = torch.Generator().manual_seed(0)
    t, h, w = GRID
    n_visual = t * h * w // 4
    text = VISION_END + 1  # text tokens: above the tiny vocabulary's special ids
    before = torch.randint(text, VOCAB, (PROMPT_TEXT // 2,), generator=gen)
    after = torch.randint(text, VOCAB, (PROMPT_TEXT - PROMPT_TEXT // 2,), generator=gen)
    image = torch.tensor([VISION_START] + [IMAGE] * n_visual + [VISION_END])
    ids = torch.cat([before, image, after])[None]
    return {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "mm_token_type_ids": (ids == IMAGE).long(),
        "pixel_values": torch.randn(t * h * w, 3 * 2 * 14 * 14, generator=gen),
        "image_grid_thw": torch.tensor([GRID]),
    }, n_visual


def layer_flops(tokens: int) -> float:
    """Forward FLOPs of one decoder layer (GQA projections, MLP, causal attention)."""
    q_o = 2 * HIDDEN * HEADS * HEAD_DIM
    k_v = 2 * HIDDEN * KV_HEADS * HEAD_DIM
    linear = 2 * tokens * (q_o + k_v + 3 * HIDDEN * MLP)
    attention = 2 * 2 * HEADS * HEAD_DIM * tokens * (tokens + 1) / 2
    return linear + attention


def flops_bound(seq: int, n_visual: int, keep: float, layer: int) -> float:
    """Decoder-only speedup bound: layers >= K see the kept tokens only."""
    kept = seq - n_visual + round(keep * n_visual)
    full = LAYERS * layer_flops(seq)
    return full / (layer * layer_flops(seq) + (LAYERS - layer) * layer_flops(kept))


def _seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--pairs", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--keep", type=float, default=0.25)
    parser.add_argument("--layer", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = build_model()
    inputs, n_visual = build_inputs()
    seq = inputs["input_ids"].shape[1]
    fn = prefill_fn(model, inputs)
    fn()  # warm-up, unpruned
    with vf.wrap(model, pruner="fastv", keep=args.keep, layer=args.layer) as handle:
        fn()  # warm-up, pruned
    kept = handle.last_trace.n_kept[0]
    pairs = []
    for _ in range(args.pairs):
        full = _seconds(fn)
        with vf.wrap(model, pruner="fastv", keep=args.keep, layer=args.layer):
            pruned = _seconds(fn)
        pairs.append((full, pruned))
    ratios = [f / p for f, p in pairs]
    result = {
        "machine": machine(),
        "model": "Qwen3-VL-shaped random weights: hidden 1024, 8 layers, GQA 16/8, DeepStack 3",
        "seq": seq,
        "n_visual": n_visual,
        "kept": kept,
        "keep": args.keep,
        "layer": args.layer,
        "pairs": args.pairs,
        "ms_unpruned_median": statistics.median(f for f, _ in pairs) * 1e3,
        "ms_pruned_median": statistics.median(p for _, p in pairs) * 1e3,
        "ratio_median": statistics.median(ratios),
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
        "flops_bound": flops_bound(seq, n_visual, args.keep, args.layer),
    }
    print(f"machine: {result['machine']}")
    print(
        f"{result['model']}; S={seq}, {n_visual} visual tokens, fastv keep {args.keep} at "
        f"K={args.layer} (kept {kept})"
    )
    print(
        f"prefill speedup {result['ratio_median']:.2f}x (min {result['ratio_min']:.2f}, max "
        f"{result['ratio_max']:.2f}, {args.pairs} alternating pairs) vs FLOPs bound "
        f"{result['flops_bound']:.2f}x"
    )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "qwen3_vl_prefill.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
