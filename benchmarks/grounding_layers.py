"""Which decoder layers make the best grounding maps: the pointing game per layer window on the
embedded organisms, chosen on calibration scenes and reported on held-out ones.

For each model and each contiguous window of decoder layers ``[a, b]`` the map of the queried
category's token averages the window's layers (and every head); a hit when its peak
(``grounding.point``) lies inside the queried object's box. The window with the best pointing
on the calibration scenes (seeds from ``CALIBRATION_SEED_BASE``, fewest layers on a tie) is the
model's measured choice (``config.json``'s ``vlm_focus_grounding.layers``); its held-out
pointing is reported beside every layer, every window, all layers and the rule for models
without a stored choice (``grounding.rule_layers``). The held-out scenes are also shown
stretched to twice their width (objects inside the part the processor keeps).

    python benchmarks/grounding_layers.py                    # organism-default, -deep, -guide
    python benchmarks/grounding_layers.py --calibration 60 --images 100 --threads 2
    python benchmarks/grounding_layers.py --smoke            # tiny random model: runs, no meaning
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch
from grounding_quality import CALIBRATION_SEED_BASE, _progress, batches, inside
from PIL import Image

from organism.scenes import CATEGORIES, generate_scene, heldout_scenes
from organism.vocab import presence_question
from vlm_focus import grounding as G
from vlm_focus.asset_paths import deep_model_path, default_model_path, guide_model_path
from vlm_focus.geometry import Size
from vlm_focus.loading import build_inputs, load_model

MODELS = {
    "organism-default": default_model_path,
    "organism-deep": deep_model_path,
    "organism-guide": guide_model_path,
}
WIDEN = 2  # the widened photos: each scene stretched to WIDEN times its width


def calibration_scenes(n: int) -> list:
    """``n`` scenes with at least two objects, seeds from ``CALIBRATION_SEED_BASE`` (neither
    training nor held out)."""
    scenes, seed = [], CALIBRATION_SEED_BASE
    while len(scenes) < n:
        s = generate_scene(seed)
        seed += 1
        if len(s.objects) >= 2:
            scenes.append(s)
    return scenes


def present_queries(scenes, widen: int = 1) -> list[tuple]:
    """``(scene, category, picture, target box)`` for every present object; with ``widen``, the
    scene stretched to ``widen`` times its width and only the objects wholly inside the central
    square the organism's processor keeps."""
    out = []
    for s in scenes:
        picture = Image.fromarray(s.image())
        if widen != 1:
            picture = picture.resize((s.size * widen, s.size), Image.Resampling.BICUBIC)
        lo, hi = (s.size * widen - s.size) / 2, (s.size * widen + s.size) / 2
        for obj in s.objects:
            x, y, w, h = obj.box(s.size)
            box = (x * widen, y, w * widen, h)
            if box[0] >= lo and box[0] + box[2] <= hi:
                out.append((s, obj.category, picture, box))
    return out


def windows(n_layers: int) -> list[tuple[int, int]]:
    return [(a, b) for a in range(n_layers) for b in range(a, n_layers)]


def window_name(window: tuple[int, int]) -> str:
    a, b = window
    return str(a) if a == b else f"{a}-{b}"


def layer_maps(model, processor, queries, n_layers: int, batch: int, desc: str) -> list[list]:
    """Per query, one :class:`HeatMap` per decoder layer (head mean) of the category's token."""
    out = []
    for sl in _progress(list(batches(len(queries), batch)), desc):
        chunk = queries[sl]
        names = [CATEGORIES[q[1]] for q in chunk]
        pictures = [q[2] for q in chunk]
        inputs = build_inputs(processor, pictures, [presence_question(n) for n in names])
        per_layer = []
        for layer in range(n_layers):
            gp = G.GroundingPass(model, inputs, processor=processor, images=pictures,
                                 layers=[layer])  # fmt: skip
            per_layer.append([gp.map(n, row=b, source="prompt") for b, n in enumerate(names)])
        out += [[per_layer[layer][b] for layer in range(n_layers)] for b in range(len(chunk))]
    return out


