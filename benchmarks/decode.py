"""Decode tokens/s, pruned against unpruned, over caches, execution modes, batch sizes and
visual context lengths, each ratio beside the bytes-moved bound it could reach.

Models (``--arch``), each random-weight with the same text size (hidden 512, 8 layers, 8 heads
over 4 kv heads, MLP 1376), one image of N merged visual tokens per row:

- ``qwen2_5_vl``: the Qwen2.5-VL architecture of ``fixation_decode.py``;
- ``gemma3``: Gemma 3, sliding-window layers (window 1024, as the real checkpoints) at 3:1 with
  full-attention ones, the image's tokens as one bidirectional block (N a square);
- ``qwen3_5``: Qwen3.5, Gated DeltaNet layers at 3:1 with full-attention ones (N a square).
Every run is a greedy ``generate()`` of ``--steps`` tokens; a streamer stamps each token, and
the decode time runs from the first token (the prompt's) to the last, so the prefill is not in
it. Unwrapped and wrapped runs alternate in one process (ABBA: every other pair starts with the
wrapped run); each ratio is the median pair's, with the pairs' min-max.

Modes: ``dynamic`` (the default cache, eager), ``static`` (``cache_implementation="static"``,
eager) and ``compiled`` (static, with ``generate()``'s own ``compile_config``: inductor, and
CUDA graphs on a GPU; ``dynamic=False``, or transformers' default ``dynamic=None`` for a model
with sliding-window layers, see :func:`generate_kwargs`). Settings: ``fastv`` keep 0.25 at
K = 2, ``fixation`` keep 0.05 at K = 1, and ``keep1`` (fastv keep 1.0: the hooks alone, nothing
dropped).

The bound: a decode step reads the language model's weights and, per layer, the keys and values
its attention reads: ``B * 2 * kv_heads * head_dim`` elements per cached token.
A dynamic cache reads what it holds (on average the prompt plus half the steps), a static one
its whole buffer (prompt plus steps; a pruned layer's buffer holds only its kept prompt);
a sliding-window layer at most its window; a linear-attention layer its fixed-size recurrent
and convolution state, pruned or not. Fixation reads, at layers >= K, the columns it keeps,
plus every key of layer K once to score them. ``bound = bytes unpruned / bytes pruned``, and
``share = ratio / bound``.

    python benchmarks/decode.py [--arch qwen2_5_vl] [--visual 576 2880 8192] [--batch 1 8]
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
from fixation_decode import TEXT as FIXATION_TEXT
from prefill import machine
from transformers import CompileConfig
from transformers.generation.streamers import BaseStreamer

import vlm_focus as vf
from vlm_focus.config import keep_count
from vlm_focus.model_adapters.tiny import (
    BOS,
    IMAGE,
    IMAGE_END,
    IMAGE_START,
    VISION_END,
    VISION_START,
    tiny_model,
)
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
#: the text model every architecture shares (``fixation_decode.build_model``'s)
TEXT = dict(FIXATION_TEXT, head_dim=64)
THREE_TO_ONE = [(i + 1) % 4 == 0 for i in range(LAYERS)]  # full attention at layers 3 and 7


def gemma3_model(n_visual: int) -> torch.nn.Module:
    """Its SigLIP tower sized so that pooling keeps every patch: one token per 14 px patch."""
    kinds = ["full_attention" if full else "sliding_attention" for full in THREE_TO_ONE]
    text = dict(TEXT, query_pre_attn_scalar=64, sliding_window=1024, layer_types=kinds)
    vision = dict(image_size=14 * _side(n_visual), patch_size=14)
    return tiny_model("gemma3", text=text, vision=vision, mm_tokens_per_image=n_visual)


def qwen3_5_model(n_visual: int) -> torch.nn.Module:
    kinds = ["full_attention" if full else "linear_attention" for full in THREE_TO_ONE]
    text = dict(
        TEXT,
        layer_types=kinds,
        linear_num_key_heads=4,
        linear_num_value_heads=8,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
        rope_parameters={"mrope_section": [6, 5, 5]},  # 32 rotary dims of 64, as Qwen3.5's share
    )
    return tiny_model("qwen3_5", text=text, vision={"out_hidden_size": TEXT["hidden_size"]})


def _side(n_visual: int) -> int:
    side = round(n_visual**0.5)
    if side * side != n_visual:
        raise ValueError(f"--visual {n_visual}: this architecture needs a square token count")
    return side


def gemma3_inputs(model, n_visual: int) -> dict:
    """20 text tokens, one image of ``n_visual`` tokens, 20 text tokens."""
    gen = torch.Generator().manual_seed(0)
    text = torch.randint(3, 100, (40,), generator=gen).tolist()
    ids = [BOS] + text[:20] + [IMAGE_START] + [IMAGE] * n_visual + [IMAGE_END] + text[20:]
    ids = torch.tensor([ids])
    size = model.config.vision_config.image_size
    return {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "token_type_ids": (ids == IMAGE).long(),
        "pixel_values": torch.randn(1, 3, size, size, generator=gen),
    }


def qwen3_5_inputs(model, n_visual: int) -> dict:
    side = _side(n_visual)
    gen = torch.Generator().manual_seed(0)
    text = torch.randint(3, 100, (40,), generator=gen).tolist()
    ids = [BOS] + text[:20] + [VISION_START] + [IMAGE] * n_visual + [VISION_END] + text[20:]
    ids = torch.tensor([ids])
    vision = model.config.vision_config
    patch = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
    return {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "mm_token_type_ids": (ids == IMAGE).long(),
        "pixel_values": torch.randn(4 * n_visual, patch, generator=gen),
        "image_grid_thw": torch.tensor([[1, 2 * side, 2 * side]]),
    }


#: ``--arch`` -> (build the model for images of ``n_visual`` tokens, its inputs)
ARCHS = {
    "qwen2_5_vl": (lambda n_visual: build_model(), lambda model, n_visual: build_inputs(n_visual)),
    "gemma3": (gemma3_model, gemma3_inputs),
    "qwen3_5": (qwen3_5_model, qwen3_5_inputs),
}


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


def batch_inputs(
    arch: str, model, n_visual: int, batch: int, device: str, dtype: torch.dtype
) -> dict:
    """``batch`` copies of one prompt with an image of ``n_visual`` merged tokens."""
    one = ARCHS[arch][1](model, n_visual)
    out = {k: v.repeat(batch, *[1] * (v.dim() - 1)) for k, v in one.items()}
    out["pixel_values"] = out["pixel_values"].to(dtype)
    if "image_grid_thw" not in one:  # one image per row: one tower input per row
        out["pixel_values"] = one["pixel_values"].repeat(batch, 1, 1, 1).to(dtype)
    return {k: v.to(device) for k, v in out.items()}


def generate_kwargs(mode: str, steps: int, cuda: bool, sliding: bool = False) -> dict:
    """``generate()``'s arguments for `mode`; `sliding`: the model has sliding-window layers."""
    kwargs = {"max_new_tokens": steps, "min_new_tokens": steps, "do_sample": False}
    if mode in ("static", "compiled"):
        kwargs["cache_implementation"] = "static"
    if mode == "compiled":
        # CUDA graphs on a GPU (transformers' default mode); plain inductor on a CPU. A
        # sliding-window layer's static buffer guards on its Python length, so with
        # dynamic=False every step recompiles (unwrapped too) until fullgraph fails; transformers'
        # default dynamic=None compiles such a model twice, pruned or not
        config = CompileConfig(fullgraph=True, dynamic=None if sliding else False)
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
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    per_token = batch * 2 * text.num_key_value_heads * head_dim
    drop = n_visual - keep_count(setting.keep, n_visual)
    generated = steps if mode != "dynamic" else steps / 2  # a static buffer is read whole
    full = prompt + generated
    kinds = getattr(text, "layer_types", None) or ["full_attention"] * LAYERS

    def read(kind: str, tokens: float) -> float:
        if kind == "linear_attention":  # its state, whatever the tokens
            keys = text.linear_num_key_heads * text.linear_key_head_dim
            values = text.linear_num_value_heads * text.linear_value_head_dim
            state = text.linear_num_value_heads * text.linear_key_head_dim
            state *= text.linear_value_head_dim
            return batch * (state + (2 * keys + values) * (text.linear_conv_kernel_dim - 1))
        if kind == "sliding_attention":
            tokens = min(tokens, text.sliding_window)
        return per_token * tokens

    unpruned = sum(read(kind, full) for kind in kinds)
    pruned = sum(read(k, full - drop if i >= setting.layer else full) for i, k in enumerate(kinds))
    if setting.pruner == "fixation":
        pruned += per_token * full / 2  # the focal layer's keys, scored
    # weights and cache share one dtype, so elements stand in for bytes
    return (weights + unpruned) / (weights + pruned)


