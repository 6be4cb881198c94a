"""``python -m vlm_focus.zoom calibrate``: the adaptive-zoom threshold from held-out questions.

    python -m vlm_focus.zoom calibrate --questions pope_random.jsonl --image-dir DIR \\
        --recall 0.9 --statistic top1 --out calibration.json

Question files are JSONL rows with ``image`` (a file name under ``--image-dir``), ``text`` (the
question) and ``label`` (the reference answer), as the POPE files are. A row is a hard case when
the plain answer's first word differs from the label's (:func:`vlm_focus.zoom.answers_match`).
``--statistic`` picks the routing statistic (:data:`vlm_focus.zoom.STATISTICS`): a first-token
confidence, or an attention-map statistic read with the zoom's default map (every layer, the
question's content words); the latter calibrates on the images the zoom can crop only.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from ..core.options import add_options
from ._calibrate import calibrate_model
from ._options import ZoomOptions


def _read(path: Path, image_dir: Path, limit: int | None) -> tuple[list, list, list]:
    images, questions, labels = [], [], []
    for n, line in enumerate(path.read_text().splitlines()):
        if not line.strip():
            continue
        row = json.loads(line)
        missing = [k for k in ("image", "text", "label") if k not in row]
        if missing:
            raise ValueError(f"{path}:{n + 1}: the row lacks {missing}")
        images.append(image_dir / row["image"])
        questions.append(row["text"])
        labels.append(str(row["label"]))
        if limit is not None and len(questions) >= limit:
            break
    if not questions:
        raise ValueError(f"{path} holds no questions")
    return images, questions, labels


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m vlm_focus.zoom",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)
    cal = sub.add_parser("calibrate", help="conformal routing threshold from held-out questions")
    cal.add_argument("--questions", type=Path, required=True, help="JSONL: image, text, label")
    cal.add_argument("--image-dir", type=Path, required=True, help="folder of the images")
    cal.add_argument("--model", default=None, help="path or hub id (default: the embedded one)")
    cal.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    cal.add_argument("--recall", type=float, default=0.9, help="share of hard cases to route")
    # the routing statistic and the answer length as the zoom's options table has them
    shared = ("statistic", "max_new_tokens")
    others = [f.name for f in dataclasses.fields(ZoomOptions) if f.name not in shared]
    add_options(cal, ZoomOptions, exclude=others, defaults=True)
    cal.add_argument("--limit", type=int, default=None, help="use the first N questions")
    cal.add_argument("--batch-size", type=int, default=8)
    cal.add_argument("--out", type=Path, default=None, help="write the calibration JSON here")
    args = parser.parse_args(argv)

    from ..loading import load_model, resolve_device

    images, questions, labels = _read(args.questions, args.image_dir, args.limit)
    model, processor = load_model(args.model, device=resolve_device(args.device))
    calibration, records = calibrate_model(
        model,
        processor,
        images,
        questions,
        labels,
        recall=args.recall,
        statistic=args.statistic,
        batch_size=args.batch_size,
        max_new_tokens=args.max_new_tokens,
    )
    text = json.dumps(calibration.to_json(), indent=1)
    if args.out is not None:
        calibration.save(args.out)
    print(text)
    print(
        f"threshold {calibration.threshold:.6g}: routes {calibration.routed:.1%} of "
        f"{calibration.n} questions and {calibration.hard_routed:.1%} of {calibration.n_hard} "
        f"hard ones (target {calibration.recall:.0%})",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
