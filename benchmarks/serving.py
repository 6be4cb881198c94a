"""Serving benchmark: vLLM's OpenAI server with the vlm_focus plugin, pruned against unpruned.

Runs in the vLLM environment (``bash tests/vllm_serving/make_venv.sh ~/vllm-env``):

    ~/vllm-env/bin/python benchmarks/serving.py                  # the embedded default model
    ~/vllm-env/bin/python benchmarks/serving.py --model PATH --image-size 448 448 ...

One server (``python -m vlm_focus.integrations.vllm serve``, the documented command, with
``--trust-request-mm-kwargs``) serves both settings, so they share one process, one cache size
and one machine state. For each concurrency (1, 8 and 32 by default) and each round, vLLM's own
benchmark client (``vllm.benchmarks.serve``, dataset ``random-mm``: one random image and a short
random text per request, greedy, a fixed number of output tokens) sends ``--requests`` chat
requests unpruned (``vlm_focus_keep=1.0``) and then pruned (the server's pruner at ``--keep``),
alternating; every round draws new images (a new seed), so no setting reads another's cached
images. Reported per concurrency: TTFT p50/p90, output tokens/s and requests/s of each setting
(the median over rounds) and pruned/unpruned ratios. Requests/s must not fall as concurrency
rises: the table says whether it did.

Writes ``serving.json`` and ``serving.md`` under ``--out``. On a GPU the same script runs a
7B-shaped model (``--model`` a folder with its config and weights).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args: argparse.Namespace, port: int, log: Path) -> subprocess.Popen:
    command = [
        sys.executable,
        "-m",
        "vlm_focus.integrations.vllm",
        "serve",
        args.model,
        "--pruner",
        args.pruner,
        "--keep",
        str(args.keep),
        "--port",
        str(port),
        "--limit-mm-per-prompt",
        '{"image": 1}',
        "--trust-request-mm-kwargs",
        "--max-num-seqs",
        str(max(args.concurrency)),
        *args.server_args,
    ]
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    server = subprocess.Popen(
        command,
        env=env,
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    deadline = time.monotonic() + args.startup_timeout
    while True:
        if server.poll() is not None:
            raise RuntimeError(f"the server exited at start:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                if r.status == 200:
                    return server
        except OSError:
            pass
        if time.monotonic() > deadline:
            stop(server)
            raise TimeoutError(f"the server did not come up in {args.startup_timeout} s")
        time.sleep(2)


def stop(server: subprocess.Popen) -> None:
    server.terminate()
    try:
        server.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(server.pid, signal.SIGKILL)


def client_run(args, port: int, concurrency: int, seed: int, keep: float | None) -> dict:
    """One pass of vLLM's benchmark client; ``keep=None``: the server's own setting."""
    from vllm.benchmarks import serve as bench
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    width, height = args.image_size
    extra = {"mm_processor_kwargs": {"vlm_focus_keep": keep}} if keep is not None else {}
    argv = [
        "--backend",
        "openai-chat",
        "--base-url",
        f"http://127.0.0.1:{port}",
        "--endpoint",
        "/v1/chat/completions",
        "--model",
        args.model,
        "--dataset-name",
        "random-mm",
        "--num-prompts",
        str(args.requests),
        "--max-concurrency",
        str(concurrency),
        "--random-input-len",
        str(args.input_len),
        "--random-output-len",
        str(args.output_len),
        "--random-range-ratio",
        "0",
        "--random-mm-base-items-per-request",
        "1",
        "--random-mm-num-mm-items-range-ratio",
        "0",
        "--random-mm-limit-mm-per-prompt",
        '{"image": 1, "video": 0}',
        "--random-mm-bucket-config",
        json.dumps({f"({height}, {width}, 1)": 1.0}),
        "--ignore-eos",
        "--percentile-metrics",
        "ttft,e2el",
        "--metric-percentiles",
        "50,90",
        "--seed",
        str(seed),
        "--disable-tqdm",
    ]
    if extra:
        argv += ["--extra-body", json.dumps(extra)]
    parser = FlexibleArgumentParser()
    bench.add_cli_args(parser)
    result = bench.main(parser.parse_args(argv))
    if result["completed"] != args.requests:
        raise RuntimeError(f"{args.requests - result['completed']} requests failed")
    return {
        "ttft_p50_ms": result["p50_ttft_ms"],
        "ttft_p90_ms": result["p90_ttft_ms"],
        "output_tok_s": result["output_throughput"],
        "requests_s": result["request_throughput"],
    }


def summarise(rounds: list[dict]) -> dict:
    return {key: statistics.median(r[key] for r in rounds) for key in rounds[0]}


def markdown(report: dict) -> str:
    s = report["settings"]
    lines = [
        "# Serving: pruned against unpruned (vLLM OpenAI server, vlm_focus plugin)",
        "",
        f"Model `{s['model_name']}`, pruner `{s['pruner']}` at keep {s['keep']} against keep 1.0 "
        f"on the same server; {s['requests']} requests per run, one {s['image_size'][0]}x"
        f"{s['image_size'][1]} random image and {s['input_len']} random text tokens each, "
        f"{s['output_len']} output tokens (greedy, EOS ignored); medians of {s['rounds']} "
        f"alternating rounds. Machine: {s['machine']}. Command: `{s['command']}` "
        f"({s['wall_s']:.0f} s).",
        "",
        "| concurrency | setting | TTFT p50 ms | TTFT p90 ms | output tok/s | requests/s |",
        "|---:|---|---:|---:|---:|---:|",
    ]
    for row in report["rows"]:
        for name in ("unpruned", "pruned"):
            m = row[name]
            lines.append(
                f"| {row['concurrency']} | {name} | {m['ttft_p50_ms']:.1f} | "
                f"{m['ttft_p90_ms']:.1f} | {m['output_tok_s']:.1f} | {m['requests_s']:.2f} |"
            )
        r = row["ratio"]
        lines.append(
            f"| {row['concurrency']} | **pruned / unpruned** | {r['ttft_p50_ms']:.2f}x | "
            f"{r['ttft_p90_ms']:.2f}x | {r['output_tok_s']:.2f}x | {r['requests_s']:.2f}x |"
        )
    lines += ["", "Requests/s as concurrency rises (must not fall):", ""]
    for name, verdict in report["requests_s_rises"].items():
        lines.append(f"- {name}: {verdict}")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="embedded", help="model folder, or 'embedded'")
    parser.add_argument("--pruner", default="fastv")
    parser.add_argument("--keep", type=float, default=0.25)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--image-size", type=int, nargs=2, default=[192, 192], metavar=("W", "H"))
    parser.add_argument("--input-len", type=int, default=12, help="random text tokens")
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--startup-timeout", type=float, default=600)
    parser.add_argument("--out", type=Path, default=HERE / "results")
    parser.add_argument(
        "--server-args", nargs=argparse.REMAINDER, default=[], help="passed to the server"
    )
    args = parser.parse_args()
    if args.model == "embedded":
        from vlm_focus.asset_paths import default_model_path

        args.model = str(default_model_path())
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    port = free_port()
    log = Path(tempfile.mkdtemp()) / "server.log"
    print(f"server log: {log}", flush=True)
    server = start_server(args, port, log)
    rows = []
    try:
        for concurrency in args.concurrency:
            runs = {"unpruned": [], "pruned": []}
            for round_index in range(args.rounds):
                seed = 1000 * concurrency + round_index
                for name, keep in (("unpruned", 1.0), ("pruned", None)):
                    runs[name].append(client_run(args, port, concurrency, seed, keep))
            medians = {name: summarise(r) for name, r in runs.items()}
            ratio = {k: medians["pruned"][k] / medians["unpruned"][k] for k in medians["pruned"]}
            rows.append({"concurrency": concurrency, **medians, "ratio": ratio, "runs": runs})
            print(json.dumps({"concurrency": concurrency, "ratio": ratio}), flush=True)
    finally:
        stop(server)
    rises = {}
    for name in ("unpruned", "pruned"):
        rates = [row[name]["requests_s"] for row in rows]
        falls = [
            f"{a['concurrency']}->{b['concurrency']}"
            for a, b in zip(rows, rows[1:], strict=False)
            if b[name]["requests_s"] < a[name]["requests_s"]
        ]
        rates_text = ", ".join(f"{r:.2f}" for r in rates)
        rises[name] = f"{rates_text} req/s: " + (
            "never falls" if not falls else f"FALLS at {', '.join(falls)}"
        )
    report = {
        "settings": {
            "model": args.model,
            "model_name": Path(args.model).name,
            "pruner": args.pruner,
            "keep": args.keep,
            "requests": args.requests,
            "rounds": args.rounds,
            "image_size": args.image_size,
            "input_len": args.input_len,
            "output_len": args.output_len,
            "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
            "command": "python benchmarks/serving.py " + " ".join(sys.argv[1:]),
            "wall_s": time.monotonic() - started,
        },
        "rows": rows,
        "requests_s_rises": rises,
    }
    (args.out / "serving.json").write_text(json.dumps(report, indent=2))
    (args.out / "serving.md").write_text(markdown(report))
    print(markdown(report))


if __name__ == "__main__":
    main()
