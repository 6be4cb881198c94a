"""Caption quality of decode-time fixation against static prefill pruning, on the organism.

The caption task ("Describe the image.") names several objects in turn, so each decoding step
looks at a different object. Every setting runs through ``vlm-focus eval chair`` on the same
held-out images (greedy, 64 new tokens): unpruned; ``fixation`` at keep 0.05 / 0.1 / 0.2; and
``fastv`` and ``random``, which prune once in prefill, at the same ratios and the same layer.
Object precision = 1 - CHAIR_i; recall = ground-truth objects named. One caption's fixation
path is drawn as a frame strip (one panel per decoding step).

    python benchmarks/fixation_quality.py [--limit 300] [--layer 1]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from vlm_focus.eval.cli import main as eval_main

KEEPS = (0.05, 0.1, 0.2)


def run(out: Path, limit: int, args: list[str]) -> dict:
    eval_main(["chair", "--limit", str(limit), "--threads", "1", "--out", str(out), *args])
    results = sorted((out / "chair" / "embedded").glob("*.json"))
    tag = "unpruned" if not args else f"{args[1]}-k{args[3]}-l{args[5]}"
    (result,) = [r for r in results if r.name == f"{tag}.json"]
    return json.loads(result.read_text())


def fixation_strip(path: Path, layer: int, keep: float) -> dict:
    """One held-out caption generated with fixation; its per-step fixations drawn on the
    image's 12 x 12 grid, one panel per step, the token written under each panel."""
    import matplotlib.pyplot as plt
    from PIL import Image

    import vlm_focus as vf
    from organism import sample_scene_paths
    from organism.vocab import CAPTION_PROMPT
    from vlm_focus.loading import build_inputs, decode_new_tokens, load_model

    model, processor = load_model()
    scene = sample_scene_paths()[0]
    image = Image.open(scene).convert("RGB")
    inputs = build_inputs(processor, image, CAPTION_PROMPT)
    with torch.no_grad(), vf.wrap(model, pruner="fixation", keep=keep, layer=layer) as handle:
        out = model.generate(**inputs, max_new_tokens=12, do_sample=False)
        trace = handle.last_trace
    tokens = processor.tokenizer.convert_ids_to_tokens(out[0, inputs["input_ids"].shape[1] :])
    start = int(trace.visual_positions[0][0])
    steps = trace.fixations
    fig, axes = plt.subplots(1, len(steps), figsize=(1.6 * len(steps), 2.0))
    for t, ax in enumerate(axes):
        grid = torch.zeros(144)
        grid[steps[t][0] - start] = 1.0
        ax.imshow(image.resize((96, 96)))
        ax.imshow(grid.view(12, 12), extent=(0, 96, 96, 0), alpha=0.55, cmap="magma")
        ax.set_title(tokens[t + 1], fontsize=7)  # the token this step produced
        ax.axis("off")
    fig.suptitle(
        f"fixation keep {keep} at layer {layer}: {decode_new_tokens(processor, inputs, out)[0]}",
        fontsize=8,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return {"scene": Path(scene).name, "tokens": tokens, "steps": len(steps)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--limit", type=int, default=300)
    parser.add_argument("--layer", type=int, default=1)
    parser.add_argument("--work", type=Path, default=Path("/tmp/vlm_focus_fixation_quality"))
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = [("unpruned", None, run(args.work, args.limit, []))]
    for pruner in ("fixation", "fastv", "random"):
        for keep in KEEPS:
            options = ["--pruner", pruner, "--keep", str(keep), "--layer", str(args.layer)]
            rows.append((pruner, keep, run(args.work, args.limit, options)))
    base_recall = rows[0][2]["recall"]
    lines = [
        f"Captions on {rows[0][2]['n']} held-out organism images (`vlm-focus eval chair`, greedy, "
        f"64 new tokens), pruning at layer {args.layer}.",
        "",
        "| setting | keep | object precision | recall | recall kept | CHAIR_s | length |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for pruner, keep, r in rows:
        lines.append(
            f"| {pruner} | {keep if keep is not None else 1.0} | {1 - r['CHAIR_i']:.3f} | "
            f"{r['recall']:.3f} | {r['recall'] / base_recall:.1%} | {r['CHAIR_s']:.3f} | "
            f"{r['length']:.1f} |"
        )
    strip = fixation_strip(args.out / "fixation_path.png", args.layer, 0.1)
    lines += ["", f"Fixation path (keep 0.1): `fixation_path.png`, scene {strip['scene']}."]
    text = "\n".join(lines)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "fixation_quality.md").write_text(text + "\n")
    summary = [
        {
            "pruner": p,
            "keep": k,
            **{m: r[m] for m in ("CHAIR_i", "CHAIR_s", "recall", "length", "n")},
        }
        for p, k, r in rows
    ]
    (args.out / "fixation_quality.json").write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
