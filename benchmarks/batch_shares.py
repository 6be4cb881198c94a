"""A batch of images of different sizes: what each row keeps, and the prefill time, under the
per-row rule (each row keeps its own share, masking the rest of it as keys in the slots the
batch keeps) against the common rule (every row drops what the row with the fewest visual
tokens drops, which static caches still use).

Model: the random-weight Qwen2.5-VL architecture of ``fixation_decode.py`` (text: hidden 512,
8 layers). One batch of three left-padded rows, one image each, of ``--tokens`` merged visual
tokens (default 49/28/50, as three small photos give, and 4x that). fastv, keep 0.25, K = 2.
Prefill forwards alternate in pairs (ABBA, ``vlm_focus.timing.alternate``): per-row against
unpruned and against the common rule, each ratio the median pair's.

    python benchmarks/batch_shares.py [--pairs 5]

Writes ``results/batch_shares.json`` and ``results/batch_shares.md``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from fixation_decode import END, IMAGE, START, build_model
from prefill import machine

import vlm_focus as vf
from vlm_focus.core.prefill import PrefillPass
from vlm_focus.timing import alternate

RESULTS = Path(__file__).parent / "results"
SETTING = dict(pruner="fastv", keep=0.25, layer=2)


def grid_for(n: int) -> tuple[int, int, int]:
    rows = int(n**0.5)
    while n % rows:
        rows -= 1
    return (1, 2 * rows, 2 * (n // rows))


def batch_inputs(counts: list[int]) -> dict:
    gen = torch.Generator().manual_seed(0)
    rows, grids = [], []
    for n in counts:
        text = torch.randint(2, 30000, (40,), generator=gen).tolist()
        rows.append(text[:20] + [START] + [IMAGE] * n + [END] + text[20:])
        grids.append(grid_for(n))
    width = max(map(len, rows))
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, row in enumerate(rows):
        ids[b, width - len(row) :] = torch.tensor(row)
        mask[b, width - len(row) :] = 1
    patches = sum(g[1] * g[2] for g in grids)
    return {
        "input_ids": ids,
        "attention_mask": mask,
        "mm_token_type_ids": (ids == IMAGE).long(),
        "pixel_values": torch.randn(patches, 3 * 2 * 14 * 14, generator=gen),
        "image_grid_thw": torch.tensor(grids),
    }


class CommonRule:
    """``vf.wrap`` with the common rule forced (what a static cache runs)."""

    def __init__(self, model) -> None:
        self.model = model

    def __enter__(self):
        self.saved = PrefillPass._per_row_shares
        PrefillPass._per_row_shares = lambda prefill, cache: False
        self.handle = vf.wrap(self.model, **SETTING)
        return self.handle

    def __exit__(self, *exc) -> None:
        self.handle.remove()
        PrefillPass._per_row_shares = self.saved


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokens", nargs="+", default=["49,28,50", "196,112,200"])
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = build_model().eval()
    rows = []
    print(machine())
    for spec in args.tokens:
        counts = [int(n) for n in spec.split(",")]
        inputs = batch_inputs(counts)

        def forward(inputs: dict = inputs) -> None:
            with torch.inference_mode():
                model(**inputs, use_cache=True, logits_to_keep=1)

        def timed(context) -> float:
            with context:
                start = time.perf_counter()
                forward()
                return time.perf_counter() - start

        with vf.wrap(model, **SETTING) as handle:
            forward()
        per_row_kept = handle.last_trace.n_kept
        with CommonRule(model) as handle:
            forward()
        common_kept = handle.last_trace.n_kept
        alone = []
        for b in range(len(counts)):
            with vf.wrap(model, **SETTING) as handle:
                with torch.inference_mode():
                    model(**batch_inputs([counts[b]]), use_cache=True, logits_to_keep=1)
            alone += handle.last_trace.n_kept

        def unpruned() -> float:
            start = time.perf_counter()
            forward()
            return time.perf_counter() - start

        def per_row() -> float:
            return timed(vf.wrap(model, **SETTING))

        def common() -> float:
            return timed(CommonRule(model))

        vs_unpruned = alternate(unpruned, per_row, repeats=args.pairs, warmup=1)
        vs_common = alternate(common, per_row, repeats=args.pairs, warmup=1)
        row = {
            "visual": counts,
            "alone_kept": alone,
            "per_row_kept": per_row_kept,
            "common_kept": common_kept,
            "per_row_speedup_vs_unpruned": vs_unpruned.ratio,
            "per_row_vs_common": vs_common.ratio,
            "per_row_vs_common_range": [vs_common.low, vs_common.high],
        }
        rows.append(row)
        print(json.dumps(row))
    out = {"machine": machine(), "setting": SETTING, "pairs": args.pairs, "rows": rows}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "batch_shares.json").write_text(json.dumps(out, indent=2) + "\n")
    lines = [
        "# A batch of images of different sizes: kept counts and prefill time",
        "",
        f"Machine: {machine()}. fastv, keep 0.25, K = 2; Qwen2.5-VL architecture, hidden 512, "
        f"8 layers; {args.pairs} pairs per ratio (ABBA, median pair). "
        "Command: `python benchmarks/batch_shares.py`.",
        "",
        "| visual tokens | alone keeps | per-row rule keeps | common rule keeps | "
        "per-row speed-up vs unpruned | per-row time / common time |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        low, high = r["per_row_vs_common_range"]
        lines.append(
            f"| {r['visual']} | {r['alone_kept']} | {r['per_row_kept']} | {r['common_kept']} | "
            f"{r['per_row_speedup_vs_unpruned']:.2f}x | {1 / r['per_row_vs_common']:.2f} "
            f"({1 / high:.2f}-{1 / low:.2f}) |"
        )
    (RESULTS / "batch_shares.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
