"""Decode speed of a wrapped model against the unwrapped one, measured in one run.

Model: a random-weight LLaVA architecture (Llama text: hidden 512, 4 layers, 8 heads, MLP 1376;
CLIP tower at 192 px / patch 16 -> 144 visual tokens), batch 1 and a left-padded batch 8.
After one prefill, 32 greedy decode steps with the KV cache are timed on their own. Wrapped and
unwrapped runs alternate; each ratio pairs two back-to-back runs.

* ``keep=1.0``: the hooks run on every decode step but drop nothing: the pure overhead.
* ``keep=0.25`` at K = 2: the overhead plus the shorter caches of the pruned layers.

    python benchmarks/decode_overhead.py [--pairs 5] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import prefill
import torch
from prefill import machine

import vlm_focus as vf

HIDDEN, LAYERS, HEADS, MLP = 512, 4, 8, 1376
IMAGE_TOKEN = prefill.IMAGE_TOKEN
STEPS = 32


def build_model():
    return prefill.build_model(HIDDEN, LAYERS, HEADS, MLP, image_size=192, patch_size=16)


def build_inputs(batch: int) -> dict:
    """Row b: ``3 * b`` left pads, 20 text tokens, 144 image tokens, 20 + b text tokens."""
    gen = torch.Generator().manual_seed(0)
    rows = []
    for b in range(batch):
        text = torch.randint(2, 30000, (40 + b,), generator=gen).tolist()
        rows.append(text[:20] + [IMAGE_TOKEN] * 144 + text[20:])
    width = max(len(r) for r in rows) + 3 * (batch - 1)
    ids = torch.zeros(batch, width, dtype=torch.long)
    mask = torch.zeros(batch, width, dtype=torch.long)
    for b, row in enumerate(rows):
        ids[b, width - len(row) :] = torch.tensor(row)
        mask[b, width - len(row) :] = 1
    pixels = torch.randn(batch, 3, 192, 192, generator=gen)
    return {"input_ids": ids, "attention_mask": mask, "pixel_values": pixels}


def decode_seconds(model, inputs: dict) -> float:
    """Wall time of STEPS greedy decode steps after one prefill (the prefill is not timed)."""
    with torch.inference_mode():
        out = model(**inputs, use_cache=True, logits_to_keep=1)
        cache, mask = out.cache, inputs["attention_mask"]
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        start = time.perf_counter()
        for _ in range(STEPS):
            mask = torch.cat([mask, torch.ones_like(token)], dim=1)
            out = model(input_ids=token, attention_mask=mask, cache=cache, logits_to_keep=1)
            token = out.logits[:, -1].argmax(-1, keepdim=True)
        return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = build_model()
    print(f"machine: {machine()}")
    print("| batch | setting | unwrapped tok/s | wrapped tok/s | ratio (median, min-max) | pairs |")
    print("|---|---|---:|---:|---|---:|")
    rows = []
    for batch in (1, 8):
        inputs = build_inputs(batch)
        for keep, layer in ((1.0, 2), (0.25, 2)):
            decode_seconds(model, inputs)  # warm-up
            pairs = []
            for _ in range(args.pairs):
                plain = decode_seconds(model, inputs)
                with vf.wrap(model, pruner="fastv", keep=keep, layer=layer):
                    wrapped = decode_seconds(model, inputs)
                pairs.append((plain, wrapped))
            ratios = [p / w for p, w in pairs]  # tokens/s wrapped over unwrapped
            tokens = batch * STEPS
            row = {
                "batch": batch,
                "keep": keep,
                "layer": layer,
                "tokens_per_s_unwrapped": tokens / statistics.median(p for p, _ in pairs),
                "tokens_per_s_wrapped": tokens / statistics.median(w for _, w in pairs),
                "ratio_median": statistics.median(ratios),
                "ratio_min": min(ratios),
                "ratio_max": max(ratios),
                "pairs": args.pairs,
            }
            rows.append(row)
            print(
                f"| {batch} | fastv keep {keep} K={layer} | {row['tokens_per_s_unwrapped']:.0f} | "
                f"{row['tokens_per_s_wrapped']:.0f} | {row['ratio_median']:.3f} "
                f"({row['ratio_min']:.3f}-{row['ratio_max']:.3f}) | {args.pairs} |",
                flush=True,
            )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "decode_overhead.json").write_text(
        json.dumps({"machine": machine(), "steps": STEPS, "rows": rows}, indent=1)
    )


if __name__ == "__main__":
    main()
