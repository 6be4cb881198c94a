"""``vlm-focus eval pope``: answer POPE questions under one setting or a pruning sweep."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from .cli import load, load_guide, model_tag, write_json
from .data import resolve_set, split_missing
from .generation import Generator, Setting
from .metrics import PARSE_RULE, parse_yes_no
from .pope import (
    LLAVA_SUFFIX,
    SPLITS,
    build_questions,
    read_questions,
    running_metric,
    summarise,
    write_questions,
)
from .runner import process_state, run_items
from .tables import write_table

TABLE_COLUMNS = (
    "split", "setting", "pruner", "keep", "mitigate", "n", "accuracy", "precision", "recall", "f1",
    "yes_ratio", "unparseable", "visual_kept", "visual_total", "prefill_ms", "tokens_per_s",
)  # fmt: skip


def parse_sweep(sweep: str | None, pruners: str | None, args: argparse.Namespace) -> list[Setting]:
    """The settings of a run: one, or unpruned + every (pruner, keep < 1) of a sweep."""
    import vlm_focus as vf

    common = dict(
        layer=args.layer,
        query=args.query,
        mitigate=args.mitigate,
        max_new_tokens=args.max_new_tokens,
    )
    if sweep is None:
        if pruners is not None:
            raise ValueError("--pruners needs --sweep keep=...")
        if args.pruner is None:
            return [Setting(**common)]
        return [Setting(pruner=args.pruner, keep=args.keep, **common)]
    name, _, values = sweep.partition("=")
    if name.strip() != "keep" or not values:
        raise ValueError(f"--sweep {sweep!r}: expected keep=v1,v2,... (e.g. keep=1.0,0.5,0.25)")
    from .cli import _keep

    keeps = [_keep(v) for v in values.split(",") if v.strip()]
    if pruners in (None, ""):
        names = [args.pruner or "fastv"]
    elif pruners == "all":
        names = vf.pruners()
    else:
        names = [n.strip() for n in pruners.split(",") if n.strip()]
    known = set(vf.pruners())
    for n in names:
        if n not in known:
            raise ValueError(f"unknown pruner {n!r}; registered: {', '.join(sorted(known))}")
    settings = [Setting(**common)]
    settings += [Setting(pruner=n, keep=k, **common) for n in names for k in keeps if k != 1.0]
    return settings


def question_sets(args: argparse.Namespace, state: Any) -> tuple[Path, dict[str, list[dict]], str]:
    """(image folder, questions per split, description of their source)."""
    if args.questions:
        if args.images is None:
            images_dir = resolve_set(args, state).images_dir
        else:
            images_dir = args.images
            if not Path(images_dir).is_dir():
                raise FileNotFoundError(f"image directory not found: {images_dir}")
        sets = {}
        for path in args.questions:
            split = next((s for s in SPLITS if s in path.stem), path.stem)
            sets[split] = read_questions(path)
        return Path(images_dir), sets, "files: " + ", ".join(str(p) for p in args.questions)
    cocoset = resolve_set(args, state)
    splits = SPLITS if args.split == "all" else (args.split,)
    sets = {}
    folder = args.out / "pope" / "questions" / f"{cocoset.name}-n{args.n_images}-seed{args.seed}"
    for split in splits:
        rows = build_questions(cocoset.instances, split, n_images=args.n_images, seed=args.seed)
        if state.is_main_process:
            write_questions(rows, folder / f"pope_{split}.jsonl")
        sets[split] = rows
    source = (
        f"built from {cocoset.instances_path} by the POPE rules (n_images={args.n_images}, "
        f"3 positive + 3 negative per image, seed={args.seed}); copies in {folder}"
    )
    return cocoset.images_dir, sets, source


def run_pope(args: argparse.Namespace) -> list[dict]:
    """Run every (setting, split); returns the summary rows (also written as json/md/csv)."""
    state = process_state()
    settings = parse_sweep(args.sweep, args.pruners, args)
    images_dir, splits, source = question_sets(args, state)
    suffix = LLAVA_SUFFIX if args.suffix is None else args.suffix
    sets = {"_images": images_dir, "_suffix": suffix, "_source": source, "splits": splits}
    model, processor = load(args, state)
    guide = (None, None)
    root = args.out / "pope" / model_tag(args.model)
    summaries: list[dict] = []
    failed: list[str] = []
    for setting in settings:
        try:
            if setting.pruned and setting.pruner == "guided" and guide[0] is None:
                guide = load_guide(args, state)
            summaries += _run_setting(args, state, model, processor, guide, setting, sets, root)
        except (ValueError, FileNotFoundError, RuntimeError) as err:
            if not args.sweep:
                raise
            failed.append(setting.tag)  # one pruner's failure does not stop a sweep
            print(f"pope {setting.tag}: skipped: {err}", file=sys.stderr)
    if state.is_main_process and summaries:
        write_table(summaries, TABLE_COLUMNS, root / "table")
        if args.sweep:
            from .plots import retention_plot

            retention_plot(summaries, root / "retention.png", metric="f1")
        if failed:
            write_json(root / "failed.json", failed)
        print(f"results in {root}", file=sys.stderr)
    return summaries


def _run_setting(args, state, model, processor, guide, setting, sets, root) -> list[dict]:
    """Every split of one setting; the main process returns their summaries."""
    images_dir, suffix, source = sets["_images"], sets["_suffix"], sets["_source"]
    generator = Generator(model, processor, setting, guide=guide[0], guide_processor=guide[1])
    summaries = []
    for split, rows in sets["splits"].items():
        rows = rows[: args.limit] if args.limit else rows
        for r in rows:
            r["image_path"] = str(Path(images_dir) / r["image"])
        present, missing = split_missing(rows, _Folder(images_dir), args.on_missing)

        def process(batch: list[dict], generator=generator) -> list[dict]:
            images = [r["image_path"] for r in batch]
            texts, facts = generator(images, [r["text"] + suffix for r in batch])
            out = []
            for r, text, fact in zip(batch, texts, facts, strict=True):
                pred, parseable = parse_yes_no(text)
                out.append(
                    {
                        "question_id": r["question_id"],
                        "image": r["image"],
                        "question": r["text"],
                        "label": r["label"],
                        "answer": text,
                        "pred": pred,
                        "parseable": parseable,
                        **fact,
                    }
                )
            return out

        records = run_items(
            present,
            process,
            root / split / f"{setting.tag}.jsonl",
            key="question_id",
            batch_size=args.batch_size,
            state=state,
            desc=f"pope {split} {setting.tag}",
            metric=running_metric,
            config={
                "model": args.model or "embedded",
                **setting.describe(),
                "prompt_suffix": suffix,
                "questions": source,
            },
        )
        if not state.is_main_process:
            continue
        summary = {
            "split": split,
            "setting": setting.tag,
            **setting.describe(),
            **summarise(records),
            "n_missing_images": len(missing),
            "model": args.model or "embedded",
            "prompt_suffix": suffix,
            "parse_rule": PARSE_RULE,
            "questions": source,
            "yes_ratio_of": "predictions",
            "processes": state.num_processes,
        }
        write_json(root / split / f"{setting.tag}.json", summary)
        summaries.append(summary)
        _print(summary)
    return summaries


class _Folder:
    """Minimal stand-in with ``images_dir`` for :func:`split_missing`."""

    def __init__(self, images_dir: Path) -> None:
        self.images_dir = Path(images_dir)


def _print(s: dict) -> None:
    print(
        f"pope {s['split']:<11} {s['setting']:<22} acc {s['accuracy']:.4f} f1 {s['f1']:.4f} "
        f"yes {s['yes_ratio']:.3f} unparseable {s['unparseable']} kept "
        f"{s['visual_kept']:.0f}/{s['visual_total']:.0f} prefill {s['prefill_ms']:.1f} ms",
        file=sys.stderr,
    )
