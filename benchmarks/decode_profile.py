"""Where a decode step's time goes: the torch profiler over decode steps of ``decode.py``'s
model, unwrapped and then wrapped, after an unprofiled prefill on the same kind of cache.

    python benchmarks/decode_profile.py [--visual 8192] [--batch 1] [--cache static]
        [--setting fixation] [--steps 8] [--rows 12]

Prints, per run, the operators with the most self CPU time (their share of the profiled
steps), so a ratio that falls short of its bound can be traced to what does not shrink.
"""

from __future__ import annotations

import argparse

import torch
from decode import SETTINGS, batch_inputs
from fixation_decode import build_model
from torch.profiler import ProfilerActivity, profile
from transformers import DynamicCache, StaticCache


def profiled_steps(model, inputs: dict, cache_kind: str, steps: int):
    """Prefill (not profiled), then ``steps`` greedy decode steps under the profiler."""
    model.model.rope_deltas = None
    text = model.config.get_text_config()
    width = inputs["input_ids"].shape[1] + steps + 1
    cache = (
        StaticCache(config=text, max_cache_len=width) if cache_kind == "static" else DynamicCache()
    )
    with torch.inference_mode():
        out = model(**inputs, cache=cache, use_cache=True, logits_to_keep=1)
        mask = inputs["attention_mask"]
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        delta = model.model.rope_deltas
        position = mask.shape[1] + (0 if delta is None else delta)  # M-RoPE, as generate()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(steps):
                mask = torch.cat([mask, torch.ones_like(token)], dim=1)
                ids = torch.as_tensor(position).view(-1, 1).expand(token.shape[0], 1)
                out = model(
                    input_ids=token,
                    attention_mask=mask,
                    cache=cache,
                    position_ids=ids[None].expand(3, -1, -1),
                    logits_to_keep=1,
                )
                token = out.logits[:, -1].argmax(-1, keepdim=True)
                position = position + 1
    return prof


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--visual", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--cache", choices=("static", "dynamic"), default="static")
    parser.add_argument("--setting", choices=list(SETTINGS), default="fixation")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rows", type=int, default=12)
    args = parser.parse_args()
    model = build_model()
    inputs = batch_inputs(args.visual, args.batch, "cpu", torch.float32)
    setting = SETTINGS[args.setting]
    for label in ("unwrapped", setting.name):
        if label == "unwrapped":
            prof = profiled_steps(model, inputs, args.cache, args.steps)
        else:
            with setting.wrap(model):
                prof = profiled_steps(model, inputs, args.cache, args.steps)
        events = prof.key_averages()
        total = sum(e.self_cpu_time_total for e in events)
        print(f"\n## {label}: {args.steps} steps, {total / 1e3 / args.steps:.1f} ms per step")
        print("| operator | self CPU ms per step | share |")
        print("|---|---:|---:|")
        top = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[: args.rows]
        for e in top:
            ms = e.self_cpu_time_total / 1e3 / args.steps
            print(f"| `{e.key}` | {ms:.2f} | {e.self_cpu_time_total / total:.0%} |")


if __name__ == "__main__":
    main()
