"""Decode tokens/s, pruned against unpruned, over caches, execution modes, batch sizes and
visual context lengths, each ratio beside the bytes-moved bound it could reach.

Model: the random-weight Qwen2.5-VL architecture of ``fixation_decode.py`` (text: hidden 512,
8 layers, 8 heads over 4 kv heads, MLP 1376), one image of N merged visual tokens per row.
Every run is a greedy ``generate()`` of ``--steps`` tokens; a streamer stamps each token, and
the decode time runs from the first token (the prompt's) to the last, so the prefill is not in
it. Unwrapped and wrapped runs alternate in one process (ABBA: every other pair starts with the
wrapped run); each ratio is the median pair's, with the pairs' min-max.

Modes: ``dynamic`` (the default cache, eager), ``static`` (``cache_implementation="static"``,
eager) and ``compiled`` (static, with ``generate()``'s own ``compile_config``: inductor, and
CUDA graphs on a GPU). Settings: ``fastv`` keep 0.25 at K = 2, ``fixation`` keep 0.05 at K = 1,
and ``keep1`` (fastv keep 1.0: the hooks alone, nothing dropped).

The bound: a decode step reads the language model's weights and, per layer, the keys and values
its attention reads: ``B * 2 * kv_heads * head_dim`` elements per cached token.
A dynamic cache reads what it holds (on average the prompt plus half the steps), a static one
its whole buffer (prompt plus steps; a pruned layer's buffer holds only its kept prompt);
fixation reads, at layers >= K, the columns it keeps, plus every key of layer K once to score
them. ``bound = bytes unpruned / bytes pruned``, and ``share = ratio / bound``.

    python benchmarks/decode.py [--visual 576 2880 8192] [--batch 1 8]
        [--modes dynamic static compiled] [--settings fastv fixation keep1] [--pairs 3]

Rows are added to ``results/decode.json`` as each finishes (a killed run keeps them), and the
whole table is written to ``results/decode.md``.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from fixation_decode import LAYERS, build_inputs, build_model
from prefill import machine
from transformers import CompileConfig
from transformers.generation.streamers import BaseStreamer

import vlm_focus as vf
from vlm_focus.config import keep_count
from vlm_focus.timing import alternate


@dataclass(frozen=True)
class Setting:
    name: str
    pruner: str
    keep: float
    layer: int

    def wrap(self, model):
        return vf.wrap(model, pruner=self.pruner, keep=self.keep, layer=self.layer)


SETTINGS = {
    "fastv": Setting("fastv keep 0.25, K=2", "fastv", 0.25, 2),
    "fixation": Setting("fixation keep 0.05, K=1", "fixation", 0.05, 1),
    "keep1": Setting("hooks only (fastv keep 1.0, K=2)", "fastv", 1.0, 2),
}
MODES = ("dynamic", "static", "compiled")


class TokenClock(BaseStreamer):
    """Stamps each ``put`` (the prompt first, then one per generated token); ``put`` gets
    tokens already on the host, so a GPU step has finished when it is stamped."""

    def __init__(self) -> None:
        self.stamps: list[float] = []

    def put(self, value) -> None:
        self.stamps.append(time.perf_counter())

    def end(self) -> None:
        pass

    def decode_seconds(self) -> float:
        """From the first generated token (the prefill's) to the last."""
        return self.stamps[-1] - self.stamps[1]


def batch_inputs(n_visual: int, batch: int, device: str, dtype: torch.dtype) -> dict:
    """``batch`` copies of one prompt with an image of ``n_visual`` merged tokens."""
    one = build_inputs(n_visual)
    out = {k: v.repeat(batch, *[1] * (v.dim() - 1)) for k, v in one.items()}
    out["pixel_values"] = one["pixel_values"].repeat(batch, 1).to(dtype)
    return {k: v.to(device) for k, v in out.items()}


def generate_kwargs(mode: str, steps: int, cuda: bool) -> dict:
    kwargs = {"max_new_tokens": steps, "min_new_tokens": steps, "do_sample": False}
    if mode in ("static", "compiled"):
        kwargs["cache_implementation"] = "static"
    if mode == "compiled":
        # CUDA graphs on a GPU (transformers' default mode); plain inductor on a CPU
        config = CompileConfig(fullgraph=True, dynamic=False)
        config.mode = "reduce-overhead" if cuda else "default"
        config._compile_all_devices = True  # transformers compiles only on accelerators
        kwargs["compile_config"] = config
    return kwargs


def decode_seconds(model, inputs: dict, kwargs: dict) -> float:
    clock = TokenClock()
    with torch.inference_mode():
        model.generate(**inputs, streamer=clock, **kwargs)
    return clock.decode_seconds()


def bytes_bound(
    model, batch: int, prompt: int, n_visual: int, setting: Setting, mode: str, steps: int
) -> float:
    """Bytes a decode step reads unpruned over pruned (see the module docstring)."""
    text = model.config.text_config
    lm = model.model.language_model
    weights = sum(p.numel() for n, p in lm.named_parameters() if "embed_tokens" not in n)
    weights += model.lm_head.weight.numel()
    head_dim = text.hidden_size // text.num_attention_heads
    per_token = batch * 2 * text.num_key_value_heads * head_dim
    drop = n_visual - keep_count(setting.keep, n_visual)
    generated = steps if mode != "dynamic" else steps / 2  # a static buffer is read whole
    full = prompt + generated
    pruned = (full - drop) * (LAYERS - setting.layer) + full * setting.layer
    if setting.pruner == "fixation":
        pruned += full / 2  # the focal layer's keys, scored
    # weights and cache share one dtype, so elements stand in for bytes
    return (weights + per_token * full * LAYERS) / (weights + per_token * pruned)


def measure(model, inputs, setting: Setting, mode: str, steps: int, pairs: int, cuda: bool):
    """Paired decode seconds, unpruned and wrapped, in ABBA order; the warm-up run of each
    side compiles and fills the allocator."""
    kwargs = generate_kwargs(mode, steps, cuda)

    def wrapped() -> float:
        with setting.wrap(model):
            return decode_seconds(model, inputs, kwargs)

    return alternate(lambda: decode_seconds(model, inputs, kwargs), wrapped, repeats=pairs)


def markdown(rows: list[dict]) -> str:
    lines = [
        "| visual | B | mode | setting | tok/s unpruned | tok/s pruned | ratio (min-max, pairs) "
        "| bound | share |",
        "|---:|---:|---|---|---:|---:|---|---:|---:|",
    ]
    order = {m: i for i, m in enumerate(MODES)}
    for r in sorted(rows, key=lambda r: (r["visual"], r["batch"], order[r["mode"]], r["setting"])):
        lines.append(
            f"| {r['visual']} | {r['batch']} | {r['mode']} | {r['setting']} | "
            f"{r['tok_s_unpruned']:.1f} | {r['tok_s_pruned']:.1f} | {r['ratio']:.2f}x "
            f"({r['ratio_min']:.2f}-{r['ratio_max']:.2f}, {r['runs']}) | {r['bound']:.2f}x | "
            f"{r['share']:.0%} |"
        )
    return "\n".join(lines)


def run_grid(
    visual: list[int],
    batches: list[int],
    modes: list[str],
    settings: list[str],
    pairs: int,
    steps: int,
    out: Path,
) -> list[dict]:
    """Measure every row of the grid on this machine's accelerator (or its CPU); rows go to
    ``out/decode.json`` as each finishes, the table to ``out/decode.md``."""
    cuda = torch.cuda.is_available()
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    model = build_model().to(device=device, dtype=dtype)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "decode.json"
    rows = json.loads(path.read_text())["rows"] if path.exists() else []
    where = torch.cuda.get_device_name() if cuda else machine()
    print(f"machine: {where}")
    for n_visual in visual:
        for batch in batches:
            inputs = batch_inputs(n_visual, batch, device, dtype)
            for mode in modes:
                for key in settings:
                    setting = SETTINGS[key]
                    timing = measure(model, inputs, setting, mode, steps, pairs, cuda)
                    tokens = batch * (steps - 1)
                    prompt = inputs["input_ids"].shape[1]
                    bound = bytes_bound(model, batch, prompt, n_visual, setting, mode, steps)
                    row = {
                        "visual": n_visual,
                        "batch": batch,
                        "prompt": prompt,
                        "steps": steps,
                        "mode": mode,
                        "setting": setting.name,
                        "machine": where,
                        "tok_s_unpruned": tokens / timing.base_seconds,
                        "tok_s_pruned": tokens / timing.other_seconds,
                        **timing.to_dict(),
                        "bound": bound,
                        "share": timing.ratio / bound,
                    }
                    same = ("visual", "batch", "mode", "setting", "machine")
                    rows = [r for r in rows if any(r[k] != row[k] for k in same)] + [row]
                    path.write_text(json.dumps({"rows": rows}, indent=1))
                    print(markdown([row]).splitlines()[-1], flush=True)
    write_table(out, model)
    return rows


def write_table(out: Path, model=None) -> None:
    """``decode.md`` from every row of ``decode.json``, bounds computed by :func:`bytes_bound`."""
    model = build_model() if model is None else model
    path = out / "decode.json"
    rows = json.loads(path.read_text())["rows"]
    names = {s.name: s for s in SETTINGS.values()}
    for row in rows:
        setting = names[row["setting"]]
        row["bound"] = bytes_bound(
            model, row["batch"], row["prompt"], row["visual"], setting, row["mode"], row["steps"]
        )
        row["share"] = row["ratio"] / row["bound"]
    path.write_text(json.dumps({"rows": rows}, indent=1))
    (out / "decode.md").write_text(
        "Decode tokens/s, pruned vs unpruned (`python benchmarks/decode.py`), on "
        f"{', '.join(sorted({r['machine'] for r in rows}))}.\n\n" + markdown(rows) + "\n"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--visual", type=int, nargs="+", default=[576, 2880, 8192])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--settings", nargs="+", choices=list(SETTINGS), default=list(SETTINGS))
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--threads", type=int, default=0, help="CPU threads (0: torch's)")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    parser.add_argument(
        "--table", action="store_true", help="only rewrite decode.md from decode.json"
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.table:
        write_table(args.out)
        return
    run_grid(args.visual, args.batch, args.modes, args.settings, args.pairs, args.steps, args.out)


if __name__ == "__main__":
    main()
