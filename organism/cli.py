"""`python -m organism train|eval|ship|scenes` (from the repository root): retrain, re-measure and
ship the organism models of either architecture."""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m organism", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="train one organism model from scratch")
    t.add_argument(
        "--model",
        choices=[
            "default",
            "guide",
            "deep",
            "twohop-guide",
            "tiny",
            "cooccur",
            "prior",
            "qwen",
            "qwen35",
        ],
        default="default",
        help="cooccur fine-tunes the shipped guide on a co-occurrence prior; prior fine-tunes the "
        "shipped deep model on text under one, then images; qwen is a Qwen2.5-VL, qwen35 a "
        "Qwen3.5 (hybrid Gated-DeltaNet decoder)",
    )
    t.add_argument("--out", type=Path, required=True, help="output folder (HF format)")
    t.add_argument("--scale", type=float, default=1.0, help="multiply steps and minutes")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument(
        "--vision-from",
        type=Path,
        default=None,
        help="qwen, qwen35: the vision.pt of an earlier run; its tower replaces the vision stage",
    )
    t.add_argument("--threads", type=int, default=2)
    e = sub.add_parser("eval", help="measure a model on the held-out set")
    e.add_argument(
        "--path", type=Path, default=None, help="model folder (default: shipped default)"
    )
    e.add_argument("--out", type=Path, default=None, help="write metrics json here")
    e.add_argument("--images", type=int, default=500, help="held-out images for POPE")
    e.add_argument("--only", nargs="*", default=None, help="subset of measurements to run")
    e.add_argument("--threads", type=int, default=2)
    s = sub.add_parser("scenes", help="write held-out scenes as PNG + COCO json + POPE files")
    s.add_argument("--out", type=Path, required=True)
    s.add_argument("--n", type=int, default=500)
    s.add_argument("--no-images", action="store_true")
    h = sub.add_parser("ship", help="copy a trained model + metrics into vlm_focus/assets")
    h.add_argument("--path", type=Path, required=True, help="trained model folder")
    h.add_argument(
        "--name",
        choices=["default", "guide", "deep", "twohop-guide", "cooccur", "prior", "qwen", "qwen35"],
        required=True,
    )
    h.add_argument("--metrics", type=Path, required=True, help="metrics json from `eval`")
    h.add_argument("--heldout", action="store_true", help="also write assets/heldout + samples")
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns a process exit code."""
    args = _parser().parse_args(argv)
    import torch

    if args.command == "train":
        from .loop import train
        from .recipe import default_recipe

        torch.set_num_threads(args.threads)
        recipe = default_recipe(args.model, scale=args.scale)
        recipe.seed = args.seed
        if args.vision_from is not None:
            if not hasattr(recipe, "vision_from"):
                raise SystemExit(
                    f"--vision-from: the {args.model} recipe has no vision stage to skip"
                )
            if not args.vision_from.is_file():
                raise SystemExit(f"--vision-from: no file {args.vision_from}")
            recipe.vision_from = str(args.vision_from)
        summary = train(recipe, args.out)
        if "minutes_total" not in summary:  # organism-qwen's summary counts seconds
            summary["minutes_total"] = round(summary["seconds"] / 60, 1)
        print(json.dumps({"minutes_total": summary["minutes_total"]}))
        return 0
    if args.command == "eval":
        from vlm_focus.asset_paths import default_model_path

        from .architectures import saved_architecture

        torch.set_num_threads(args.threads)
        path = args.path or default_model_path()
        arch = saved_architecture(path)
        n_images = min(args.images, arch.pope_images)
        metrics = arch.part("evaluate")(path, n_images=n_images, only=args.only)
        text = json.dumps(metrics, indent=1)
        if args.out:
            args.out.write_text(text)
        print(text)
        return 0
    if args.command == "ship":
        from .export import ship, ship_heldout

        dest = ship(args.path, args.name, json.loads(args.metrics.read_text()))
        if args.heldout:
            ship_heldout()
        print(dest)
        return 0
    if args.command == "scenes":
        from .pope import write_heldout

        write_heldout(args.out, n=args.n, images=not args.no_images)
        return 0
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
