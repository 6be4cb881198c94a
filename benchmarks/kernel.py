"""Fused Triton score-and-select against its torch twin and FastV-style eager scoring, on a GPU.

Shapes: LLaVA-1.5-7B attention (32 heads, head_dim 128, no GQA), batch 1, S of about 600 (576
image tokens + prompt), 2,900 (LLaVA-NeXT, 2,880 image tokens) and 11,000, with Tq = 1 (the last
query, FastV) and Tq = 32 (a text span). Methods, all producing per-key scores and the sorted top
25% of the visual keys:

1. ``triton``: the fused kernel (``vlm_focus.kernels._triton``), arguments already checked.
2. ``twin``: the pure-torch twin (``vlm_focus.kernels.naive``), same arguments.
3. ``fastv``: what FastV does under eager attention: the full ``[B, H, S, S]`` attention
   (``softmax(Q K^T + causal)``, fp32 softmax cast back to the model dtype) is materialised, its
   last Tq rows are averaged over heads and queries, then ``topk`` and ``sort``.

Reported per shape: median time per call over CUDA events; GPU time per call from CUDA-graph
replay (no Python or launch overhead); the kernel's achieved bandwidth, i.e. the bytes the design
must move (keys read twice, once per pass, plus queries, masks and outputs) over its GPU time,
against the H200's ~4.8 TB/s (``--peak-tbs``); peak extra memory of each method; the speedups
twin/triton and fastv/triton; the largest score difference triton vs twin. Goals (printed as
met/MISSED): >= 5x faster than the twin at S = 2,900; >= 60% of peak bandwidth at S = 11,000;
kernel memory O(B*H*Tq + S).

    python benchmarks/kernel.py [--dtype bf16] [--reps 50] [--out benchmarks/results]
                                [--no-breakdown] [--sweep]

Under each row, the GPU time of each of the three kernels (torch profiler) and the bandwidth of
the two streaming passes alone (``--no-breakdown`` skips this). ``--sweep`` also times a few
launch shapes (tile size, warps, pipeline stages, S splits) per shape, checks each against the
twin and prints the fastest, to tune ``_plan``. Without a CUDA device the script says so and
exits 0.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch

SHAPES = [(600, 1), (600, 32), (2900, 1), (2900, 32), (11000, 1), (11000, 32)]
HEADS, KV_HEADS, HEAD_DIM = 32, 32, 128  # LLaVA-1.5-7B (Llama-2-7B)
SYSTEM, KEEP = 35, 0.25  # tokens before the image; share of visual tokens kept
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
DEVICE = "cuda"


def make_case(seq: int, n_query: int, batch: int, dtype: torch.dtype, seed: int = 0) -> dict:
    """q for every position (FastV needs them all), keys, and the checked op arguments."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    q_full = torch.randn(batch, HEADS, seq, HEAD_DIM, device=DEVICE, generator=gen, dtype=dtype)
    k = torch.randn(batch, KV_HEADS, seq, HEAD_DIM, device=DEVICE, generator=gen, dtype=dtype)
    visual = torch.zeros(batch, seq, dtype=torch.bool, device=DEVICE)
    n_text = max(24, n_query)
    visual[:, SYSTEM : seq - n_text] = True
    n_visual = int(visual[0].sum())
    args = dict(
        q=q_full[:, :, seq - n_query :].contiguous(),  # [B, H, Tq, D]
        k=k,
        visual=visual,
        n_keep=max(1, int(KEEP * n_visual)),
        scaling=HEAD_DIM**-0.5,
        key_mask=torch.ones(batch, seq, dtype=torch.bool, device=DEVICE),
        query_pos=torch.arange(seq - n_query, seq, device=DEVICE).repeat(batch, 1),
        query_weights=torch.full((batch, n_query), 1.0 / n_query, device=DEVICE),
        reduce="mean",
        debias=None,
    )
    return dict(args=args, q_full=q_full)


