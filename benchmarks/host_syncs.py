"""Host reads of a wrapped ``generate()``: per prefill (batch 1, 4, 8) and per decode step.

A host read (``item``, ``bool``, ``tolist``, ``cpu``, ``nonzero``, boolean-mask indexing, ...)
stalls a GPU pipeline until the device catches up. This counts, on CPU, the reads vlm_focus's
own code makes (``tests/host_reads.py`` marks the inputs as device tensors), on the tiny LLaVA
of the tests, 4 new tokens, every registered pruner at keep 0.5 (layer 2; ``guided`` and
``pyramid`` at layer 0).

    python benchmarks/host_syncs.py [--out benchmarks/results/host_syncs.json]

Run it with an older checkout first on ``PYTHONPATH`` to compare (the instrument and the inputs
come from this tree's ``tests/``, the tiny models from the checkout's
``vlm_focus.model_adapters.tiny``, so the older checkout must have that module).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from host_reads import on_device, per_forward  # noqa: E402
from tiny_models import make_inputs, make_model  # noqa: E402

import vlm_focus as vf  # noqa: E402


def reads(pruner: str, batch: int) -> tuple[int, list[int]]:
    model = make_model("llava")
    inputs = on_device(make_inputs("llava", model, batch=batch))
    options = {}
    if pruner == "guided":
        guide = make_model("llava", seed=3)
        options = dict(guide=guide, guide_inputs=on_device(make_inputs("llava", guide, batch)))
    layer = 0 if pruner in ("guided", "pyramid") else 2
    with torch.no_grad(), vf.wrap(model, pruner=pruner, keep=0.5, layer=layer, **options):
        with per_forward(model) as marks:
            model.generate(**inputs, max_new_tokens=4, do_sample=False)
    steps = [b - a for a, b in zip(marks[1:], marks[2:])]
    return marks[1], steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = {}
    print(f"vlm_focus from {Path(vf.__file__).parent}")
    print("| pruner | prefill B=1 | B=4 | B=8 | per decode step (B=8) |")
    print("|---|---:|---:|---:|---:|")
    for pruner in vf.pruners():
        try:
            counts = {b: reads(pruner, b) for b in (1, 4, 8)}
        except Exception as err:  # an older tree may fail where this one does not
            rows[pruner] = {"error": f"{type(err).__name__}: {err}"}
            print(f"| {pruner} | fails: {type(err).__name__}: {str(err)[:70]} | | | |", flush=True)
            continue
        rows[pruner] = {str(b): {"prefill": p, "decode": d} for b, (p, d) in counts.items()}
        step = max(counts[8][1]) if counts[8][1] else 0
        print(
            f"| {pruner} | {counts[1][0]} | {counts[4][0]} | {counts[8][0]} | {step} |", flush=True
        )
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
