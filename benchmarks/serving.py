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

``serving.py pope`` measures what serving costs in accuracy instead: the embedded model answers
the held-out POPE questions of the first ``--images`` scenes (all three splits) unpruned and
pruned (``--pruner`` at ``--keep``, layer 0), with the kept tokens at their original positions
and at compact ones, through ``vf.wrap`` in transformers (the main environment's interpreter,
``--reference-python``, default ``$VLM_FOCUS_REFERENCE_PYTHON``) and through vLLM (one offline
engine per position rule); it reports each one's accuracy, its retention (accuracy over the
unpruned accuracy of the same side) and how many answers vLLM and ``vf.wrap`` share. Writes
``serving_pope.json`` and ``serving_pope.md``.
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


#: Position rules of the POPE comparison; ``None`` rows are unpruned.
POPE_RUNS = (("unpruned", None), ("original", "original"), ("compact", "compact"))
POPE_MAX_TOKENS = 8


def pope_reference(work: str, images: str, pruner: str, keep: str) -> None:
    """Main environment: the POPE cases (prompt ids, image, label, split) of the first
    ``images`` held-out scenes, and ``vf.wrap``'s answer to each under every :data:`POPE_RUNS`
    entry, into ``work/reference.json``."""
    import torch

    import vlm_focus as vf
    from vlm_focus.asset_paths import heldout_path
    from vlm_focus.config import read_keep
    from vlm_focus.eval.pope import LLAVA_SUFFIX, SPLITS, read_questions
    from vlm_focus.eval.scenes import write_heldout_set
    from vlm_focus.loading import build_inputs, load_image, load_model

    folder = Path(work)
    write_heldout_set(folder / "images", int(images))
    names = {p.name for p in (folder / "images").glob("*.png")}
    model, processor = load_model("embedded", dtype=torch.float32)
    image_id = model.config.image_token_index
    cases = []
    for split in SPLITS:
        for row in read_questions(heldout_path(f"pope_{split}.jsonl")):
            if row["image"] not in names:
                continue
            image = str(folder / "images" / row["image"])
            inputs = build_inputs(processor, load_image(image), row["text"] + LLAVA_SUFFIX)
            ids = inputs["input_ids"][0].tolist()
            at, n = ids.index(image_id), ids.count(image_id)
            case = {"split": split, "label": row["label"], "image": image}
            case["prompt_ids"] = ids[:at] + [image_id] + ids[at + n :]
            for name, positions in POPE_RUNS:
                settings = dict(pruner=pruner, keep=read_keep(keep), layer=0, positions=positions)
                with torch.no_grad():
                    if positions is None:
                        out = model.generate(**inputs, max_new_tokens=POPE_MAX_TOKENS)
                    else:
                        with vf.wrap(model, **settings):
                            out = model.generate(**inputs, max_new_tokens=POPE_MAX_TOKENS)
                answer = processor.tokenizer.decode(out[0, len(ids) :], skip_special_tokens=True)
                case[name] = answer
            cases.append(case)
    (folder / "reference.json").write_text(json.dumps(cases))


def pope_engine(work: str, model: str, pruner: str, keep: str, positions: str) -> None:
    """vLLM environment: one offline engine of the plugin (``positions``; ``"unpruned"``:
    keep 1.0) answers every case of ``work/reference.json`` into ``work/vllm_{positions}.json``."""
    from PIL import Image
    from vllm import LLM, SamplingParams

    from vlm_focus.integrations.vllm import hf_overrides

    folder = Path(work)
    cases = json.loads((folder / "reference.json").read_text())
    setting = {"pruner": pruner, "keep": json.loads(keep)}
    if positions == "unpruned":
        setting = {"pruner": "pool", "keep": 1.0}
    else:
        setting["positions"] = positions
    model_type = json.loads((Path(model) / "config.json").read_text())["model_type"]
    overrides = hf_overrides(model_type, **setting)  # the model's pruning class, checked
    llm = LLM(
        model=model,
        dtype="float32",
        hf_overrides=overrides,
        max_model_len=512,
        limit_mm_per_prompt={"image": 1},
        enforce_eager=True,
        seed=0,
    )
    images = {c["image"]: Image.open(c["image"]).convert("RGB") for c in cases}
    requests = [
        {"prompt_token_ids": c["prompt_ids"], "multi_modal_data": {"image": images[c["image"]]}}
        for c in cases
    ]
    params = SamplingParams(temperature=0.0, max_tokens=POPE_MAX_TOKENS)
    outputs = llm.generate(requests, params, use_tqdm=True)
    answers = [o.outputs[0].text for o in outputs]
    (folder / f"vllm_{positions}.json").write_text(json.dumps(answers))


