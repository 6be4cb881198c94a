"""One fine-tuning step (forward with labels, backward, AdamW update), pruned against unpruned.

Model: the random-weight LLaVA architecture of ``prefill.py`` (text: hidden 1024, 8 layers, MLP
2816; one image of 576 visual tokens), in training mode. Labels cover the instruction after the
image (the prompt and the image are -100, as in LLaVA's fine-tuning data), so the pruned loss
equals the masked reference's (``tests/test_transformers_contracts.py``). Unpruned and pruned
steps alternate in pairs (ABBA, ``vlm_focus.timing.alternate``); each ratio is the median
pair's, with the pairs' min-max, beside the forward FLOPs bound of ``prefill.py``.

    python benchmarks/training_step.py [--settings 0:0.25 2:0.25 2:0.5] [--pairs 5]

Writes ``results/training_step.json`` and ``results/training_step.md``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from prefill import PROMPT_TEXT, build_inputs, build_model, flops_bound, machine

import vlm_focus as vf
from vlm_focus.timing import alternate

RESULTS = Path(__file__).parent / "results"


def training_step(model: torch.nn.Module, optimizer, inputs: dict, labels: torch.Tensor):
    def run() -> float:
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        loss = model(**inputs, labels=labels).loss
        loss.backward()
        optimizer.step()
        return time.perf_counter() - start

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--settings", nargs="+", default=["0:0.25", "2:0.25", "2:0.5"])
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = build_model().train()
    inputs = build_inputs(576)
    labels = torch.full_like(inputs["input_ids"], -100)
    answer = PROMPT_TEXT - PROMPT_TEXT // 2  # the text after the image
    labels[:, -answer:] = inputs["input_ids"][:, -answer:]
    # A step changes the weights: both sides step from the same copy (a tiny lr keeps the
    # model where it was; only the time is measured).
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-9)
    step = training_step(model, optimizer, inputs, labels)
    seq = inputs["input_ids"].shape[1]
    rows = []
    print(machine())
    for setting in args.settings:
        layer, keep = setting.split(":")
        layer, keep = int(layer), float(keep)

        def pruned(layer=layer, keep=keep) -> float:
            with vf.wrap(model, pruner="fastv", keep=keep, layer=layer):
                return step()

        timing = alternate(step, pruned, repeats=args.pairs, warmup=1)
        row = {
            "layer": layer,
            "keep": keep,
            "visual": 576,
            "sequence": seq,
            "unpruned_s": timing.base_seconds,
            "pruned_s": timing.other_seconds,
            "speedup": timing.ratio,
            "low": timing.low,
            "high": timing.high,
            "forward_flops_bound": flops_bound(seq, 576, keep, layer),
        }
        rows.append(row)
        print(
            f"K={layer} keep={keep}: {timing.ratio:.2f}x "
            f"({timing.low:.2f}-{timing.high:.2f}), forward FLOPs bound "
            f"{row['forward_flops_bound']:.2f}x"
        )
    RESULTS.mkdir(exist_ok=True)
    out = {"machine": machine(), "pairs": args.pairs, "rows": rows}
    (RESULTS / "training_step.json").write_text(json.dumps(out, indent=2) + "\n")
    lines = [
        "# Training step, pruned vs unpruned (fastv; forward + backward + AdamW)",
        "",
        f"Machine: {machine()}. {args.pairs} pairs per row (ABBA); the ratio is the median "
        "pair's, min-max in brackets. Command: `python benchmarks/training_step.py`.",
        "",
        "| layer K | keep | unpruned s | pruned s | speed-up | pairs min-max | FLOPs bound |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['layer']} | {r['keep']} | {r['unpruned_s']:.3f} | {r['pruned_s']:.3f} | "
            f"{r['speedup']:.2f}x | {r['low']:.2f}-{r['high']:.2f} | "
            f"{r['forward_flops_bound']:.2f}x |"
        )
    (RESULTS / "training_step.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
