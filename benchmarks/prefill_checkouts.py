"""Prefill time of two checkouts of vlm_focus, interleaved, on the model of ``prefill.py``.

A refactor must not slow the hot path. This runs each checkout's ``vlm_focus`` in its own
process, alternating ``A B A B ...`` so that both see the same machine load, and reports per
checkout the median prefill seconds unpruned and with fastv at K = 2 (keep 0.5 / 0.25 / 0.11),
the speed-up of each, and the pruned time of B relative to A. The model and inputs come from
this tree's ``benchmarks/prefill.py``.

    python benchmarks/prefill_checkouts.py A_DIR B_DIR [--rounds 3] [--repeats 7] [--threads 2]

(``git worktree add /tmp/before REV`` gives a checkout of an older revision.)
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
KEEPS = (0.5, 0.25, 0.11)

CHILD = """
import json, statistics, sys, time
sys.path[:0] = [{checkout!r}, {benchmarks!r}]
import torch
torch.set_num_threads({threads})
import vlm_focus as vf
from prefill import build_inputs, build_model
model, inputs = build_model(), build_inputs()
def once():
    with torch.no_grad():
        start = time.perf_counter()
        model(**inputs)
        return time.perf_counter() - start
def median():
    once()  # warm-up
    return statistics.median(once() for _ in range({repeats}))
out = {{"package": vf.__file__, "unpruned": median()}}
for keep in {keeps!r}:
    with vf.wrap(model, pruner="fastv", keep=keep, layer=2):
        out[str(keep)] = median()
print(json.dumps(out))
"""


def run(checkout: Path, repeats: int, threads: int) -> dict:
    code = CHILD.format(
        checkout=str(checkout),
        benchmarks=str(HERE),
        threads=threads,
        repeats=repeats,
        keeps=KEEPS,
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{checkout}: {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("a", type=Path, help="first checkout (e.g. the revision before)")
    parser.add_argument("b", type=Path, help="second checkout (e.g. this one)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    runs: dict[str, list[dict]] = {"A": [], "B": []}
    for _ in range(args.rounds):
        for name, checkout in (("A", args.a), ("B", args.b)):
            runs[name].append(run(checkout.resolve(), args.repeats, args.threads))
    medians = {
        name: {k: statistics.median(r[k] for r in rows) for k in rows[0] if k != "package"}
        for name, rows in runs.items()
    }
    print(f"A = {runs['A'][0]['package']}\nB = {runs['B'][0]['package']}")
    print("| setting | A s | B s | A speed-up | B speed-up | B / A |")
    print("|---|---:|---:|---:|---:|---:|")
    for key in ["unpruned", *map(str, KEEPS)]:
        a, b = medians["A"][key], medians["B"][key]
        up_a, up_b = medians["A"]["unpruned"] / a, medians["B"]["unpruned"] / b
        print(f"| {key} | {a:.3f} | {b:.3f} | {up_a:.2f}x | {up_b:.2f}x | {b / a:.3f} |")


if __name__ == "__main__":
    main()
