"""``vlm-focus eval pope|coco|chair``: the evaluation commands.

Without ``--model`` and data paths, each command runs the embedded organism model on its
held-out scenes (written from their seeds under ``--out``). Every command is resumable (re-run
it to continue), runs data-parallel under ``accelerate launch``, and writes its choices
(prompt, parsing rule, decoding) next to the numbers. Each option's help ends with its default.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from ..core.options import add_command, parse_config
from ..loading import MissingExtra
from .chair_run import ChairConfig, run_chair
from .coco_run import CocoConfig, run_coco
from .pope_run import PopeConfig, run_pope

COMMANDS: dict[str, tuple[type, Any, str]] = {
    config_cls.command: (config_cls, run, help_text)
    for config_cls, run, help_text in (
        (PopeConfig, run_pope, "POPE object-presence yes/no questions"),
        (CocoConfig, run_coco, "attention grounding: boxes (COCO AP), pointing, AUROC"),
        (ChairConfig, run_chair, "CHAIR caption hallucination"),
    )
}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="vlm-focus eval", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    for name, (config_cls, _, help_text) in COMMANDS.items():
        add_command(sub, name, config_cls, help_text)
    return p


def parse(argv: list[str]) -> Any:
    """The typed config of a command line, e.g. a :class:`~vlm_focus.eval.pope_run.PopeConfig`;
    options left out take the config's defaults. Bad values raise ``ValueError``."""
    args = parser().parse_args(argv)
    config_cls = COMMANDS[args.command][0]
    return parse_config(config_cls, args)


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    command = args.command
    config_cls, run, _ = COMMANDS[command]
    try:
        config = parse_config(config_cls, args)
        if config.threads:
            import torch

            torch.set_num_threads(config.threads)
        run(config)
    except MissingExtra as err:  # names the command, the module and the extra
        print(err, file=sys.stderr)
        return 2
    except (ValueError, TypeError, FileNotFoundError) as err:
        print(f"vlm-focus eval {command}: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