def fastv_eager(case: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """FastV under eager attention: materialise [B, H, S, S], average the last rows, top-k."""
    args, q_full = case["args"], case["q_full"]
    k, visual, n_query = args["k"], args["visual"], args["q"].shape[2]
    seq = k.shape[2]
    logits = torch.matmul(q_full, k.transpose(-1, -2)) * args["scaling"]  # [B, H, S, S]
    causal = torch.ones(seq, seq, dtype=torch.bool, device=k.device).triu(1)
    logits = logits.masked_fill(causal, float("-inf"))
    attn = torch.softmax(logits, dim=-1, dtype=torch.float32).to(k.dtype)  # eager attention
    scores = attn[:, :, seq - n_query :].float().mean(dim=(1, 2))  # [B, S]
    scores = scores.masked_fill(~visual, 0.0)
    ranked = scores.masked_fill(~visual, float("-inf"))
    kept = ranked.topk(args["n_keep"], dim=-1).indices.sort(dim=-1).values
    return scores, kept


def median_ms(fn: Callable[[], object], reps: int, warmup: int = 5) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def graph_us(fn: Callable[[], object], reps: int) -> float | None:
    """Mean GPU time of one call replayed from a CUDA graph: no Python or launch overhead."""
    try:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(3):
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        graph.replay()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            graph.replay()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) * 1e3 / reps
    except RuntimeError as err:  # an op that cannot be captured
        print(f"    (no CUDA graph: {type(err).__name__}: {str(err)[:80]})")
        return None


def kernel_breakdown_us(fn: Callable[[], object], reps: int) -> dict[str, float]:
    """Mean GPU time per call of each Triton kernel, from the torch profiler."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    out = {}
    for event in prof.key_averages():
        for name in ("_lse_kernel", "_score_kernel", "_select_kernel"):
            if name in event.key:
                total = getattr(event, "device_time_total", None)
                if total is None:
                    total = event.cuda_time_total
                out[name] = out.get(name, 0.0) + total / reps
    return out


def peak_extra_mib(fn: Callable[[], object]) -> float:
    """Peak memory allocated by one call beyond what was allocated before it."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def kernel_bytes(args: dict) -> int:
    """Bytes the two-pass design must move: keys twice, queries twice, masks, outputs."""
    q, k = args["q"], args["k"]
    batch, seq = k.shape[0], k.shape[2]
    keys = k.numel() * k.element_size()
    queries = q.numel() * q.element_size()
    masks = 2 * batch * seq + args["query_pos"].numel() * 8 + args["query_weights"].numel() * 4
    outputs = batch * seq * 4 + batch * args["n_keep"] * 8
    return 2 * keys + 2 * queries + 2 * masks + outputs


