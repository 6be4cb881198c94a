"""Prefill speed of in-LLM pruning against the unpruned model, measured in one run.

Model: a random-weight LLaVA-architecture model (Llama text: hidden 1024, 8 layers, 16 heads,
MLP 2816; CLIP tower at 336 px / patch 14 -> 576 visual tokens, kept tiny so that the language
model dominates), pruned with fastv at K=2. Reports, per keep ratio, the prefill speedup next
to its FLOPs bound, the scoring overhead as a share of unpruned prefill, and the peak memory of
the scoring step against FastV-style eager ``output_attentions`` at S = 2,880.

    python benchmarks/prefill.py [--repeats 7] [--threads 2] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import platform
import resource
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import LlamaConfig

import vlm_focus as vf
from vlm_focus.kernels import score_and_select
from vlm_focus.model_adapters.tiny import tiny_model
from vlm_focus.pruners import apply_rope
from vlm_focus.timing import prefill_fn


def median_seconds(fn: Callable[[], object], repeats: int = 5, warmup: int = 1) -> float:
    """Median wall time of ``fn()``; CUDA work is synchronised before each clock read."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


HIDDEN, LAYERS, HEADS, MLP, VOCAB = 1024, 8, 16, 2816, 32000
IMAGE_TOKEN = 31999
PROMPT_TEXT = 40  # text tokens around the image (system + question)


def build_model(
    hidden: int = HIDDEN,
    layers: int = LAYERS,
    heads: int = HEADS,
    mlp: int = MLP,
    image_size: int = 336,
    patch_size: int = 14,
) -> torch.nn.Module:
    """Random weights; the vision tower is kept tiny so that the language model dominates."""
    return tiny_model(
        "llava",
        text=dict(
            vocab_size=VOCAB,
            hidden_size=hidden,
            intermediate_size=mlp,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=heads,
        ),
        vision=dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=1,
            image_size=image_size,
            patch_size=patch_size,
        ),
        image_token_id=IMAGE_TOKEN,
    )


