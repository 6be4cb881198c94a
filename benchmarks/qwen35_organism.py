"""Pruning on organism-qwen35, the hybrid-decoder organism (Gated-DeltaNet layers 0-2 and 4-6,
full attention at layers 3 and 7).

- ``rules``: where a pruner that needs attention scores when its stage layer is a linear layer
  (`linear_scoring`, docs/hybrid.md): ``next_full`` (the next full-attention layer's q/k on the
  stage layer's input) against ``delta_qk`` (the DeltaNet's own q/k), for every attention pruner
  at the linear layers 0 and 2, keeps 0.5 / 0.25 / 0.11, with ``random`` beside them.
- ``pruners``: every registered pruner at layer 0, K = 2 and K = 3 (the first full-attention
  layer, whose own attention scores), same keeps, under the default rule.

Questions: per held-out image a yes and a no presence question, and the fixed two-hop set
(`organism.qwen_eval.two_hop_set`). The score of a setting is the mean of the two kinds'
accuracies; retention is that score over the unpruned one, same questions, same run. Every answer
is greedy through the chat template (``vf.wrap`` on the unmodified model, ``generate``).

    python benchmarks/qwen35_organism.py [--model DIR] [--images 100] [--parts rules pruners]
        [--threads 2]

``--model`` defaults to the shipped organism-qwen35.

Writes ``qwen35_organism.json`` (after every setting, so a killed run resumes where it stopped)
and ``qwen35_organism.md`` under ``--out``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import numpy as np
import torch
from qwen_organism import KEEPS, generate, kind_accuracy
from tqdm import tqdm

from organism import qwen_data as q
from organism.qwen_eval import QUESTION_SEED, heldout_images, two_hop_set
from vlm_focus import FocusConfig
from vlm_focus.asset_paths import qwen35_model_path
from vlm_focus.loading import load_model
from vlm_focus.model_adapters import get_adapter, register_adapter
from vlm_focus.pruners import pruners

RULES = ("next_full", "delta_qk")
ATTENTION_PRUNERS = ("fastv", "text", "debiased", "diverse", "pool")
LINEAR_LAYERS = (0, 2)
LAYERS = (0, 2, 3)
KINDS = ("presence", "twohop")


def questions(n_images: int) -> list[tuple[q.CroppedScene, str, str, str]]:
    """(image, question, answer, kind): a presence pair per held-out image, then two-hop."""
    rng = np.random.default_rng(QUESTION_SEED)
    rows = [
        (crop, qa.question, qa.answer, "presence")
        for crop in heldout_images(n_images)
        for qa in q.presence_pair(crop, rng)
    ]
    crops, qas = two_hop_set(n_images)
    return rows + [(c, qa.question, qa.answer, "twohop") for c, qa in zip(crops, qas, strict=True)]


def score(model, processor, rows, focus: FocusConfig | None) -> dict | str:
    """Per-kind accuracy and their mean (`score`), or the refusal's first line."""
    try:
        answers = generate(model, processor, rows, focus)
    except (ValueError, NotImplementedError) as err:
        return str(err).splitlines()[0]
    kinds = kind_accuracy(answers, rows)
    return {**{k: kinds[k] for k in KINDS}, "score": float(np.mean([kinds[k] for k in KINDS]))}


class Results:
    """The settings measured so far, saved after each one, keyed by setting."""

    def __init__(self, path: Path, meta: dict) -> None:
        self.path = path
        old = json.loads(path.read_text()) if path.is_file() else {}
        self.data = old if old.get("meta") == meta else {"meta": meta, "settings": {}}

    def get(self, key: str, compute) -> dict | str:
        if key not in self.data["settings"]:
            self.data["settings"][key] = compute()
            self.path.write_text(json.dumps(self.data, indent=1))
        return self.data["settings"][key]


def with_rule(model, rule: str):
    """Register `model`'s adapter with `linear_scoring=rule`; returns the adapter before."""
    before = get_adapter(model)
    register_adapter(dataclasses.replace(before, linear_scoring=rule), replace=True)
    return before


def key(pruner: str, layer: int, keep: float, rule: str) -> str:
    return f"{pruner}|{layer}|{keep}|{rule}"


def measure(model, processor, rows, results: Results, parts: list[str]) -> None:
    default = get_adapter(model).linear_scoring
    results.get("unpruned", lambda: score(model, processor, rows, None))
    settings = []
    if "rules" in parts:
        names = (*ATTENTION_PRUNERS, "random")
        settings += [
            (p, k, keep, r) for r in RULES for p in names for k in LINEAR_LAYERS for keep in KEEPS
        ]
    if "pruners" in parts:
        settings += [(p, k, keep, default) for p in pruners() for k in LAYERS for keep in KEEPS]
    settings = list(dict.fromkeys(settings))
    for pruner, layer, keep, rule in tqdm(settings, desc="settings"):
        focus = FocusConfig(pruner=pruner, keep=keep, layer=layer, video_pruner=None)
        before = with_rule(model, rule)
        try:
            results.get(
                key(pruner, layer, keep, rule), lambda f=focus: score(model, processor, rows, f)
            )
        finally:
            register_adapter(before, replace=True)


