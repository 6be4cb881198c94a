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
from fixation_decode import build_model, decode_loop
from torch.profiler import ProfilerActivity, profile
from transformers import DynamicCache, StaticCache


def profiled_steps(model, inputs: dict, cache_kind: str, steps: int):
    """Prefill (not profiled), then ``steps`` greedy decode steps under the profiler."""
    width = inputs["input_ids"].shape[1] + steps + 1
    text = model.config.get_text_config()
    cache = (
        StaticCache(config=text, max_cache_len=width) if cache_kind == "static" else DynamicCache()
    )
    run = decode_loop(model, inputs, steps, cache)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run()
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