def pope_main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="serving.py pope", description=__doc__.split("\n\n")[-1])
    parser.add_argument(
        "--images", type=int, default=100, help="held-out scenes (6 questions each a split)"
    )
    parser.add_argument("--pruner", default="fastv")
    parser.add_argument("--keep", default="0.25")
    parser.add_argument("--reference-python", default=os.environ.get("VLM_FOCUS_REFERENCE_PYTHON"))
    parser.add_argument("--out", type=Path, default=HERE / "results")
    args = parser.parse_args(argv)
    if not args.reference_python:
        raise SystemExit("pass --reference-python (the main environment's python)")
    from vlm_focus.asset_paths import default_model_path
    from vlm_focus.eval.metrics import parse_yes_no

    started = time.monotonic()
    work = Path(tempfile.mkdtemp())
    script = str(Path(__file__).resolve())
    print(f"work folder: {work}", flush=True)
    reference = [args.reference_python, script, "pope-reference", str(work)]
    subprocess.run([*reference, str(args.images), args.pruner, args.keep], check=True)
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    for name, _ in POPE_RUNS:
        engine = [sys.executable, script, "pope-engine", str(work), str(default_model_path())]
        subprocess.run([*engine, args.pruner, args.keep, name], check=True, env=env)
    cases = json.loads((work / "reference.json").read_text())
    served = {name: json.loads((work / f"vllm_{name}.json").read_text()) for name, _ in POPE_RUNS}

    def accuracy(answers: list[str]) -> float:
        right = [parse_yes_no(a)[0] == c["label"] for a, c in zip(answers, cases, strict=True)]
        return sum(right) / len(right)

    rows = []
    for name, _ in POPE_RUNS:
        wrap = [c[name] for c in cases]
        rows.append(
            {
                "run": name,
                "vf_wrap": accuracy(wrap),
                "vllm": accuracy(served[name]),
                "same_answers": sum(
                    parse_yes_no(a)[0] == parse_yes_no(b)[0]
                    for a, b in zip(wrap, served[name], strict=True)
                )
                / len(cases),
            }
        )
    for row in rows:
        row["vf_wrap_retention"] = row["vf_wrap"] / rows[0]["vf_wrap"]
        row["vllm_retention"] = row["vllm"] / rows[0]["vllm"]
    report = {
        "settings": {
            "pruner": args.pruner,
            "keep": args.keep,
            "images": args.images,
            "questions": len(cases),
            "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
            "command": "python benchmarks/serving.py pope " + " ".join(argv),
            "wall_s": time.monotonic() - started,
        },
        "rows": rows,
    }
    (args.out / "serving_pope.json").write_text(json.dumps(report, indent=2))
    lines = [
        f"# POPE through vLLM against vf.wrap: {args.pruner} keep {args.keep} at layer 0",
        "",
        f"Embedded model, held-out POPE, {len(cases)} questions ({args.images} scenes, three "
        f"splits), greedy, {report['settings']['machine']}, {report['settings']['wall_s']:.0f} s. "
        "Retention = accuracy / the same side's unpruned accuracy; same answers = share of "
        "questions where vLLM's parsed answer equals vf.wrap's.",
        "",
        "| positions | vf.wrap accuracy | retention | vLLM accuracy | retention | same answers |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        lines.append(
            f"| {row['run']} | {row['vf_wrap']:.3f} | {row['vf_wrap_retention']:.3f} | "
            f"{row['vllm']:.3f} | {row['vllm_retention']:.3f} | {row['same_answers']:.3f} |"
        )
    lines += ["", f"Command: `{report['settings']['command']}`", ""]
    (args.out / "serving_pope.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    if sys.argv[1:2] == ["pope"]:
        pope_main(sys.argv[2:])
    elif sys.argv[1:2] == ["pope-reference"]:
        pope_reference(*sys.argv[2:])
    elif sys.argv[1:2] == ["pope-engine"]:
        pope_engine(*sys.argv[2:])
    else:
        main()
