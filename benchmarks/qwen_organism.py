"""Pruning, video budgets, the temporal pruner, fixation and grounding on organism-qwen.

organism-qwen is a Qwen2.5-VL at dynamic resolution (images of 5 x 6 to 10 x 10 tokens, clips of
4 temporal patches of 7 x 7), so it measures what the LLaVA organisms' one fixed grid cannot:

- ``pruners``: every registered pruner at layer 0 and K = 2, keeps 0.5 / 0.25 / 0.11, on held-out
  images of mixed sizes and aspect ratios: presence (one yes and one no per image, half the no's
  hard) and relation questions. Retention = pruned accuracy / unpruned accuracy, same questions,
  same run.
- ``video``: held-out clip questions that need time (which object appears first; is an object
  there at the start / end), under ``budget="span"`` and ``"frame"`` for the attention pruners,
  and the ``temporal`` pruner (``mode`` uniform and dedup) against ``random``, at layer 0 and
  K = 2; the budgets also per question kind.
- ``first``: "which object appears first" alone, budget ``"frame"``: accuracy and the share of
  the first object's start-patch tokens, other object tokens and background each pruner keeps,
  and fastv with those start-patch tokens forced in (:class:`FirstObjectOracle`).
- ``fixation``: video captions (the objects in order of appearance) with decode-time
  ``fixation`` against prefill ``fastv`` and ``random`` at the same keeps and layer: object
  precision, recall and exact order.
- ``grounding``: ``vf.ground``'s point for the asked category on held-out non-square images,
  through the real processor: hit when the point lies inside the object's mask.

Every answer is greedy through the model's chat template (``vf.wrap`` on the unmodified model,
``model.generate``), the first word scored.

    python benchmarks/qwen_organism.py --out benchmarks/results        # all five parts
    python benchmarks/qwen_organism.py --parts video --images 100 --clips 60

Writes ``qwen_organism.json`` and ``qwen_organism.md`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import ClassVar

import numpy as np
import torch
from PIL import Image
from tqdm import tqdm

import vlm_focus as vf
from organism import qwen_data as q
from organism import qwen_model_path
from organism.questions import relation_qa
from organism.qwen_eval import (
    CAPTION_TOKENS,
    QUESTION_SEED,
    caption_metrics,
    first_word,
    heldout_clips,
    heldout_images,
)
from vlm_focus import FocusConfig, grounding
from vlm_focus.loading import load_model
from vlm_focus.pruners import Pruner, Selection, pruners, register_pruner

KEEPS = (0.5, 0.25, 0.11)
LAYERS = (0, 2)
ATTENTION_PRUNERS = ("fastv", "text", "debiased", "diverse", "pool", "random")
VIDEO_KINDS = ("first", "start", "end")
BATCH = 24


# ---- questions ------------------------------------------------------------------------------


def image_questions(n: int) -> list[tuple[q.CroppedScene, str, str]]:
    """(image, question, answer): per held-out image a yes and a no presence question, and a
    relation question where one is clear."""
    rng = np.random.default_rng(QUESTION_SEED)
    out = []
    for crop in heldout_images(n):
        for qa in q.presence_pair(crop, rng):
            out.append((crop, qa.question, qa.answer))
        rel = relation_qa(crop.scene, rng)
        if rel is not None:
            out.append((crop, rel.question, rel.answer))
    return out


def video_questions(n: int, kinds=VIDEO_KINDS) -> list[tuple[q.Clip, str, str, str]]:
    """(clip, question, answer, kind) for `n` held-out clips, the kinds in turn."""
    rng = np.random.default_rng(QUESTION_SEED + 1)
    out = []
    for i, clip in enumerate(heldout_clips(n)):
        kind = kinds[i % len(kinds)]
        qa = q.video_qa(clip, rng, kind)
        out.append((clip, qa.question, qa.answer, kind))
    return out


# ---- greedy answers under a setting ----------------------------------------------------------


@torch.no_grad()
def generate(model, processor, rows, focus: FocusConfig | None, new_tokens: int = 2) -> list[str]:
    """Greedy answers to `rows` ((medium, question, ...)), pruned by `focus` if given."""
    handle = vf.wrap(model, focus) if focus is not None else None
    try:
        return [
            answer
            for i in range(0, len(rows), BATCH)
            for answer in _answers(model, processor, rows[i : i + BATCH], new_tokens)
        ]
    finally:
        if handle is not None:
            handle.remove()


@torch.no_grad()
def _answers(model, processor, chunk, new_tokens: int = 2) -> list[str]:
    """Greedy answers to one batch of rows, through the model as it is now."""
    video = isinstance(chunk[0][0], q.Clip)
    inputs = processor(
        text=[q.chat_text(processor, video, row[1]) for row in chunk],
        padding=True,
        return_tensors="pt",
        **q.media_inputs(*(row[0] for row in chunk)),
    )
    gen = model.generate(**inputs, max_new_tokens=new_tokens, do_sample=False)
    return processor.batch_decode(gen[:, inputs["input_ids"].shape[1] :], skip_special_tokens=True)


def accuracy(answers: list[str], rows) -> float:
    return float(np.mean([first_word(a) == row[2] for a, row in zip(answers, rows, strict=True)]))


def kind_accuracy(answers: list[str], rows) -> dict[str, float]:
    """Accuracy over all `rows` (``"all"``) and per question kind (each row's 4th field)."""
    right = [first_word(a) == row[2] for a, row in zip(answers, rows, strict=True)]
    out = {"all": float(np.mean(right))}
    for kind in dict.fromkeys(row[3] for row in rows):
        out[kind] = float(np.mean([r for r, row in zip(right, rows) if row[3] == kind]))
    return out


def scored(model, processor, rows, focus: FocusConfig, score=None, new_tokens: int = 2):
    """`score(answers, rows)` (default: :func:`accuracy`) of the greedy answers under `focus`,
    or the refusal's message when `vf.wrap` refuses the setting."""
    try:
        answers = generate(model, processor, rows, focus, new_tokens)
    except (ValueError, NotImplementedError) as err:
        return str(err).splitlines()[0]
    return (score or accuracy)(answers, rows)


# ---- the four parts --------------------------------------------------------------------------


def pruner_table(model, processor, n_images: int) -> dict:
    rows = image_questions(n_images)
    base = accuracy(generate(model, processor, rows, None), rows)
    table: dict = {"unpruned": base, "questions": len(rows), "rows": []}
    names = [p for p in pruners() if p != FirstObjectOracle.name]
    settings = [(p, layer, keep) for p in names for layer in LAYERS for keep in KEEPS]
    for pruner, layer, keep in tqdm(settings, desc="pruners"):
        options = {"options": {"mode": "uniform"}} if pruner == "temporal" else {}
        focus = FocusConfig(pruner=pruner, keep=keep, layer=layer, **options, video_pruner=None)
        result = scored(model, processor, rows, focus)
        table["rows"].append({"pruner": pruner, "layer": layer, "keep": keep, "accuracy": result})
    return table


def video_table(model, processor, n_clips: int) -> dict:
    rows = video_questions(n_clips)
    kinds = kind_accuracy(generate(model, processor, rows, None), rows)
    table: dict = {
        "unpruned": kinds["all"],
        "unpruned_kinds": kinds,
        "questions": len(rows),
        "budgets": [],
        "temporal": [],
    }
    settings = [
        (p, b, k, layer)
        for layer in LAYERS
        for p in ATTENTION_PRUNERS
        for b in ("span", "frame")
        for k in KEEPS
    ]
    for pruner, budget, keep, layer in tqdm(settings, desc="video budgets"):
        focus = FocusConfig(pruner=pruner, keep=keep, layer=layer, budget=budget, video_pruner=None)
        kinds = scored(model, processor, rows, focus, kind_accuracy)
        result = kinds if isinstance(kinds, str) else kinds["all"]
        table["budgets"].append(
            {
                "pruner": pruner,
                "budget": budget,
                "keep": keep,
                "layer": layer,
                "accuracy": result,
                "kinds": kinds,
            }
        )
    # whole temporal patches: keep 0.5 leaves 2 of 4, 0.25 leaves 1
    settings = [
        (name, keep, layer)
        for layer in LAYERS
        for name in ("uniform", "dedup", "random")
        for keep in (0.75, 0.5, 0.25)
    ]
    for name, keep, layer in tqdm(settings, desc="temporal"):
        pruner = "random" if name == "random" else "temporal"
        options = {} if name == "random" else {"options": {"mode": name}}
        focus = FocusConfig(pruner=pruner, keep=keep, layer=layer, **options, video_pruner=None)
        result = scored(model, processor, rows, focus)
        table["temporal"].append(
            {"setting": name, "keep": keep, "layer": layer, "accuracy": result}
        )
    return table


class FirstObjectOracle(Pruner):
    """fastv's scores, except that the first object's tokens in its start patch always rank
    first: an oracle (it reads the clip's ground truth) that tests whether those tokens are
    what fastv's selection misses. :attr:`forced` holds, per row of the batch, a bool per
    visual token; a row's visual tokens are in the tower's order."""

    name = "first_object_oracle"
    attention_based = True
    forced: ClassVar[list[np.ndarray]] = []

    def select(self, ctx, n_keep: int) -> Selection:
        scores = ctx.attention_scores(n_keep).scores.float()
        for b, forced in enumerate(self.forced):
            at = ctx.visual[b].nonzero()[:, 0][torch.from_numpy(forced).to(scores.device)]
            scores[b, at] += scores[b].abs().max() + 1.0
        return Selection(scores=scores)


def _token_groups(clip: q.Clip) -> dict[str, np.ndarray]:
    """Bool per visual token: the first object's tokens in its start patch, every other
    object token, background."""
    labels = q.vision_labels(clip)
    patch = np.arange(len(labels)) // (len(labels) // q.GROUPS)
    first = clip.first()
    start = (labels == first.category + 1) & (patch == first.start)
    return {"first_start": start, "other_objects": (labels > 0) & ~start, "background": labels == 0}


def first_object_table(model, processor, n_clips: int, keeps=KEEPS) -> dict:
    """ "Which object appears first" on `n_clips` held-out clips, budget "frame": accuracy and
    the share of each token group kept, per pruner, layer and keep; the oracle forces the first
    object's start-patch tokens into fastv's kept set."""
    rows = video_questions(n_clips, kinds=("first",))
    groups = [_token_groups(row[0]) for row in rows]
    base = accuracy(generate(model, processor, rows, None), rows)
    register_pruner(FirstObjectOracle, replace=True)
    table: dict = {"unpruned": base, "questions": len(rows), "rows": []}
    names = ("fastv", "text", "diverse", "random", FirstObjectOracle.name)
    settings = [(p, layer, k) for layer in LAYERS for p in names for k in keeps]
    for pruner, layer, keep in tqdm(settings, desc="first object"):
        focus = FocusConfig(
            pruner=pruner, keep=keep, layer=layer, budget="frame", video_pruner=None
        )
        answers, kept = [], {name: [] for name in groups[0]}
        with vf.wrap(model, focus) as handle:
            for i in range(0, len(rows), BATCH):
                chunk = rows[i : i + BATCH]
                FirstObjectOracle.forced = [g["first_start"] for g in groups[i : i + BATCH]]
                answers += _answers(model, processor, chunk)
                trace = handle.last_trace  # the prefill's kept sets
                for b, g in enumerate(groups[i : i + BATCH]):
                    is_kept = np.isin(trace.visual_positions[b].cpu(), trace.kept[b].cpu())
                    for name, members in g.items():
                        kept[name] += is_kept[members].tolist()
        table["rows"].append(
            {
                "pruner": pruner,
                "layer": layer,
                "keep": keep,
                "accuracy": accuracy(answers, rows),
                "kept": {name: float(np.mean(v)) for name, v in kept.items()},
            }
        )
    return table


def fixation_table(model, processor, n_clips: int, layer: int = 1) -> dict:
    clips = heldout_clips(n_clips)
    rows = [(c, q.VIDEO_CAPTION_PROMPT, q.video_caption(c)) for c in clips]
    unpruned = caption_metrics(generate(model, processor, rows, None, CAPTION_TOKENS), clips)
    table: dict = {"unpruned": unpruned, "layer": layer, "rows": []}
    for pruner in ("fixation", "fastv", "random"):
        for keep in (0.1, 0.2, 0.5):
            focus = FocusConfig(pruner=pruner, keep=keep, layer=layer, video_pruner=None)
            result = scored(
                model,
                processor,
                rows,
                focus,
                lambda answers, _: caption_metrics(answers, clips),
                CAPTION_TOKENS,
            )
            table["rows"].append({"pruner": pruner, "keep": keep, "scores": result})
    return table


def grounding_table(model, processor, n_images: int) -> dict:
    """Pointing game on non-square held-out images: the point of `vf.ground` for a present
    category inside that object's mask; chance = the object's share of the image."""
    hits, chance, other, said_yes = [], [], [], []
    crops = [c for c in heldout_images(2 * n_images) if c.box[2] != c.box[3]][:n_images]
    for crop in tqdm(crops, desc="grounding"):
        masks = crop.masks()
        for obj, mask in zip(crop.scene.objects, masks, strict=True):
            found = vf.ground(model, processor, Image.fromarray(crop.image()), obj.name)
            x, y = (int(v) for v in grounding.point(found.map))  # the peak, present or not
            said_yes.append(found.present)
            hits.append(bool(mask[min(y, mask.shape[0] - 1), min(x, mask.shape[1] - 1)]))
            others = [m for m in masks if m is not mask]
            other.append(any(m[min(y, m.shape[0] - 1), min(x, m.shape[1] - 1)] for m in others))
            chance.append(float(mask.mean()))
    return {
        "images": len(crops),
        "queries": len(hits),
        "hit": float(np.mean(hits)),
        "other_object": float(np.mean(other)),
        "chance": float(np.mean(chance)),
        "present": float(np.mean(said_yes)),
        "aspects": sorted({f"{c.box[2]}x{c.box[3]}" for c in crops}),
    }


# ---- report ----------------------------------------------------------------------------------


def _cell(value, base: float) -> str:
    if isinstance(value, str):
        return "refused"
    return f"{100 * value:.1f}% ({100 * value / base:.0f})" if base else f"{100 * value:.1f}%"


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def _row(label: str, cells: list[str]) -> str:
    return f"| {label} | " + " | ".join(cells) + " |"


def _pruner_lines(t: dict) -> list[str]:
    columns = [f"K={layer} keep {k}" for layer in LAYERS for k in KEEPS]
    lines = [
        f"## Pruners on images of mixed sizes ({t['questions']} questions)",
        "",
        f"Accuracy (retention % of unpruned); unpruned {_pct(t['unpruned'])}; greedy.",
        "",
        _row("pruner", columns),
        "|---|" + "---|" * len(columns),
    ]
    by = {(r["pruner"], r["layer"], r["keep"]): r["accuracy"] for r in t["rows"]}
    for p in sorted({r["pruner"] for r in t["rows"]}):
        lines.append(
            _row(p, [_cell(by[(p, lay, k)], t["unpruned"]) for lay in LAYERS for k in KEEPS])
        )
    refused = {r["pruner"]: r["accuracy"] for r in t["rows"] if isinstance(r["accuracy"], str)}
    return [*lines, "", *(f"- `{p}` refused: {msg}" for p, msg in refused.items()), ""]


def _video_lines(t: dict) -> list[str]:
    budgets = ("span", "frame")
    columns = [f"{b} keep {k}" for b in budgets for k in KEEPS]
    lines = [
        f"## Video: budgets and the temporal pruner ({t['questions']} clip questions)",
        "",
        f"Accuracy (retention % of unpruned); unpruned {_pct(t['unpruned'])}.",
    ]
    budget = {
        (r["pruner"], r["budget"], r["keep"], r["layer"]): r["accuracy"] for r in t["budgets"]
    }
    frames = {(r["setting"], r["keep"], r["layer"]): r["accuracy"] for r in t["temporal"]}
    keeps = sorted({r["keep"] for r in t["temporal"]}, reverse=True)
    for layer in sorted({r["layer"] for r in t["budgets"]}):
        lines += ["", f"Layer K = {layer}:", "", _row("pruner", columns)]
        lines.append("|---|" + "---|" * len(columns))
        for p in ATTENTION_PRUNERS:
            cells = [_cell(budget[(p, b, k, layer)], t["unpruned"]) for b in budgets for k in KEEPS]
            lines.append(_row(p, cells))
        lines += ["", _row("whole frames", [f"keep {k}" for k in keeps])]
        lines.append("|---|" + "---|" * len(keeps))
        for s in ("uniform", "dedup", "random"):
            label = "random (tokens)" if s == "random" else f"temporal {s}"
            lines.append(_row(label, [_cell(frames[(s, k, layer)], t["unpruned"]) for k in keeps]))
    return [*lines, "", *_kind_lines(t)]


def _kind_lines(t: dict) -> list[str]:
    """Per question kind, budget "frame": which questions pruning costs."""
    kinds = {
        (r["pruner"], r["layer"], r["keep"]): r["kinds"]
        for r in t["budgets"]
        if r["budget"] == "frame" and isinstance(r["kinds"], dict)
    }
    columns = [f"K={layer} keep {k}" for layer in LAYERS for k in KEEPS]

    def cell(accuracies: dict) -> str:
        return " / ".join(f"{100 * accuracies[kind]:.0f}" for kind in VIDEO_KINDS)

    lines = [
        f'By question kind, `budget="frame"`: accuracy % on {" / ".join(VIDEO_KINDS)}'
        f" (unpruned {cell(t['unpruned_kinds'])}).",
        "",
        _row("pruner", columns),
        "|---|" + "---|" * len(columns),
    ]
    for p in ATTENTION_PRUNERS:
        cells = [
            cell(kinds[(p, lay, k)]) if (p, lay, k) in kinds else "refused"
            for lay in LAYERS
            for k in KEEPS
        ]
        lines.append(_row(p, cells))
    return [*lines, ""]


def _first_object_lines(t: dict) -> list[str]:
    lines = [
        f"## Which object appears first: what the kept set misses ({t['questions']} questions)",
        "",
        f'Budget `"frame"`; unpruned {_pct(t["unpruned"])}. Share kept of the first object\'s'
        " tokens in its start patch, of every other object token and of the background."
        f" `{FirstObjectOracle.name}` is fastv with the first object's start-patch tokens ranked"
        " first in their frame (it reads the ground truth).",
        "",
        "| pruner | layer | keep | accuracy | first object, start patch | other objects"
        " | background |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in t["rows"]:
        kept = [_pct(r["kept"][g]) for g in ("first_start", "other_objects", "background")]
        lines.append(
            _row(r["pruner"], [str(r["layer"]), str(r["keep"]), _pct(r["accuracy"]), *kept])
        )
    return [*lines, ""]


def _caption_cells(scores) -> list[str]:
    if isinstance(scores, str):
        return [f"refused: {scores}", "", ""]
    return [_pct(scores[k]) for k in ("precision", "recall", "exact_order")]


def _fixation_lines(t: dict) -> list[str]:
    lines = [
        f"## Fixation on video captions (layer {t['layer']})",
        "",
        "| setting | keep | object precision | recall | exact order |",
        "|---|---|---|---|---|",
        _row("unpruned", ["1.0", *_caption_cells(t["unpruned"])]),
    ]
    lines += [_row(r["pruner"], [str(r["keep"]), *_caption_cells(r["scores"])]) for r in t["rows"]]
    return [*lines, ""]


def _grounding_lines(g: dict) -> list[str]:
    return [
        "## Grounding on non-square images (real processor)",
        "",
        f"{g['queries']} queries on {g['images']} images ({len(g['aspects'])} sizes): the point"
        f" of `vf.ground` lies in the asked object's mask {_pct(g['hit'])} of the time, in another"
        f" object's {_pct(g['other_object'])} (chance: the object's share of the image,"
        f" {_pct(g['chance'])}). `vf.ground` judged the object present in {_pct(g['present'])}"
        " of the queries.",
        "",
    ]


def markdown(results: dict) -> str:
    lines = [
        "# organism-qwen: pruning, video and grounding",
        "",
        f"Command: `{results['command']}`; {results['seconds'] / 60:.1f} minutes on"
        f" {results['threads']} CPU threads.",
        "",
    ]
    parts = {
        "pruners": _pruner_lines,
        "video": _video_lines,
        "first": _first_object_lines,
        "fixation": _fixation_lines,
        "grounding": _grounding_lines,
    }
    for name, lines_of in parts.items():
        if name in results:
            lines += lines_of(results[name])
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=qwen_model_path())
    parser.add_argument(
        "--parts", nargs="*", default=["pruners", "video", "first", "fixation", "grounding"]
    )
    parser.add_argument("--images", type=int, default=150, help="held-out images for pruners")
    parser.add_argument("--clips", type=int, default=150, help="held-out clips for video parts")
    parser.add_argument("--ground-images", type=int, default=60)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, processor = load_model(str(args.model), dtype=torch.float32)
    start = time.time()
    results: dict = {"model": str(args.model), "threads": args.threads}
    parts = {
        "pruners": lambda: pruner_table(model, processor, args.images),
        "video": lambda: video_table(model, processor, args.clips),
        "first": lambda: first_object_table(model, processor, args.clips),
        "fixation": lambda: fixation_table(model, processor, args.clips),
        "grounding": lambda: grounding_table(model, processor, args.ground_images),
    }
    for part in args.parts:
        results[part] = parts[part]()
    results["seconds"] = round(time.time() - start, 1)
    results["command"] = "python benchmarks/qwen_organism.py " + " ".join(
        f"--{k.replace('_', '-')} {' '.join(map(str, v)) if isinstance(v, list) else v}"
        for k, v in vars(args).items()
        if k not in ("model", "out")
    )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "qwen_organism.json").write_text(json.dumps(results, indent=1))
    (args.out / "qwen_organism.md").write_text(markdown(results))
    print(markdown(results))


if __name__ == "__main__":
    main()
