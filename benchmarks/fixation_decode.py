"""Decode speed of decode-time fixation on a long visual context, against its bound.

Model: a random-weight Qwen2.5-VL architecture (text: hidden 512, 8 layers, 8 heads over 4 kv
heads, MLP 1376; a one-block windowed vision tower), one image of 8,192 merged visual tokens.
After one prefill, 16 greedy decode steps with the KV cache are timed; unwrapped and wrapped
runs alternate. The attention share of a decode step is measured as the time the visual keys
add (the same prompt without the image decodes faster by that share); the bound for keep
``k`` at layer ``K`` of ``L`` removes ``share * (L - K) / L * (1 - k)`` of the step.

    python benchmarks/fixation_decode.py [--pairs 3] [--threads 1] [--visual 8192]
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
from vlm_focus.model_adapters.tiny import tiny_model

LAYERS, STEPS = 8, 16
IMAGE, VIDEO, START, END = 31990, 31991, 31992, 31993


#: the text model (``decode.py`` gives its other architectures the same)
TEXT = dict(
    vocab_size=32000,
    hidden_size=512,
    intermediate_size=1376,
    num_hidden_layers=LAYERS,
    num_attention_heads=8,
    num_key_value_heads=4,
)


def build_model() -> torch.nn.Module:
    return tiny_model(
        "qwen2_5_vl",
        text=dict(
            TEXT,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 1e6,
                "mrope_section": [8, 12, 12],
            },
        ),
        vision=dict(
            depth=1,
            patch_size=14,
            out_hidden_size=512,
            fullatt_block_indexes=[],
            window_size=112,
        ),
        image_token_id=IMAGE,
        video_token_id=VIDEO,
        vision_start_token_id=START,
        vision_end_token_id=END,
    )


def build_inputs(n_visual: int) -> dict:
    gen = torch.Generator().manual_seed(0)
    rows = int(n_visual**0.5)
    while n_visual % rows:  # merged rows x cols = n_visual, as square as it divides
        rows -= 1
    grid = (1, 2 * rows, 2 * (n_visual // rows))  # patches (merge 2 x 2)
    text = torch.randint(2, 30000, (40,), generator=gen)
    ids = torch.cat([text[:20], torch.tensor([START] + [IMAGE] * n_visual + [END]), text[20:]])
    ids = ids[None]
    inputs = {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "mm_token_type_ids": (ids == IMAGE).long(),
        "pixel_values": torch.randn(grid[1] * grid[2], 3 * 2 * 14 * 14, generator=gen),
        "image_grid_thw": torch.tensor([grid]),
    }
    return inputs


def decode_loop(model, inputs: dict, steps: int, cache=None):
    """Run the prompt (on ``cache``, default a new dynamic one) and return a function that
    decodes ``steps`` greedy tokens after it, one direct call each, so that a caller can time
    or profile the steps alone."""
    model.model.rope_deltas = None  # Qwen keeps the last image prompt's; a text prompt has none
    with torch.inference_mode():
        out = model(**inputs, use_cache=True, logits_to_keep=1, cache=cache)
    state = {"cache": out.cache, "mask": inputs["attention_mask"]}
    state["token"] = out.logits[:, -1].argmax(-1, keepdim=True)
    # Qwen positions a direct decode call over the whole mask: pass each step's M-RoPE
    # position as generate() does (the prompt length + its rope delta, then one per step)
    delta = model.model.rope_deltas
    start = state["mask"].shape[1] + (0 if delta is None else delta)

    def run() -> None:
        token, mask = state["token"], state["mask"]
        with torch.inference_mode():
            for step in range(steps):
                mask = torch.cat([mask, torch.ones_like(token)], dim=1)
                position = torch.as_tensor(start + step).view(-1, 1).expand(token.shape[0], 1)
                out = model(
                    input_ids=token,
                    attention_mask=mask,
                    cache=state["cache"],
                    position_ids=position[None].expand(3, -1, -1),
                    logits_to_keep=1,
                )
                token = out.logits[:, -1].argmax(-1, keepdim=True)

    return run


def decode_seconds(model, inputs: dict) -> float:
    run = decode_loop(model, inputs, STEPS)
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--visual", type=int, default=8192)
    parser.add_argument("--layer", type=int, default=1)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = build_model()
    inputs = build_inputs(args.visual)
    text_only = {"input_ids": inputs["input_ids"][:, inputs["input_ids"][0] != IMAGE]}
    text_only["attention_mask"] = torch.ones_like(text_only["input_ids"])
    full = statistics.median(decode_seconds(model, inputs) for _ in range(2))
    short = statistics.median(decode_seconds(model, text_only) for _ in range(2))
    share = max(0.0, 1.0 - short / full)
    print(f"machine: {machine()}")
    seq = inputs["input_ids"].shape[1]
    print(
        f"S={seq} ({args.visual} visual), decode step {full / STEPS * 1e3:.1f} ms; without the "
        f"image {short / STEPS * 1e3:.1f} ms: the visual keys are {share:.0%} of a step"
    )
    print("| setting | tok/s unwrapped | tok/s wrapped | speedup (median, min-max) | bound |")
    print("|---|---:|---:|---|---:|")
    rows = []
    frac = (LAYERS - args.layer) / LAYERS
    for keep, refresh in ((0.05, 1), (0.1, 1), (0.05, 4)):
        pairs = []
        for _ in range(args.pairs):
            plain = decode_seconds(model, inputs)
            with vf.wrap(model, pruner="fixation", keep=keep, layer=args.layer, refresh=refresh):
                fixed = decode_seconds(model, inputs)
            pairs.append((plain, fixed))
        ratios = [p / f for p, f in pairs]
        bound = 1.0 / (1.0 - share * frac * (1.0 - keep))
        row = {
            "keep": keep,
            "refresh": refresh,
            "layer": args.layer,
            "tok_s_unwrapped": STEPS / statistics.median(p for p, _ in pairs),
            "tok_s_wrapped": STEPS / statistics.median(f for _, f in pairs),
            "speedup": statistics.median(ratios),
            "min": min(ratios),
            "max": max(ratios),
            "bound": bound,
        }
        rows.append(row)
        setting = f"fixation keep {keep}, refresh {refresh}, K={args.layer}"
        spread = f"{row['speedup']:.2f}x ({row['min']:.2f}-{row['max']:.2f})"
        print(
            f"| {setting} | {row['tok_s_unwrapped']:.1f} | {row['tok_s_wrapped']:.1f} | "
            f"{spread} | {bound:.2f}x |",
            flush=True,
        )
    args.out.mkdir(parents=True, exist_ok=True)
    result = {"machine": machine(), "visual": args.visual, "attention_share": share, "rows": rows}
    (args.out / "fixation_decode.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