# ---- the tables ------------------------------------------------------------------------------


def _cell(result, base: float) -> str:
    if isinstance(result, str):
        return "refused"
    retention = f" ({result['score'] / base:.2f})" if base else ""
    return f"{100 * result['score']:.1f}{retention}"


def _mean_score(results: dict, pruner: str, layer: int, rule: str) -> float | None:
    cells = [results.get(key(pruner, layer, keep, rule)) for keep in KEEPS]
    if any(c is None or isinstance(c, str) for c in cells):
        return None
    return float(np.mean([c["score"] for c in cells]))


def markdown(data: dict) -> str:
    s, base = data["settings"], data["settings"]["unpruned"]
    meta = data["meta"]
    lines = [
        "# Pruning on organism-qwen35",
        "",
        f"`{meta['command']}`: {meta['questions']} questions ({meta['images']} held-out images: "
        f"a presence pair each, and {meta['twohop']} two-hop questions). Unpruned: presence "
        f"{100 * base['presence']:.1f}%, two-hop {100 * base['twohop']:.1f}%, score "
        f"{100 * base['score']:.1f}. Cells: score (mean of the two kinds' accuracies, %) and "
        "retention (score / unpruned) at keep " + " / ".join(map(str, KEEPS)) + ".",
    ]
    if any(k.endswith("|delta_qk") for k in s):
        lines += ["", "## Scoring at a linear stage layer (`linear_scoring`)", ""]
        lines += [
            "| pruner | layer | rule | " + " | ".join(f"keep {k}" for k in KEEPS) + " | mean |"
        ]
        lines += ["|---|---:|---|" + "---:|" * (len(KEEPS) + 1)]
        for pruner in (*ATTENTION_PRUNERS, "random"):
            for layer in LINEAR_LAYERS:
                for rule in RULES:
                    cells = [
                        _cell(s.get(key(pruner, layer, k, rule), "—"), base["score"]) for k in KEEPS
                    ]
                    mean = _mean_score(s, pruner, layer, rule)
                    avg = "—" if mean is None else f"{100 * mean:.1f}"
                    lines.append(
                        f"| {pruner} | {layer} | {rule} | " + " | ".join(cells) + f" | {avg} |"
                    )
        lines += ["", _rule_summary(s)]
    rule = meta["default_rule"]
    if any(k.split("|")[1] == "3" for k in s if "|" in k):
        lines += ["", f"## Every pruner (rule `{rule}`)", ""]
        lines += ["| pruner | " + " | ".join(f"K={k}" for k in LAYERS) + " |"]
        lines += ["|---|" + "---|" * len(LAYERS)]
        for pruner in pruners():
            cells = []
            for layer in LAYERS:
                got = [s.get(key(pruner, layer, k, rule)) for k in KEEPS]
                if any(isinstance(g, str) for g in got):
                    cells.append("refused: " + next(g for g in got if isinstance(g, str))[:60])
                elif all(g is not None for g in got):
                    cells.append(" / ".join(f"{100 * g['score']:.0f}" for g in got))
                else:
                    cells.append("—")
            lines.append(f"| {pruner} | " + " | ".join(cells) + " |")
        lines += ["", "Each cell: score at keep " + " / ".join(map(str, KEEPS)) + "."]
    return "\n".join(lines) + "\n"


def _rule_summary(s: dict) -> str:
    """The rules' mean score over the attention pruners, linear layers and keeps."""
    means = {}
    for rule in RULES:
        got = [_mean_score(s, p, k, rule) for p in ATTENTION_PRUNERS for k in LINEAR_LAYERS]
        got = [g for g in got if g is not None]
        means[rule] = float(np.mean(got)) if got else None
    parts = [f"`{r}` {100 * m:.1f}" for r, m in means.items() if m is not None]
    return (
        "Mean score over the attention pruners, layers 0 and 2 and the keeps: "
        + ", ".join(parts)
        + "."
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--model",
        type=Path,
        default=None,
        help="a saved organism-qwen35 (default: the shipped one)",
    )
    parser.add_argument("--images", type=int, default=100)
    parser.add_argument("--parts", nargs="+", default=["rules", "pruners"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    path = args.model or qwen35_model_path()
    model, processor = load_model(str(path))
    model.eval()
    rows = questions(args.images)
    meta = {
        "command": "python benchmarks/qwen35_organism.py "
        + (f"--model {args.model} " if args.model else "")
        + f"--images {args.images} --parts {' '.join(args.parts)} --threads {args.threads}",
        "model": Path(path).name,
        "images": args.images,
        "questions": len(rows),
        "twohop": sum(r[3] == "twohop" for r in rows),
        "default_rule": get_adapter(model).linear_scoring,
        "threads": args.threads,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    results = Results(args.out / "qwen35_organism.json", meta)
    start = time.time()
    measure(model, processor, rows, results, args.parts)
    (args.out / "qwen35_organism.md").write_text(markdown(results.data))
    print(markdown(results.data))
    print(f"{time.time() - start:.0f} s")


if __name__ == "__main__":
    main()