def build_inputs(n_visual: int = 576) -> dict:
    gen = torch.Generator().manual_seed(0)
    before = torch.randint(2, 30000, (PROMPT_TEXT // 2,), generator=gen)
    after = torch.randint(2, 30000, (PROMPT_TEXT - PROMPT_TEXT // 2,), generator=gen)
    ids = torch.cat([before, torch.full((n_visual,), IMAGE_TOKEN), after])[None]
    return {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "pixel_values": torch.randn(1, 3, 336, 336, generator=gen),
    }


def layer_flops(tokens: int) -> float:
    """Forward FLOPs of one decoder layer on ``tokens`` tokens (projections, MLP, causal
    attention scores and weighted sum)."""
    linear = 2 * tokens * (4 * HIDDEN * HIDDEN + 3 * HIDDEN * MLP)
    attention = 2 * 2 * HIDDEN * tokens * (tokens + 1) / 2
    return linear + attention


def flops_bound(seq: int, n_visual: int, keep: float, layer: int) -> float:
    kept = seq - n_visual + round(keep * n_visual)
    full = LAYERS * layer_flops(seq)
    pruned = layer * layer_flops(seq) + (LAYERS - layer) * layer_flops(kept)
    return full / pruned


def _peak_rss_child(method: str, seq: int, queue) -> None:
    """Peak RSS growth of one scoring step at sequence length ``seq`` (fresh process)."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        intermediate_size=MLP,
        num_hidden_layers=1,
        vocab_size=32,
    )
    from transformers.models.llama.modeling_llama import LlamaAttention, LlamaRotaryEmbedding

    config._attn_implementation = "eager"
    attn = LlamaAttention(config, 0).eval()
    hidden = torch.randn(1, seq, HIDDEN)
    cos, sin = LlamaRotaryEmbedding(config)(hidden, torch.arange(seq)[None])
    mask = torch.full((seq, seq), float("-inf")).triu(1)[None, None]
    visual = torch.zeros(1, seq, dtype=torch.bool)
    visual[:, 35 : seq - 40] = True
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with torch.no_grad():
        if method == "eager":  # FastV: materialise [B, H, S, S] attention, head mean, top-k
            _, weights = attn(hidden, (cos, sin), mask)
            scores = weights.mean(1)[0, -1]
            scores.masked_fill(~visual[0], float("-inf")).topk(seq // 4)
        else:
            q = attn.q_proj(hidden[:, -1:]).view(1, 1, HEADS, -1).transpose(1, 2)
            k = attn.k_proj(hidden).view(1, seq, HEADS, -1).transpose(1, 2)
            q = apply_rope(q, cos[:, -1:], sin[:, -1:])
            k = apply_rope(k, cos, sin)
            score_and_select(q, k, visual, seq // 4, scaling=attn.scaling)
    queue.put((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 1024)  # MiB


def peak_memory(method: str, seq: int) -> float:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_peak_rss_child, args=(method, seq, queue))
    proc.start()
    result = queue.get()
    proc.join()
    return result


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu}; torch {torch.__version__}; {torch.get_num_threads()} threads"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--layer", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, inputs = build_model(), build_inputs()
    seq, n_visual = inputs["input_ids"].shape[1], 576
    print(f"machine: {machine()}")
    print(
        f"model: LLaVA-arch, hidden {HIDDEN}, {LAYERS} layers, {n_visual} visual tokens, "
        f"S={seq}, fastv at K={args.layer}"
    )
    base = median_seconds(prefill_fn(model, inputs), repeats=args.repeats)
    rows = [{"keep": 1.0, "ms": base * 1e3, "speedup": 1.0, "bound": 1.0}]
    print(f"unpruned prefill: {base * 1e3:.1f} ms (median of {args.repeats})")
    print("| keep | kept | prefill ms | speedup | FLOPs bound | share of bound | scoring % |")
    print("|---|---|---|---|---|---|---|")
    for keep in (0.5, 0.25, 0.11):
        with vf.wrap(model, pruner="fastv", keep=keep, layer=args.layer) as handle:
            fn = prefill_fn(model, inputs)
            t = median_seconds(fn, repeats=args.repeats)
            scoring = []
            for _ in range(args.repeats):
                fn()
                scoring.append(handle.last_trace.seconds)
        bound = flops_bound(seq, n_visual, keep, args.layer)
        share = sorted(scoring)[len(scoring) // 2] / base
        row = {
            "keep": keep,
            "kept": handle.last_trace.n_kept[0],
            "ms": t * 1e3,
            "speedup": base / t,
            "bound": bound,
            "scoring_share": share,
        }
        rows.append(row)
        print(
            f"| {keep} | {row['kept']} | {t * 1e3:.1f} | {base / t:.2f}x | {bound:.2f}x | "
            f"{(base / t) / bound:.0%} | {share:.2%} |"
        )
    memory = {m: peak_memory(m, 2880) for m in ("ours", "eager")}
    slab_kib = HEADS * 2880 * 4 / 1024  # our [B, H, Tq=1, S] fp32 probabilities
    full_mib = HEADS * 2880 * 2880 * 4 / 2**20  # eager [B, H, S, S] fp32 attention
    print(
        f"scoring-step peak memory at S=2880 (RSS growth): q/k scoring {memory['ours']:.0f} MiB"
        f" vs eager output_attentions {memory['eager']:.0f} MiB; largest intermediate "
        f"{slab_kib:.0f} KiB [B,H,Tq,S] vs {full_mib:.0f} MiB [B,H,S,S]"
    )
    args.out.mkdir(parents=True, exist_ok=True)
    result = {
        "machine": machine(),
        "seq": seq,
        "layer": args.layer,
        "rows": rows,
        "peak_mib_s2880": memory,
    }
    (args.out / "prefill.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