def measure(model, inputs, setting: Setting, mode: str, steps: int, pairs: int, cuda: bool):
    """Paired decode seconds, unpruned and wrapped, in ABBA order; the warm-up run of each
    side compiles and fills the allocator."""
    types = getattr(model.config.text_config, "layer_types", None) or []
    kwargs = generate_kwargs(mode, steps, cuda, sliding="sliding_attention" in types)

    def wrapped() -> float:
        with setting.wrap(model):
            return decode_seconds(model, inputs, kwargs)

    return alternate(lambda: decode_seconds(model, inputs, kwargs), wrapped, repeats=pairs)


def _arch(row: dict) -> str:
    return row.get("arch", "qwen2_5_vl")  # rows from before --arch


def _key(row: dict) -> tuple:
    return (_arch(row), row["visual"], row["batch"], row["mode"], row["setting"], row["machine"])


def markdown(rows: list[dict]) -> str:
    lines = [
        "| model | visual | B | mode | setting | tok/s unpruned | tok/s pruned "
        "| ratio (min-max, pairs) | bound | share |",
        "|---|---:|---:|---|---|---:|---:|---|---:|---:|",
    ]
    archs, modes = list(ARCHS), list(MODES)

    def order(r: dict) -> tuple:
        return (
            archs.index(_arch(r)),
            r["visual"],
            r["batch"],
            modes.index(r["mode"]),
            r["setting"],
        )

    for r in sorted(rows, key=order):
        lines.append(
            f"| {_arch(r)} | {r['visual']} | {r['batch']} | {r['mode']} | {r['setting']} | "
            f"{r['tok_s_unpruned']:.1f} | {r['tok_s_pruned']:.1f} | {r['ratio']:.2f}x "
            f"({r['ratio_min']:.2f}-{r['ratio_max']:.2f}, {r['runs']}) | {r['bound']:.2f}x | "
            f"{r['share']:.0%} |"
        )
    return "\n".join(lines)


