"""What ``positions="compact"`` costs: POPE accuracy retention with the kept visual tokens at
their original RoPE positions and renumbered consecutively (the prompt positioned as if the
pruned tokens had never been in it, as vLLM and VisionZip serve a pruned LLaVA), measured in
the same run on the embedded organism-default, pruning at layer 0.

Every registered pruner runs except those that prune nothing here or need another model:
``guided`` (needs a guide model) and ``fixation`` (it picks visual keys per decode step, and a
POPE answer is one token). The questions, prompt and scoring are
``benchmarks/pruner_quality.py``'s (held-out scenes, random / popular / adversarial splits,
greedy, one new token); retention = pruned accuracy / unpruned accuracy, mean over the splits.

    nice -n 10 python benchmarks/compact_positions.py --images 100 --threads 1

Writes ``compact_positions.{md,json}`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
from pruner_quality import PROMPT, load, machine, mean_accuracy, question_set, run_setting

import vlm_focus as vf
from organism import default_model_path
from vlm_focus import FocusConfig
from vlm_focus.config import POSITIONS
from vlm_focus.pruners import get_pruner


def layer0_pruners() -> list[str]:
    """The registered pruners that prune a POPE prompt at layer 0 on their own."""
    return [
        name
        for name in vf.pruners()
        if not get_pruner(name).needs_guide and not get_pruner(name).decode_time
    ]


def measure(args) -> dict:
    model, processor = load(args.model)
    qset = question_set("pope", args.images)
    print(
        f"{machine()}; model {args.model.name}; {len(qset.scenes)} images, "
        f"{len(qset.keys)} distinct questions; layer 0"
    )
    base, base_hits, _ = run_setting(model, processor, qset, None, args.batch, "unpruned")
    unpruned = mean_accuracy(base)
    rows = []
    for name in args.pruners:
        for keep in args.keeps:
            row = {"pruner": name, "keep": keep}
            hits = {}
            for positions in POSITIONS:
                focus = FocusConfig(pruner=name, keep=keep, layer=0, positions=positions)
                metrics, hits[positions], seconds = run_setting(
                    model, processor, qset, focus, args.batch, f"{name} {keep} {positions}"
                )
                accuracy = mean_accuracy(metrics)
                row[positions] = dict(
                    accuracy=accuracy,
                    retention=accuracy / unpruned,
                    seconds=seconds,
                    splits=metrics,
                )
            # questions (every split's rows) that only one of the two numberings answers right
            pairs = list(zip(hits["original"], hits["compact"], strict=True))
            row["only_original"] = sum(a and not b for a, b in pairs)
            row["only_compact"] = sum(b and not a for a, b in pairs)
            rows.append(row)
            print(
                f"{name:10s} keep {keep:<5g} retention original "
                f"{100 * row['original']['retention']:.2f}% compact "
                f"{100 * row['compact']['retention']:.2f}%"
            )
    return dict(
        images=len(qset.scenes),
        questions=len(qset.keys),
        rows_answered=len(base_hits),
        unpruned=dict(accuracy=unpruned, splits=base),
        settings=rows,
    )


def write(args, result: dict, minutes: float) -> None:
    command = (
        "nice -n 10 python benchmarks/compact_positions.py "
        f"--images {args.images} --keeps {' '.join(f'{k:g}' for k in args.keeps)}"
        + (f" --pruners {' '.join(args.pruners)}" if args.pruners != layer0_pruners() else "")
        + (f" --threads {args.threads}" if args.threads else "")
    )
    config = FocusConfig()
    lines = [
        f'POPE accuracy retention with `positions="original"` (kept tokens at their original '
        f'RoPE positions) and `positions="compact"` (renumbered as if the pruned tokens had '
        f"never been in the prompt), on {args.model.name}: {result['images']} held-out images, "
        f"{result['questions']} distinct questions, 3 splits ({result['rows_answered']} question "
        f"rows); pruning at layer 0, query_rows '{config.query_rows}', reduce "
        f"'{config.reduce}'. Unpruned accuracy {100 * result['unpruned']['accuracy']:.2f}% "
        f"(mean of splits). Prompt: {PROMPT}.",
        "",
        "| pruner | keep | original | compact | compact - original | right only original "
        "/ only compact |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for row in result["settings"]:
        original, compact = row["original"], row["compact"]
        lines.append(
            f"| {row['pruner']} | {row['keep']:g} | {100 * original['retention']:.2f}% "
            f"({100 * original['accuracy']:.2f}) | {100 * compact['retention']:.2f}% "
            f"({100 * compact['accuracy']:.2f}) | "
            f"{100 * (compact['retention'] - original['retention']):+.2f} | "
            f"{row['only_original']} / {row['only_compact']} |"
        )
    lines += [
        "",
        "Cells: retention (pruned accuracy, %), mean over the three splits; the difference in "
        "retention points; the question rows only one numbering answers right. The kept set "
        "is the same under both: only the positions differ.",
        "",
        f"Command: `{command}` ({machine()}; {minutes:.1f} minutes, 1-minute load average "
        f"{args.load[0]:.1f} at the start and {args.load[1]:.1f} at the end).",
    ]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.name}.md").write_text("\n".join(lines) + "\n")
    meta = dict(
        command=command,
        machine=machine(),
        minutes=minutes,
        load_average=args.load,
        model=args.model.name,
        layer=0,
        query_rows=config.query_rows,
        reduce=config.reduce,
        keeps=args.keeps,
        pruners=args.pruners,
        prompt=PROMPT,
        **result,
    )
    (args.out / f"{args.name}.json").write_text(json.dumps(meta, indent=1))
    print("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None, help="default: organism-default")
    parser.add_argument("--images", type=int, default=100)
    parser.add_argument("--keeps", type=float, nargs="+", default=[0.25, 0.11])
    parser.add_argument(
        "--pruners", nargs="+", default=None, help="default: every pruner that runs here"
    )
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--name", default="compact_positions", help="stem of the output files")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    args.model = args.model or default_model_path()
    args.pruners = args.pruners or layer0_pruners()
    args.load = [os.getloadavg()[0]]  # other jobs on the machine slow the run, never the answers
    started = time.perf_counter()
    result = measure(args)
    args.load.append(os.getloadavg()[0])
    write(args, result, (time.perf_counter() - started) / 60)


if __name__ == "__main__":
    main()
