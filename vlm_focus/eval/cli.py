"""``vlm-focus eval pope|coco|chair``: the evaluation commands.

Without ``--model`` and data paths, each command runs the embedded organism model on its
held-out scenes (written from their seeds under ``--out``). Every command is resumable (re-run
it to continue), runs data-parallel under ``accelerate launch``, and writes its choices
(prompt, parsing rule, decoding) next to the numbers.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

from .generation import MITIGATIONS


def _keep(text: str) -> float | int:
    value = float(text)
    return int(value) if value > 1 or (value == 1 and "." not in text) else value


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="model path or hub id (default: embedded)")
    p.add_argument("--device", default=None, help="default: this process's accelerate device")
    p.add_argument("--attn", default="sdpa", choices=["sdpa", "eager", "flash_attention_2"])
    p.add_argument("--trust-remote-code", action="store_true", help="allow model repo code")
    p.add_argument("--out", type=Path, default=Path("vlm_focus_eval"), help="output folder")
    p.add_argument("--images", type=Path, default=None, help="image folder (COCO val2014)")
    p.add_argument("--instances", type=Path, default=None, help="COCO instances json")
    p.add_argument(
        "--limit",
        type=int,
        default=None,
        help="quick check: only the first N questions per split (pope) or N images (coco, chair)",
    )
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument(
        "--on-missing",
        choices=["skip", "stop"],
        default="skip",
        help="an item whose image file is missing: skip and count it, or stop",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads per process")


def _pruning(p: argparse.ArgumentParser) -> None:
    p.add_argument("--pruner", default=None, help="registered pruner (default: none)")
    p.add_argument("--keep", type=_keep, default=0.25, help="ratio in (0, 1] or a count")
    p.add_argument("--layer", type=int, default=2, help="prune after this many decoder layers")
    p.add_argument("--query", default="last", choices=["last", "text"], help="pruner score rows")
    p.add_argument("--mitigate", default="none", choices=MITIGATIONS)
    p.add_argument("--guide", default=None, help="guide model for --pruner guided")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="vlm-focus eval", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    pope = sub.add_parser("pope", help="POPE object-presence yes/no questions")
    _common(pope)
    _pruning(pope)
    pope.add_argument("--split", default="all", choices=["all", "random", "popular", "adversarial"])
    pope.add_argument(
        "--questions",
        type=Path,
        nargs="+",
        default=None,
        help="existing POPE jsonl files (split = the name's random/popular/adversarial part)",
    )
    pope.add_argument("--n-images", type=int, default=500, help="POPE images to sample")
    pope.add_argument("--suffix", default=None, help="prompt suffix (default: LLaVA's)")
    pope.add_argument("--max-new-tokens", type=int, default=16)
    pope.add_argument("--sweep", default=None, help="e.g. keep=1.0,0.5,0.25,0.11")
    pope.add_argument("--pruners", default=None, help="comma list for --sweep, or 'all'")
    coco = sub.add_parser("coco", help="attention grounding: boxes (COCO AP), pointing, AUROC")
    _common(coco)
    coco.add_argument("--n-images", type=int, default=500)
    coco.add_argument("--absent", type=int, default=3, help="absent categories asked per image")
    coco.add_argument("--max-boxes", type=int, default=1, help="boxes kept per query")
    coco.add_argument("--prompt", default=None, help="template with {category} (default: POPE's)")
    chair = sub.add_parser("chair", help="CHAIR caption hallucination")
    _common(chair)
    _pruning(chair)
    chair.add_argument("--captions", type=Path, default=None, help="COCO captions json")
    chair.add_argument("--image-ids", type=Path, default=None, help="json list of image ids")
    chair.add_argument("--n-images", type=int, default=500)
    chair.add_argument("--prompt", default=None, help="default: the protocol's (see --help)")
    chair.add_argument("--max-new-tokens", type=int, default=None, help="default: 512")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    try:
        if args.limit is not None and args.limit < 1:
            raise ValueError(f"--limit must be >= 1, got {args.limit}")
        if args.command == "pope":
            from .pope_run import run_pope

            run_pope(args)
        elif args.command == "coco":
            from .coco import run_coco

            run_coco(args)
        else:
            from .chair import run_chair

            run_chair(args)
    except (ValueError, TypeError, FileNotFoundError) as err:
        print(f"vlm-focus eval {args.command}: error: {err}", file=sys.stderr)
        return 2
    return 0


# --- shared by the commands -------------------------------------------------------------------
def model_tag(model: str | None) -> str:
    """A folder name for a model: ``embedded`` or the path/hub id's last parts, sanitised."""
    if model in (None, "embedded"):
        return "embedded"
    parts = [x for x in re.split(r"[\\/]+", str(model)) if x][-2:]
    return re.sub(r"[^A-Za-z0-9._-]+", "_", "--".join(parts))


def load(args: argparse.Namespace, state: Any) -> tuple[Any, Any]:
    """(model, processor) on this process's device."""
    from ..loading import load_model

    device = args.device or str(state.device)
    return load_model(
        args.model,
        device=device,
        attn_implementation=args.attn,
        trust_remote_code=args.trust_remote_code,
    )


def load_guide(args: argparse.Namespace, state: Any) -> tuple[Any, Any]:
    """The guide model for ``--pruner guided``: ``--guide``, or the organism guide model when
    the embedded model runs."""
    from ..loading import load_model

    path = args.guide
    if path is None and args.model in (None, "embedded"):
        from ..organism import guide_model_path

        path = str(guide_model_path())
    if path is None:
        raise ValueError("--pruner guided needs --guide PATH_OR_HUB_ID (a small VLM)")
    return load_model(path, device=args.device or str(state.device))


def write_json(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str))
    tmp.replace(path)


if __name__ == "__main__":
    raise SystemExit(main())
