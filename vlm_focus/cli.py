"""``vlm-focus``: run | bench | organism | eval | demo."""

from __future__ import annotations

import argparse
import json
import sys

from .config import QUERIES, REDUCTIONS


def _keep(text: str) -> float | int:
    value = float(text)
    return int(value) if value > 1 or (value == 1 and "." not in text) else value


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="model path or hub id (default: embedded)")
    p.add_argument("--image", default=None, help="image file (default: a bundled sample scene)")
    p.add_argument("--prompt", default=None, help="question or instruction")
    p.add_argument("--device", default="cpu")
    p.add_argument("--attn", default="sdpa", choices=["sdpa", "eager", "flash_attention_2"])
    p.add_argument("--trust-remote-code", action="store_true", help="allow model repo code")


def _add_prune_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--pruner", default="fastv")
    p.add_argument("--keep", type=_keep, default=0.25, help="ratio in (0, 1] or a count")
    p.add_argument("--layer", type=int, default=0, help="0 = before the first decoder layer")
    p.add_argument("--query", default="text", choices=QUERIES)
    p.add_argument("--reduce", default="mean", choices=REDUCTIONS)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="vlm-focus", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="answer one prompt about one image, pruned and unpruned")
    _add_model_args(run)
    _add_prune_args(run)
    run.add_argument("--max-new-tokens", type=int, default=16)
    run.add_argument("--json", action="store_true", help="print one JSON object")
    bench = sub.add_parser("bench", help="prefill time pruned vs unpruned on one input")
    _add_model_args(bench)
    _add_prune_args(bench)
    bench.add_argument("--keeps", default="1.0,0.5,0.25,0.11")
    bench.add_argument("--repeats", type=int, default=5)
    for name, help_text in [
        ("organism", "train or evaluate the embedded organism models"),
        ("eval", "POPE, COCO grounding and CHAIR evaluation"),
        ("demo", "Gradio grounding demo"),
    ]:
        sub.add_parser(name, help=help_text, add_help=False)
    return p


_DELEGATES = {
    "organism": "vlm_focus.organism.cli",
    "eval": "vlm_focus.eval.cli",
    "demo": "vlm_focus.demo.app",
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in _DELEGATES:
        import importlib

        try:
            module = importlib.import_module(_DELEGATES[argv[0]])
        except ModuleNotFoundError as err:
            print(f"vlm-focus {argv[0]}: not available in this install ({err})", file=sys.stderr)
            return 2
        return int(module.main(argv[1:]) or 0)
    args = _parser().parse_args(argv)
    try:
        if args.command == "run":
            return _run(args)
        return _bench(args)
    except (ValueError, TypeError, FileNotFoundError) as err:
        print(f"vlm-focus {args.command}: error: {err}", file=sys.stderr)
        return 2


def _load(args: argparse.Namespace):
    from .loading import build_inputs, load_image, load_model

    model, processor = load_model(
        args.model,
        device=args.device,
        attn_implementation=args.attn,
        trust_remote_code=args.trust_remote_code,
    )
    image_path, prompt = args.image, args.prompt
    if image_path is None or prompt is None:
        from .organism import sample_scene_paths
        from .organism.vocab import CAPTION_PROMPT

        scenes = sample_scene_paths()
        image_path = image_path or (scenes[0] if scenes else None)
        prompt = prompt or CAPTION_PROMPT
    if image_path is None:
        raise ValueError("no --image given and no bundled sample scene found")
    inputs = build_inputs(processor, load_image(image_path), prompt)
    inputs = {k: v.to(args.device) if hasattr(v, "to") else v for k, v in inputs.items()}
    return model, processor, inputs, str(image_path), prompt


def _wrap(model, args, keep):
    import vlm_focus as vf

    return vf.wrap(
        model,
        pruner=args.pruner,
        keep=keep,
        layer=args.layer,
        query=args.query,
        reduce=args.reduce,
    )


def _run(args: argparse.Namespace) -> int:
    import torch

    from .loading import decode_new_tokens
    from .timing import median_seconds, prefill_fn

    model, processor, inputs, image, prompt = _load(args)
    generate = dict(max_new_tokens=args.max_new_tokens, do_sample=False)
    with torch.inference_mode():
        full = decode_new_tokens(processor, inputs, model.generate(**inputs, **generate))[0]
        t_full = median_seconds(prefill_fn(model, inputs))
        with _wrap(model, args, args.keep) as handle:
            pruned = decode_new_tokens(processor, inputs, model.generate(**inputs, **generate))[0]
            t_pruned = median_seconds(prefill_fn(model, inputs))
    trace = handle.last_trace
    report = {
        "model": model.config.model_type,
        "image": image,
        "prompt": prompt,
        "answer_unpruned": full,
        "answer_pruned": pruned,
        "pruner": args.pruner,
        "keep": args.keep,
        "layer": args.layer,
        "visual_kept": trace.n_kept[0],
        "visual_total": trace.n_visual[0],
        "prefill_ms_unpruned": round(t_full * 1e3, 2),
        "prefill_ms_pruned": round(t_pruned * 1e3, 2),
        "prefill_speedup": round(t_full / t_pruned, 2),
    }
    if args.json:
        print(json.dumps(report))
        return 0
    print(f"model     {report['model']}   image {image}")
    print(f"prompt    {prompt}")
    print(f"unpruned  {full}")
    print(f"pruned    {pruned}   ({args.pruner}, keep={args.keep}, layer={args.layer})")
    print(f"visual tokens kept {trace.n_kept[0]}/{trace.n_visual[0]}")
    print(
        f"prefill   {report['prefill_ms_unpruned']} ms -> {report['prefill_ms_pruned']} ms "
        f"({report['prefill_speedup']}x, median of 5, same run, {args.device})"
    )
    return 0


def _bench(args: argparse.Namespace) -> int:
    from .timing import median_seconds, prefill_fn

    model, _, inputs, _, _ = _load(args)
    keeps = [_keep(k) for k in args.keeps.split(",")]
    base = median_seconds(prefill_fn(model, inputs), repeats=args.repeats)
    print(f"unpruned prefill {base * 1e3:.2f} ms ({args.device}, median of {args.repeats})")
    for keep in keeps:
        with _wrap(model, args, keep) as handle:
            t = median_seconds(prefill_fn(model, inputs), repeats=args.repeats)
        trace = handle.last_trace
        print(
            f"keep={keep:<5} kept {trace.n_kept[0]:>4}/{trace.n_visual[0]:<4} "
            f"prefill {t * 1e3:8.2f} ms  speedup {base / t:5.2f}x"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