def run_grid(
    arch: str,
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
    out.mkdir(parents=True, exist_ok=True)
    path = out / "decode.json"
    rows = json.loads(path.read_text())["rows"] if path.exists() else []
    where = torch.cuda.get_device_name() if cuda else machine()
    print(f"machine: {where}")
    for n_visual in visual:
        model = ARCHS[arch][0](n_visual).to(device=device, dtype=dtype)
        for batch in batches:
            inputs = batch_inputs(arch, model, n_visual, batch, device, dtype)
            for mode in modes:
                for key in settings:
                    setting = SETTINGS[key]
                    timing = measure(model, inputs, setting, mode, steps, pairs, cuda)
                    tokens = batch * (steps - 1)
                    prompt = inputs["input_ids"].shape[1]
                    bound = bytes_bound(model, batch, prompt, n_visual, setting, mode, steps)
                    row = {
                        "arch": arch,
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
                    rows = [r for r in rows if _key(r) != _key(row)] + [row]
                    path.write_text(json.dumps({"rows": rows}, indent=1))
                    print(markdown([row]).splitlines()[-1], flush=True)
    write_table(out, {arch: model})
    return rows


def write_table(out: Path, models: dict | None = None) -> None:
    """``decode.md`` from every row of ``decode.json``, bounds computed by :func:`bytes_bound`
    (``models``: the models already built, per architecture)."""
    models = dict(models or {})
    path = out / "decode.json"
    rows = json.loads(path.read_text())["rows"]
    names = {s.name: s for s in SETTINGS.values()}
    for row in rows:
        setting = names[row["setting"]]
        arch = _arch(row)
        if arch not in models:
            models[arch] = ARCHS[arch][0](row["visual"])  # the text model: the same at any
        row["bound"] = bytes_bound(
            models[arch],
            row["batch"],
            row["prompt"],
            row["visual"],
            setting,
            row["mode"],
            row["steps"],
        )
        row["share"] = row["ratio"] / row["bound"]
    path.write_text(json.dumps({"rows": rows}, indent=1))
    (out / "decode.md").write_text(
        "Decode tokens/s, pruned vs unpruned (`python benchmarks/decode.py`), on "
        f"{', '.join(sorted({r['machine'] for r in rows}))}.\n\n" + markdown(rows) + "\n"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--arch", choices=list(ARCHS), default="qwen2_5_vl")
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
    run_grid(
        args.arch,
        args.visual,
        args.batch,
        args.modes,
        args.settings,
        args.pairs,
        args.steps,
        args.out,
    )


if __name__ == "__main__":
    main()