def window_map(maps: list, window: tuple[int, int]):
    """The window's map: the mean of its layers' maps (a map is linear in the layers it
    averages: every (layer, head) pair weighs the same)."""
    a, b = window
    chosen = maps[a : b + 1]
    views = [torch.stack([m.views[v] for m in chosen]).mean(0) for v in range(len(chosen[0].views))]
    grid = torch.stack([m.grid for m in chosen]).mean(0)
    return dataclasses.replace(chosen[0], grid=grid, views=views, _pixels=None)


def pointing(queries, maps, window) -> float:
    hits = [
        inside(G.point(window_map(m, window)), q[3]) for q, m in zip(queries, maps, strict=True)
    ]
    return float(np.mean(hits)) if hits else float("nan")


def measure(name: str, model, processor, args) -> dict:
    n_layers = len(model.model.language_model.layers)
    cal = present_queries(calibration_scenes(args.calibration))
    held = present_queries(heldout_scenes(args.images))
    wide = present_queries(heldout_scenes(args.images), widen=WIDEN)
    cal_maps = layer_maps(model, processor, cal, n_layers, args.batch, f"{name} calibration")
    held_maps = layer_maps(model, processor, held, n_layers, args.batch, f"{name} held-out")
    wide_maps = layer_maps(model, processor, wide, n_layers, args.batch, f"{name} widened")
    rows = []
    for w in windows(n_layers):
        rows.append(
            {
                "layers": window_name(w),
                "window": list(w),
                "calibration": pointing(cal, cal_maps, w),
                "heldout": pointing(held, held_maps, w),
                "widened": pointing(wide, wide_maps, w),
            }
        )
    best = max(rows, key=lambda r: (r["calibration"], -(r["window"][1] - r["window"][0]),
                                    -r["window"][0]))  # fmt: skip
    rule = G.rule_layers(n_layers)
    by_name = {r["layers"]: r for r in rows}
    return {
        "model": name,
        "n_layers": n_layers,
        "n_calibration_queries": len(cal),
        "n_heldout_queries": len(held),
        "n_widened_queries": len(wide),
        "chosen": best["layers"],
        "chosen_layers": list(range(best["window"][0], best["window"][1] + 1)),
        "rule_layers": rule,
        "rule": by_name[window_name((rule[0], rule[-1]))],
        "all_layers": by_name[window_name((0, n_layers - 1))],
        "best": best,
        "windows": rows,
    }