def sweep(case: dict, reps: int) -> list[tuple[float, object]]:
    """Time a few launch shapes around the default plan; fastest first."""
    from vlm_focus.kernels import _triton as kt

    args = case["args"]
    base = kt._plan(args["q"], args["k"], args["reduce"])
    plans = {base}
    for block_n in (32, 64, 128):
        for num_warps in (4, 8):
            for num_stages in (2, 3, 4):
                for split_scale in (0.5, 1, 2):
                    plans.add(
                        dataclasses.replace(
                            base,
                            block_n=block_n,
                            num_warps=num_warps,
                            num_stages=num_stages,
                            n_split=max(1, int(base.n_split * split_scale)),
                            n_hparts=max(1, int(base.n_hparts * split_scale)),
                        )
                    )
    from vlm_focus.kernels.naive import score_and_select_naive

    ref, _ = score_and_select_naive(**args)
    timed = []
    for plan in plans:
        run = functools.partial(kt._launch, **args, plan=plan)
        try:
            scores, _ = run()
        except Exception as err:  # a shape the compiler rejects (registers, shared memory)
            print(f"    {plan}: failed ({type(err).__name__})")
            continue
        if not torch.allclose(scores, ref, atol=1e-5, rtol=1e-3):
            print(f"    {plan}: WRONG scores, excluded")
            continue
        timed.append((median_ms(run, reps, warmup=2), plan))
    return sorted(timed, key=lambda row: row[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--peak-tbs", type=float, default=4.8, help="peak HBM bandwidth, TB/s")
    parser.add_argument("--no-fastv", action="store_true", help="skip the O(S^2) eager baseline")
    parser.add_argument("--sweep", action="store_true", help="also time other launch shapes")
    parser.add_argument(
        "--no-breakdown", action="store_true", help="skip the per-kernel GPU times (profiler)"
    )
    parser.add_argument("--out", type=Path, default=None, help="folder for JSON (and PNG) results")
    opts = parser.parse_args()

    if not torch.cuda.is_available():
        print("benchmarks/kernel.py needs a CUDA GPU and found none; nothing was measured.")
        sys.exit(0)

    import triton

    from vlm_focus.kernels._triton import score_and_select_triton
    from vlm_focus.kernels.naive import score_and_select_naive

    dtype = DTYPES[opts.dtype]
    gpu = torch.cuda.get_device_name()
    header = (
        f"GPU: {gpu} | torch {torch.__version__} (CUDA {torch.version.cuda}) | "
        f"triton {triton.__version__} | {opts.dtype}, batch {opts.batch}, H={HEADS}, "
        f"D={HEAD_DIM}, median of {opts.reps} calls (CUDA events)"
    )
    print(header)
    print(
        "| S | Tq | triton ms | twin ms | fastv ms | twin/triton | fastv/triton "
        "| triton us (graph) | twin us (graph) | twin/triton (graph) | triton GB/s | % peak BW "
        "| peak MiB triton / twin / fastv | max |score diff| |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    rows = []
    for seq, n_query in SHAPES:
        case = make_case(seq, n_query, opts.batch, dtype)
        args = case["args"]
        fused = functools.partial(score_and_select_triton, **args)
        twin = functools.partial(score_and_select_naive, **args)
        fast = functools.partial(fastv_eager, case)
        scores, kept = fused()
        ref_scores, _ = twin()
        diff = float((scores - ref_scores).abs().max())
        row = dict(
            gpu=gpu,
            torch=torch.__version__,
            triton=triton.__version__,
            dtype=opts.dtype,
            batch=opts.batch,
            heads=HEADS,
            head_dim=HEAD_DIM,
            seq=seq,
            n_query=n_query,
            triton_ms=median_ms(fused, opts.reps),
            twin_ms=median_ms(twin, opts.reps),
            triton_graph_us=graph_us(fused, opts.reps),
            twin_graph_us=graph_us(twin, opts.reps),
            triton_mib=peak_extra_mib(fused),
            twin_mib=peak_extra_mib(twin),
            max_score_diff=diff,
        )
        row["fastv_ms"] = row["fastv_mib"] = None
        if not opts.no_fastv:
            try:
                row["fastv_ms"] = median_ms(fast, max(3, opts.reps // 10), warmup=1)
                row["fastv_mib"] = peak_extra_mib(fast)
            except torch.cuda.OutOfMemoryError:
                torch.cuda.empty_cache()
        # Bandwidth from pure GPU time (graph replay) when available, else from the eager call.
        gpu_s = (row["triton_graph_us"] or row["triton_ms"] * 1e3) * 1e-6
        row["triton_gbs"] = kernel_bytes(args) / gpu_s / 1e9
        row["bw_share"] = row["triton_gbs"] / (opts.peak_tbs * 1e3)
        rows.append(row)
        print(_table_row(row))
        if not opts.no_breakdown:
            parts = kernel_breakdown_us(fused, opts.reps)
            row["breakdown_us"] = parts
            passes_us = parts.get("_lse_kernel", 0.0) + parts.get("_score_kernel", 0.0)
            if passes_us > 0:
                keys = 2 * args["k"].numel() * args["k"].element_size()
                row["passes_bw_share"] = keys / (passes_us * 1e-6) / (opts.peak_tbs * 1e12)
            print(
                "    kernels (us): "
                + ", ".join(f"{k} {v:.1f}" for k, v in parts.items())
                + f"; passes read keys at {100 * row.get('passes_bw_share', 0):.0f}% of peak BW"
            )
        if opts.sweep:
            timed = sweep(case, max(10, opts.reps // 2))
            for ms, plan in timed[:3]:
                print(f"    sweep {seq}x{n_query}: {ms:.4f} ms  {plan}")
            row["sweep_best"] = [dict(ms=ms, plan=dataclasses.asdict(p)) for ms, p in timed[:3]]

    print()
    _print_goals(rows)
    if opts.out is not None:
        opts.out.mkdir(parents=True, exist_ok=True)
        tag = gpu.replace(" ", "_")
        path = opts.out / f"kernel_{tag}_{opts.dtype}.json"
        path.write_text(json.dumps(dict(header=header, rows=rows), indent=2))
        print(f"wrote {path}")
        _plot(rows, opts.out / f"kernel_{tag}_{opts.dtype}.png", header)


def _fmt(value: float | None, spec: str, missing: str = "-") -> str:
    return missing if value is None else format(value, spec)


def _table_row(row: dict) -> str:
    fastv_x = None if row["fastv_ms"] is None else row["fastv_ms"] / row["triton_ms"]
    graph_x = None
    if row["triton_graph_us"] and row["twin_graph_us"]:
        graph_x = row["twin_graph_us"] / row["triton_graph_us"]
    cells = [
        str(row["seq"]),
        str(row["n_query"]),
        f"{row['triton_ms']:.4f}",
        f"{row['twin_ms']:.4f}",
        _fmt(row["fastv_ms"], ".3f", "OOM/skipped"),
        f"{row['twin_ms'] / row['triton_ms']:.1f}x",
        _fmt(fastv_x, ".1f") + ("x" if fastv_x else ""),
        _fmt(row["triton_graph_us"], ".1f"),
        _fmt(row["twin_graph_us"], ".1f"),
        _fmt(graph_x, ".1f") + ("x" if graph_x else ""),
        f"{row['triton_gbs']:.0f}",
        f"{100 * row['bw_share']:.0f}%",
        f"{row['triton_mib']:.2f} / {row['twin_mib']:.1f} / {_fmt(row['fastv_mib'], '.1f')}",
        f"{row['max_score_diff']:.1e}",
    ]
    return "| " + " | ".join(cells) + " |"


def _print_goals(rows: list[dict]) -> None:
    """The kernel's three goals, met or MISSED, from this run's rows."""
    small = [r for r in rows if r["seq"] == 600]
    mid = [r for r in rows if r["seq"] == 2900]
    big = [r for r in rows if r["seq"] == 11000]
    if not (small and mid and big):
        return
    speed = min(r["twin_ms"] / r["triton_ms"] for r in mid)
    graph = [r["twin_graph_us"] / r["triton_graph_us"] for r in mid if r["triton_graph_us"]]
    graph_note = f" (GPU time only: {min(graph):.1f}x)" if graph and all(graph) else ""
    share = max(r["bw_share"] for r in big)
    growth = max(r["triton_mib"] for r in big) / max(1e-9, max(r["triton_mib"] for r in small))
    print(
        f"goal >= 5x vs twin at S=2900 (worst Tq, per call): {speed:.1f}x{graph_note} "
        f"-> {_met(speed >= 5)}"
    )
    passes = [r["passes_bw_share"] for r in big if r.get("passes_bw_share")]
    passes_note = f" (the two passes alone: {100 * max(passes):.0f}%)" if passes else ""
    print(
        f"goal >= 60% of peak bandwidth at S=11000 (best Tq, GPU time of the whole op): "
        f"{100 * share:.0f}%{passes_note} -> {_met(share >= 0.6)}"
    )
    print(
        f"memory: kernel peak grows {growth:.1f}x from S=600 to S=11000 (S grows 18x; "
        f"O(S^2) would be 336x) -> {_met(growth < 40)}"
    )


def _met(ok: bool) -> str:
    return "met" if ok else "MISSED"


def _plot(rows: list[dict], path: Path, title: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return
    labels = [f"S={r['seq']}\nTq={r['n_query']}" for r in rows]
    xs = range(len(rows))
    fig, ax = plt.subplots(figsize=(9, 4))
    methods = (("triton_ms", "triton"), ("twin_ms", "twin"), ("fastv_ms", "fastv eager"))
    for i, (key, name) in enumerate(methods):
        heights = [r[key] or 0 for r in rows]  # 0: fastv skipped or out of memory
        ax.bar([x + 0.27 * (i - 1) for x in xs], heights, width=0.26, label=name, log=True)
    ax.set_xticks(list(xs), labels)
    ax.set_ylabel("ms per call (log)")
    ax.set_title(title, fontsize=7)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
