"""The GPU checks of one lent device, as one script: prefill and generate() ratios of a
random-weight 7B-shaped LLaVA (bf16, SDPA) at 576 and 2,880 visual tokens, batch 1 and 8,
pruned (fastv, keep 0.25, K = 2) against unpruned; then ``decode.py``'s fast-decoding rows at
8,192 visual tokens, batch 1 and 8: the static cache eager and compiled with CUDA graphs
(``mode="reduce-overhead"``), for fastv, fixation and the hooks alone, in one run.

    python benchmarks/gpu_round.py [--out benchmarks/results] [--tiny] [--no-decode]

``--tiny`` shrinks the model so that the script itself can be checked on a CPU; the numbers
then mean nothing. The rest of a device round: ``python -m pytest -m gpu -q`` and
``python benchmarks/kernel.py``. Results go to ``gpu_round.json`` with the device named.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import decode
import prefill
import torch

import vlm_focus as vf

SHAPE_7B = dict(hidden=4096, layers=32, heads=32, mlp=11008)
SHAPE_TINY = dict(hidden=128, layers=4, heads=4, mlp=256)


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _seconds(fn) -> float:
    _sync()
    start = time.perf_counter()
    fn()
    _sync()
    return time.perf_counter() - start


def _inputs(model, n_visual: int, batch: int, device: str, dtype: torch.dtype) -> dict:
    one = prefill.build_inputs(n_visual)
    size = model.config.vision_config.image_size
    one["pixel_values"] = torch.randn(1, 3, size, size, generator=torch.Generator().manual_seed(0))
    out = {k: v.expand(batch, *v.shape[1:]).to(device) for k, v in one.items()}
    out["pixel_values"] = out["pixel_values"].to(dtype)
    return out


def _model(shape: dict, n_visual: int, device: str, dtype: torch.dtype):
    side = int(round(n_visual**0.5))  # 24^2 = 576; 2,880 is not a square: 54^2 = 2,916
    with torch.device(device):  # a 7B random init takes minutes on a CPU, moments on a GPU
        model = prefill.build_model(**shape, image_size=side * 14, patch_size=14)
    return model.to(device=device, dtype=dtype), side * side


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--no-decode", action="store_true", help="skip decode.py's rows")
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    name = torch.cuda.get_device_name() if cuda else "cpu"
    shape = SHAPE_TINY if args.tiny or not cuda else SHAPE_7B
    rows = []
    print(f"device: {name}; model {shape}; {dtype}")
    print("| visual | batch | prefill ms (unpruned / pruned) | ratio | generate 32 ms | ratio |")
    print("|---:|---:|---|---:|---|---:|")
    for want in (576, 2880):
        model, n_visual = _model(shape, want, device, dtype)
        for batch in (1, 8):
            inputs = _inputs(model, n_visual, batch, device, dtype)
            run_prefill = prefill.prefill_fn(model, inputs)

            def run_generate(model=model, inputs=inputs):
                with torch.inference_mode():
                    model.generate(**inputs, max_new_tokens=32, min_new_tokens=32, do_sample=False)

            times = {"prefill": [], "generate": []}
            for _ in range(args.pairs):
                for kind, fn in (("prefill", run_prefill), ("generate", run_generate)):
                    plain = _seconds(fn)
                    with vf.wrap(model, pruner="fastv", keep=0.25, layer=2):
                        pruned = _seconds(fn)
                    times[kind].append((plain, pruned))
            row = {"visual": n_visual, "batch": batch}
            for kind, pairs in times.items():
                pairs = pairs[1:] if len(pairs) > 1 else pairs  # the first pair warms up
                row[kind] = {
                    "ms_unpruned": statistics.median(p for p, _ in pairs) * 1e3,
                    "ms_pruned": statistics.median(q for _, q in pairs) * 1e3,
                    "ratio": statistics.median(p / q for p, q in pairs),
                }
            rows.append(row)
            p, g = row["prefill"], row["generate"]
            print(
                f"| {n_visual} | {batch} | {p['ms_unpruned']:.1f} / {p['ms_pruned']:.1f} | "
                f"{p['ratio']:.2f}x | {g['ms_unpruned']:.0f} / {g['ms_pruned']:.0f} | "
                f"{g['ratio']:.2f}x |",
                flush=True,
            )
        del model
        if cuda:
            torch.cuda.empty_cache()
    args.out.mkdir(parents=True, exist_ok=True)
    result = {"device": name, "dtype": str(dtype), "shape": shape, "rows": rows}
    (args.out / ("gpu_round.json" if cuda and not args.tiny else "gpu_round_dry.json")).write_text(
        json.dumps(result, indent=1)
    )
    if not args.no_decode:
        visual = [8192] if cuda and not args.tiny else [64]
        decode_out = args.out if cuda and not args.tiny else args.out / "gpu_round_dry"
        decode.run_grid(
            visual, [1, 8], ["static", "compiled"], list(decode.SETTINGS), 3, 32, decode_out
        )


if __name__ == "__main__":
    main()
