"""``python -m vlm_focus.integrations.vllm serve MODEL [--pruner P] [--keep K] [vllm args...]``

(``--help`` lists every option: :class:`~vlm_focus.integrations.vllm.ServeOptions`' fields and
``--pruner-option NAME=VALUE`` for the pruner's own, e.g. pyramid's ``tiles=3``.)

Starts vLLM's OpenAI-compatible server (what ``vllm serve`` starts) with MODEL's images
pruned before the LLM: it reads MODEL's ``model_type``, builds the ``--hf-overrides`` that pick
the plugin's pruning architecture (:func:`vlm_focus.integrations.vllm.hf_overrides`) and hands
every other argument to the server unchanged. MODEL ``embedded`` is the embedded default model.
The server listens on 127.0.0.1 unless ``--host`` is given (vLLM alone listens on every
interface); pass ``--api-key`` to refuse requests without the key. ``--print`` shows the
equivalent ``vllm serve`` command line instead of running it.

For the embedded model the KV cache gets a fixed size (:data:`EMBEDDED_KV_CACHE_BYTES`) unless
the command line or the environment sizes it: vLLM's own default reserves a fraction of all
memory (92% of RAM on a CPU) and refuses to start where other processes hold more than the rest.

The server runs as a child in a process group of its own; SIGTERM, SIGINT and SIGHUP to this command
go on to it, and once it exits whatever it left behind in its group (vLLM's engine and
multiprocessing helpers) is terminated too.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from ...asset_paths import EMBEDDED, default_model_path
from ...config import read_keep
from ...core.options import (
    add_options,
    default_of,
    given,
    option,
    parse_config,
    pruner_option_field,
)
from ...pruners import read_pruner_options
from . import MODELS, ServeOptions, hf_overrides

#: The embedded model's KV cache unless the user sizes it: 8 KiB a token (float32; 4 layers, k
#: and v, 8 heads of 32), so 131072 tokens, 256 prompts of its 512-token context.
EMBEDDED_KV_CACHE_BYTES = 2**30
#: The ``vllm serve`` flags that size the KV cache, and the CPU backend's variable (GiB).
KV_CACHE_FLAGS = ("--kv-cache-memory-bytes", "--gpu-memory-utilization")
KV_CACHE_ENV = "VLLM_CPU_KVCACHE_SPACE"
#: Seconds the server's leftover processes get after SIGTERM before SIGKILL.
SHUTDOWN_GRACE = 10.0
FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def _model_type(model: str) -> str:
    config = Path(model) / "config.json"
    if config.is_file():
        return json.loads(config.read_text())["model_type"]
    from transformers import AutoConfig  # a hub id: its config only

    return AutoConfig.from_pretrained(model).model_type


def sizes_kv_cache(args: list[str], environ: Mapping[str, str]) -> bool:
    """Whether server arguments ``args`` or the environment set the KV cache's size."""
    flags = {arg.split("=")[0].replace("_", "-") for arg in args if arg.startswith("--")}
    return bool(flags & set(KV_CACHE_FLAGS)) or bool(environ.get(KV_CACHE_ENV))


@dataclass
class ServeCommand:
    """The ``serve`` command's own options (the pruning settings are :class:`ServeOptions`')."""

    model_type: str | None = option(
        None, f"one of {sorted(MODELS)}", default_text="read from MODEL's config"
    )
    host: str = option("127.0.0.1", "address to listen on")
    print: bool = option(False, "print the vllm command only")
    pruner_option: list[str] = pruner_option_field()


def serve_parser() -> argparse.ArgumentParser:
    """``serve``'s parser: MODEL, :class:`ServeOptions`' and :class:`ServeCommand`'s options,
    from the same option tables as every other command (:mod:`vlm_focus.core.options`)."""
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
    add_options(parser.add_argument_group("pruning"), ServeOptions)
    add_options(parser, ServeCommand, defaults=True)
    return parser


def serve_command(argv: list[str], environ: Mapping[str, str] | None = None) -> list[str]:
    """The ``vllm serve`` argument list for ``serve`` arguments ``argv`` in the environment
    ``environ`` (default: this process's)."""
    environ = os.environ if environ is None else environ
    args, rest = serve_parser().parse_known_args(argv)
    command = parse_config(ServeCommand, args)
    settings = given(args, ServeOptions)
    if "keep" in settings:
        settings["keep"] = read_keep(settings["keep"])  # keep's one reading, as on every command
    if command.pruner_option:
        pruner = settings.get("pruner", default_of(ServeOptions, "pruner"))
        settings["options"] = read_pruner_options(pruner, command.pruner_option)
    server_defaults = []  # server arguments the user left out
    if args.model == EMBEDDED:
        args.model = str(default_model_path())
        if not sizes_kv_cache(rest, environ):
            server_defaults += ["--kv-cache-memory-bytes", str(EMBEDDED_KV_CACHE_BYTES)]
    overrides = hf_overrides(command.model_type or _model_type(args.model), **settings)
    vllm = ["vllm", "serve", args.model, "--hf-overrides", json.dumps(overrides)]
    vllm += [*server_defaults, "--host", command.host, *rest]
    return (["--print"] if command.print else []) + vllm


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
    raise SystemExit(supervise(program))


def supervise(program: list[str], grace: float = SHUTDOWN_GRACE) -> int:
    """Run ``program`` in a process group of its own until it exits, passing on the signals
    that stop a server; then stop what it left in its group. A server that is still running
    ``grace`` seconds after such a signal (vLLM's API server ignores SIGTERM while its engine
    starts) is stopped with its group. Returns its exit code (``128 + signal`` when a signal
    ended it)."""
    if sys.version_info >= (3, 11):
        child = subprocess.Popen(program, process_group=0)
    else:
        child = subprocess.Popen(program, preexec_fn=os.setpgrp)
    asked: list[float] = []  # when the first stop signal came

    def forward(signum, _frame) -> None:
        asked.append(time.monotonic())
        if child.poll() is None:
            child.send_signal(signum)

    previous = {signum: signal.signal(signum, forward) for signum in FORWARDED_SIGNALS}
    try:
        while child.poll() is None and not (asked and time.monotonic() > asked[0] + grace):
            try:
                child.wait(timeout=0.5)
            except subprocess.TimeoutExpired:
                pass
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        stop_group(child.pid, grace)
    code = child.wait()
    return 128 - code if code < 0 else code


def stop_group(pgid: int, grace: float = SHUTDOWN_GRACE) -> None:
    """SIGTERM to every process left in process group ``pgid``; SIGKILL to the group if any is
    still there after ``grace`` seconds."""
    try:
        os.killpg(pgid, signal.SIGTERM)
    except ProcessLookupError:
        return  # the group is empty
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


if __name__ == "__main__":
    main()