def write_report(report: dict, out: Path) -> None:
    lines = [
        "# Grounding layers: pointing game per layer window on the organisms",
        "",
        f"Machine: {report['machine']}. torch {report['torch']}, transformers "
        f"{report['transformers']}. Run took {report['seconds']:.0f} s.",
        "",
        f"Command: `{report['command']}`",
        "",
        "Query: the category's token in `Is there a {category} in the image?` (chat template), "
        "every present object. Map: mean attention of that token over the window's layers and "
        "every head (`grounding.GroundingPass(layers=...)`); a hit when `grounding.point` lies "
        f"inside the object's box. Calibration scenes: seeds from {CALIBRATION_SEED_BASE} "
        f"(>= 2 objects); held-out: the first {report['images']} held-out scenes (seeds from "
        f"9000000). Widened: the held-out scenes stretched to {WIDEN}:1; the processor keeps "
        "the central square, so only the objects wholly inside it are asked about. The chosen "
        "window is the best on calibration (fewest layers on a tie); the rule for models "
        f"without a stored choice is layers [0, ceil({G.LAYER_SHARE} * n_layers)).",
        "",
        "| model | layers | queries (cal / held-out / widened) | chosen on calibration | "
        "held-out | widened | all layers held-out | all layers widened | rule | rule held-out |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for m in report["models"]:
        lines.append(
            f"| {m['model']} | {m['n_layers']} | {m['n_calibration_queries']} / "
            f"{m['n_heldout_queries']} / {m['n_widened_queries']} | {m['chosen']} | "
            f"{m['best']['heldout']:.3f} | {m['best']['widened']:.3f} | "
            f"{m['all_layers']['heldout']:.3f} | {m['all_layers']['widened']:.3f} | "
            f"{m['rule']['layers']} | {m['rule']['heldout']:.3f} |"
        )
    for m in report["models"]:
        lines += [
            "",
            f"## {m['model']} ({m['n_layers']} layers): every window",
            "",
            "| layers | calibration | held-out | widened |",
            "|---|---|---|---|",
        ]
        for r in m["windows"]:
            mark = " (chosen)" if r["layers"] == m["chosen"] else ""
            lines.append(
                f"| {r['layers']}{mark} | {r['calibration']:.3f} | {r['heldout']:.3f} | "
                f"{r['widened']:.3f} |"
            )
    lines.append("")
    (out / "grounding_layers.md").write_text("\n".join(lines))


def organism_parser(doc: str) -> argparse.ArgumentParser:
    """The options the organism grounding benchmarks share."""
    parser = argparse.ArgumentParser(description=doc.split("\n")[0])
    parser.add_argument("--models", default=",".join(MODELS), help="comma list of organisms")
    parser.add_argument("--calibration", type=int, default=60, help="calibration scenes")
    parser.add_argument("--images", type=int, default=100, help="held-out scenes")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    parser.add_argument("--smoke", action="store_true", help="random tiny model, tiny sizes")
    return parser


def load_organisms(parser: argparse.ArgumentParser, args, name: str) -> tuple[dict, Path]:
    """``({model name: (model, processor)}, output folder)``: the ``--models`` organisms, or a
    random tiny model and a temporary folder with ``--smoke``."""
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    if args.smoke:
        import tempfile

        from transformers import LlavaForConditionalGeneration

        from organism.vocab import SPECS, build_config, build_processor

        args.calibration, args.images = 3, 3
        model = LlavaForConditionalGeneration(build_config(SPECS["tiny"])).eval()
        out = Path(tempfile.mkdtemp(prefix=f"{name}_smoke_"))
        return {"random tiny": (model, build_processor(SPECS["tiny"]))}, out
    loaded = {}
    for model_name in args.models.split(","):
        if model_name not in MODELS:
            parser.error(f"--models: {model_name!r}; allowed: {', '.join(MODELS)}")
        loaded[model_name] = load_model(str(MODELS[model_name]()), dtype=torch.float32)
    args.out.mkdir(parents=True, exist_ok=True)
    return loaded, args.out


def run_header(name: str, argv: list[str] | None, start: float) -> dict:
    """The machine, versions, command and seconds every report starts with."""
    import transformers

    return {
        "machine": f"{platform.machine()} ({torch.get_num_threads()} threads), CPU",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "command": f"python benchmarks/{name}.py "
        + " ".join(argv if argv is not None else sys.argv[1:]),
        "seconds": time.time() - start,
    }


def main(argv: list[str] | None = None) -> int:
    parser = organism_parser(__doc__)
    parser.add_argument("--batch", type=int, default=32)
    args = parser.parse_args(argv)
    start = time.time()
    loaded, out = load_organisms(parser, args, "grounding_layers")
    results = [measure(name, m, p, args) for name, (m, p) in loaded.items()]
    report = {
        **run_header("grounding_layers", argv, start),
        "calibration": args.calibration,
        "images": args.images,
        "image_size": Size(192, 192)._asdict(),
        "models": results,
    }
    write_report(report, out)
    (out / "grounding_layers.json").write_text(json.dumps(report, indent=1))
    print((out / "grounding_layers.md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
