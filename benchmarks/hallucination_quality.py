"""Co-occurrence hallucination on a co-occurrence organism, unmitigated, under a constant
yes-logit shift, and with every mitigation of the registry, each beside the shift that reaches
its recall.

The organism (``--model``, default organism-cooccur) learned that each anchor category's
companion almost always appears with it (``organism.scenes.COOCCUR_PAIRS``). The probe asks
about objects on scenes that hold an anchor but not its companion
(`organism.evaluate_cooccur.cooccur_set`):

* ``present``: up to three objects in the scene (yes);
* ``cooccur``: the absent companion of each anchor in the scene (no): POPE's adversarial
  question by co-occurrence;
* ``other``: as many absent objects in no pair of the prior (no): the control.

``P_cooc = TP / (TP + FP_cooccur)`` and ``P_other = TP / (TP + FP_other)`` share their true
positives, so their gap is the cost of the co-occurrence alone. ``closed`` is the share of the
greedy run's gap a row closes by raising P_cooc, ``(P_cooc - P_cooc(greedy)) / (P_other(greedy)
- P_cooc(greedy))``; ``cost`` the recall points it loses against greedy.

Baselines that any method must beat:

* ``shift``: the greedy run's answers with a constant ``delta`` added to its yes-minus-no logit
  at the first answer token; for each method, ``delta`` is chosen so that the shift's recall
  equals the method's on the same questions (equal recall): a method that only moves the yes/no
  threshold is no better than this;
* ``cutoff only``: a method with a plausibility cutoff (``beta``) run with the same cutoff and
  zero contrast weight (under greedy it cannot change the top token; the table shows whether it
  changed any answer).

Settings are chosen on calibration scenes (seeds from 8,700,000) from a small grid per method
(``GRID``; the defaults too): the largest calibration gain in P_cooc at a calibration recall cost
of at most 1 point, else the defaults. Every number reported is on held-out scenes (seeds from
9,700,000). McNemar's exact test compares a row's answers with greedy's and with the
equal-recall shift's on the present and cooccur questions (the ones P_cooc and recall count).
Captions ("Describe the image.", ``--caption-tokens`` new tokens at most, the last unfinished
sentence dropped when a caption reaches the limit) of the same held-out scenes under the same
setting give CHAIR_i / CHAIR_s against the scene's exact objects, the object recall (share of
the scene's objects named), the mean new tokens, and ``companion``: the share of captions naming
an absent companion.

Goals (`paired_stats.GOALS`), per row: yes/no: closes >= 30% of the gap at <= 1 recall point,
above the shift at equal recall, McNemar p < 0.05 against greedy and against that shift;
captions: >= 30% fewer captions naming an absent companion and CHAIR_i down >= 25% (relative to
greedy) at <= 2 points of object recall.

``--embedded N`` adds a second table on the embedded model (organism-default): POPE adversarial
(the shipped questions of its first N held-out images) and CHAIR of their captions, for greedy,
the shift at each method's recall and every method at its defaults.

A killed run loses no finished run: each is kept in ``hallucination_quality.runs.jsonl`` beside
the results and read back by the next run with the same arguments (``--fresh`` ignores it).

    python benchmarks/hallucination_quality.py --threads 2 --embedded 100
    python benchmarks/hallucination_quality.py --images 20 --calibration 10   # quick look
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import platform
import sys
import time
from pathlib import Path

import torch
from hallucination_embedded import embedded_table
from hallucination_report import finite, markdown, plot, words
from paired_stats import (
    GOALS,
    caption_goal,
    equal_recall_shift,
    mcnemar,
    shifted,
    yes_no_goal,
)
from tqdm.auto import tqdm

from organism import cooccur_model_path
from organism.evaluate_cooccur import cooccur_eval, cooccur_scores, cooccur_set
from organism.scenes import COOCCUR_PAIRS, CooccurPrior
from vlm_focus import FocusConfig
from vlm_focus import hallucination as hal
from vlm_focus.asset_paths import prior_model_path
from vlm_focus.loading import load_model
from vlm_focus.setting import RunSetting

PRUNED = FocusConfig(pruner="fastv", keep=0.25, layer=0)
PRUNED_NAME = "fastv k0.25 l0"
#: Methods beyond one per registered mitigation: options that make another method of it, each
#: calibrated and reported on its own (a variant the registry does not take is skipped; with
#: none left, the mitigation runs as it is).
VARIANTS: dict[str, list[dict]] = {
    "attention_reweight": [{"placement": "relevant"}, {"placement": "pai"}, {"placement": "vaf"}],
    "visual_contrast": [{"branch": "noise"}, {"branch": "blank"}, {"branch": "text"}],
}
#: Settings tried on calibration scenes per method (its label), besides its defaults; a point
#: the registry does not take is skipped. ``"centre": "calibration"`` is the mean contrast of
#: the calibration scenes (`hal.contrast_centre`). growth (M3ID) is no grid point: it leaves the
#: first token, hence every yes/no answer, as it is.
GRID: dict[str, list[dict]] = {
    "attention_reweight": [{"strength": 2.0}, {"strength": 4.0, "layers": [0]}],
    "attention_reweight[relevant]": [{"strength": 2.0}, {"strength": 4.0, "layers": [0]}],
    "attention_reweight[pai]": [{"strength": 0.5}, {"strength": 0.2}, {"heads": 0.25}],
    "attention_reweight[vaf]": [{"strength": 2.0}, {"suppress": 0.5}, {"heads": 0.25}],
    "visual_beam": [{"weight": 3.0}],
    "instruction_contrast": [{"alpha": 2.0}, {"alpha": 4.0}],
    "visual_contrast[noise]": [{"weight": 2.0}, {"beta": 0.0}, {"centre": "calibration"}],
    "visual_contrast[blank]": [{"weight": 2.0}, {"beta": 0.0}, {"centre": "calibration"}],
    "visual_contrast[text]": [{"weight": 2.0}, {"beta": 0.0}, {"centre": "calibration"}],
    "content_free": [{"strength": 0.5}, {"strength": 2.0}],
}
#: Settings tried on calibration captions per method (its label), besides its defaults: the
#: caption goal's setting is chosen here (`calibrate_captions`), apart from the yes/no one.
#: The contrast's caption settings need a lower cutoff than VCD's 0.1 (which keeps the
#: companion, the one plausible next object after its anchor) and a weight that beats the
#: prior; a method without an entry is judged on captions at its yes/no setting.
CAPTION_GRID: dict[str, list[dict]] = {
    "attention_reweight[relevant]": [{"strength": 2.0}],
    "attention_reweight[pai]": [{"strength": 0.5}],
    "attention_reweight[vaf]": [{"strength": 2.0}],
    "visual_contrast[noise]": [{"weight": 2.0, "beta": 0.01}],
    "visual_contrast[blank]": [{"weight": 2.0, "beta": 0.01}, {"weight": 4.0, "beta": 0.03}],
    "visual_contrast[text]": [
        {"weight": 2.0, "beta": 0.01},
        {"weight": 4.0, "beta": 0.03},
        {"weight": 1.0, "beta": 0.01, "growth": 0.1},
    ],
}
CALIBRATION_CAPTION_RECALL = 0.02  # a caption setting loses at most 2 points of object recall
#: A plausibility cutoff's contrast weight, per mitigation: zero it for the cutoff-only row.
CUTOFF_WEIGHT = {
    "instruction_contrast": "alpha",
    "visual_contrast": "weight",
    "content_free": "strength",
}
#: A fixed shift shown as a reference row (the review's "-1 closes half the gap").
REFERENCE_SHIFT = -1.0
CALIBRATION_RECALL = 0.01  # a chosen setting loses at most 1 recall point on calibration


# --- the methods ----------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Method:
    """One reported method: a mitigation with the options that make it this variant."""

    label: str
    mitigation: str
    base: dict

    def options(self, extra: dict | None = None) -> dict:
        return {**self.base, **(extra or {})}


def _takes(mitigation: str, options: dict) -> bool:
    """Whether the registry takes ``options`` for ``mitigation`` (a sentinel value passes)."""
    probe = {k: v for k, v in options.items() if v != "calibration"}
    try:
        hal.get_mitigation(mitigation).parameters(**probe)
    except (TypeError, ValueError):
        return False
    return "centre" not in options or hasattr(hal, "contrast_centre")


def methods() -> list[Method]:
    """Every registered mitigation, and its variants, once each (by its parameters)."""
    out, seen = [], set()
    for name in hal.mitigations():
        variants = [v for v in VARIANTS.get(name, []) if _takes(name, v)] or [{}]
        for base in variants:
            key = (name, json.dumps(hal.get_mitigation(name).parameters(**base), default=str))
            if key in seen:
                continue
            seen.add(key)
            tag = ",".join(str(v) for v in base.values())
            out.append(Method(f"{name}[{tag}]" if tag else name, name, base))
    return out


def grid(method: Method) -> list[dict]:
    """The calibration points of a method (options over its base), defaults first."""
    points = [{}] + [g for g in GRID.get(method.label, []) if _takes(method.mitigation, g)]
    return [p for i, p in enumerate(points) if _takes(method.mitigation, method.options(p))]


def cutoff_only(method: Method, options: dict) -> dict | None:
    """The options of the method's cutoff-only twin (contrast weight 0), or None."""
    weight = CUTOFF_WEIGHT.get(method.mitigation)
    names = hal.get_mitigation(method.mitigation).option_names()
    if weight is None or weight not in names or "beta" not in names:
        return None
    return {**options, weight: 0.0}


# --- running (with the resumable record of finished runs) -----------------------------------
class Runs:
    """Finished runs by key, appended to a JSON-lines file as each finishes."""

    def __init__(self, path: Path, fresh: bool) -> None:
        self.path = path
        self.done: dict[str, dict] = {}
        self.used: list[str] = []  # the keys this benchmark asked for, in order
        if path.is_file() and not fresh:
            for line in path.read_text().splitlines():
                if line.strip():
                    item = json.loads(line)
                    self.done[item["key"]] = item["result"]
        elif fresh and path.exists():
            path.unlink()

    def timing(self) -> dict:
        """Runs asked for so far and their summed wall and CPU seconds (resumed ones too)."""
        done = [self.done[k] for k in self.used]
        return {
            "runs": len(done),
            "seconds": sum(r.get("seconds", 0.0) for r in done),
            "cpu_seconds": sum(r.get("cpu_seconds", 0.0) for r in done),
        }

    def get(self, key: dict, compute) -> dict:
        """The finished run of ``key``, or ``compute()``'s, timed (wall and process CPU s)."""
        text = json.dumps(key, sort_keys=True, default=str)
        self.used.append(text)
        if text not in self.done:
            wall, cpu = time.perf_counter(), time.process_time()
            result = compute()
            result["seconds"] = time.perf_counter() - wall
            result["cpu_seconds"] = time.process_time() - cpu
            self.done[text] = result
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with self.path.open("a") as f:
                f.write(json.dumps({"key": text, "result": finite(self.done[text])}) + "\n")
        return self.done[text]


class Bench:
    """The model, the probe's arguments and the record of runs, for one benchmark."""

    def __init__(self, args, model, processor, runs: Runs, bar) -> None:
        self.args, self.model, self.processor, self.runs, self.bar = (
            args,
            model,
            processor,
            runs,
            bar,
        )
        self.prior = CooccurPrior(pairs=COOCCUR_PAIRS)
        self.centres: dict[tuple, str] = {}

    def resolve(self, mitigation: str, options: dict) -> dict:
        """``options`` with ``centre="calibration"`` replaced by the saved centre's path."""
        if options.get("centre") != "calibration":
            return options
        params = hal.get_mitigation(mitigation).parameters(
            **{k: v for k, v in options.items() if k != "centre"}
        )
        takes = inspect.signature(hal.contrast_centre).parameters
        keys = {k: v for k, v in params.items() if k in takes and k not in ("model", "batches")}
        key = tuple(sorted(keys.items()))
        if key not in self.centres:
            words = "-".join(str(v) for _, v in key)
            path = self.args.out / f"hallucination_quality.centre-{words}.pt"
            torch.save(self._centre(keys), path)
            self.centres[key] = str(path)
        return {**options, "centre": self.centres[key]}

    def _centre(self, keys: dict) -> torch.Tensor:
        """The mean contrast at the answer position over the calibration scenes' questions."""
        from organism.answering import BATCH, model_inputs

        scenes, rows = cooccur_set(self.args.calibration, True, self.prior)
        by_seed = {s.seed: s for s in scenes}
        batches = (
            model_inputs(
                self.processor,
                [by_seed[r["image_id"]] for r in rows[i : i + BATCH]],
                [r["text"] for r in rows[i : i + BATCH]],
            )
            for i in range(0, len(rows), BATCH)
        )
        return hal.contrast_centre(self.model, batches, **keys)

    def probe(
        self,
        focus,
        mitigation: str,
        options: dict,
        calibration: bool,
        captions: bool,
        margins: bool = False,
    ) -> dict:
        """One run of the probe (from the record when it finished before)."""
        n = self.args.calibration if calibration else self.args.images
        key = {
            "model": str(self.args.model_path),
            "n": n,
            "calibration": calibration,
            "focus": None if focus is None else dataclasses.asdict(focus),
            "mitigation": mitigation,
            "options": options,
            "captions": captions,
            "caption_tokens": self.args.caption_tokens,
            "margins": margins,
        }
        if options.get("centre") == "calibration":  # the centre comes from these scenes
            key["centre_scenes"] = self.args.calibration

        def compute() -> dict:
            resolved = self.resolve(mitigation, options)
            setting = RunSetting(focus=focus, mitigation=mitigation, mitigation_options=resolved)
            return cooccur_eval(
                self.model,
                self.processor,
                n,
                setting,
                calibration,
                captions=captions,
                caption_tokens=self.args.caption_tokens,
                margins=margins,
                prior=self.prior,
                records=True,
            )

        out = self.runs.get(key, compute)
        self.bar.update()
        return out


def calibrate(bench: Bench, focus, ms: list[Method]) -> tuple[dict[str, dict], list[dict]]:
    """Each method's chosen options (over its base) and every calibration row."""
    base = bench.probe(focus, "none", {}, True, captions=False)["pope"]
    rows = [{"method": "greedy", "options": {}, **base}]
    chosen: dict[str, dict] = {}
    for m in ms:
        best, best_gain = {}, -float("inf")
        for point in grid(m):
            pope = bench.probe(focus, m.mitigation, m.options(point), True, captions=False)["pope"]
            gain = pope["precision_cooccur"] - base["precision_cooccur"]
            cost = base["recall"] - pope["recall"]
            rows.append({"method": m.label, "options": point, **pope, "gain": gain, "cost": cost})
            if cost <= CALIBRATION_RECALL + 1e-12 and gain > best_gain:
                best, best_gain = point, gain
        chosen[m.label] = best
    return chosen, rows


def caption_grid(method: Method) -> list[dict]:
    """The caption calibration points of a method (over its base), defaults first."""
    points = [{}] + CAPTION_GRID.get(method.label, [])
    return [p for p in points if _takes(method.mitigation, method.options(p))]


def calibrate_captions(bench: Bench, focus, ms: list[Method]) -> tuple[dict[str, dict], list]:
    """Each method's caption setting (over its base): the largest drop in captions naming an
    absent companion at a cost of at most 2 points of object recall on calibration captions,
    else the defaults; and every calibration row."""
    base = bench.probe(focus, "none", {}, True, captions=True)["chair"]
    rows = [{"method": "greedy", "options": {}, **base}]
    chosen: dict[str, dict] = {}
    for m in ms:
        if m.label not in CAPTION_GRID:
            continue
        best, best_drop = {}, -float("inf")
        for point in caption_grid(m):
            chair = bench.probe(focus, m.mitigation, m.options(point), True, captions=True)
            chair = chair["chair"]
            drop = base["companion_rate"] - chair["companion_rate"]
            cost = base["recall"] - chair["recall"]
            rows.append({"method": m.label, "options": point, **chair, "drop": drop, "cost": cost})
            if cost <= CALIBRATION_CAPTION_RECALL + 1e-12 and drop > best_drop:
                best, best_drop = point, drop
        chosen[m.label] = best
    return chosen, rows


# --- scoring ----------------------------------------------------------------------------------
def closed(p_cooc: float, base: dict) -> float:
    """Share of greedy's gap closed by raising P_cooc to ``p_cooc`` (NaN without a gap)."""
    gap = base["precision_other"] - base["precision_cooccur"]
    return (p_cooc - base["precision_cooccur"]) / gap if gap > 0 else float("nan")


def _paired(records: list[dict]) -> list[int]:
    """Indices of the present and cooccur questions (McNemar's pairs)."""
    return [i for i, r in enumerate(records) if r["split"] in ("present", "cooccur")]


def shift_scores(records: list[dict], preds: list[str], base: dict) -> dict:
    """The cooccur scores of greedy's questions answered by ``preds``, with ``closed``."""
    out = cooccur_scores([{**r, "pred": p} for r, p in zip(records, preds, strict=True)])
    out["closed"] = closed(out["precision_cooccur"], base)
    return out


def scored(kind: str, label: str, run: dict, greedy: dict, options: dict) -> dict:
    """A held-out row: its scores, closed and cost against greedy, the equal-recall shift, the
    McNemar tests, and the goals."""
    base, records = greedy["pope"], greedy["records"]
    pope = run["pope"]
    preds = [r["pred"] for r in run["records"]]
    labels = [r["label"] for r in records]
    margins = [r["margin"] for r in records]
    delta, shift_preds = equal_recall_shift(margins, labels, preds)
    pick = _paired(records)

    def sub(xs):
        return [xs[i] for i in pick]

    greedy_preds = [r["pred"] for r in records]
    row = {
        "kind": kind,
        "label": label,
        "options": options,
        **pope,
        "closed": closed(pope["precision_cooccur"], base),
        "recall_cost": base["recall"] - pope["recall"],
        "flips": sum(a != b for a, b in zip(preds, greedy_preds, strict=True)),
        "shift": {"delta": delta, **shift_scores(records, shift_preds, base)},
        "mcnemar_greedy": mcnemar(sub(preds), sub(greedy_preds), sub(labels)),
        "mcnemar_shift": mcnemar(sub(preds), sub(shift_preds), sub(labels)),
    }
    if "chair" in run:
        row |= {f"caption_{k}": v for k, v in run["chair"].items()}
        row["examples"] = run.get("examples", [])
    return row


def with_goals(rows: list[dict]) -> list[dict]:
    """Rows of one pruning (greedy first) with their goal checks."""
    base = rows[0]
    for row in rows[1:]:
        if row["kind"] in ("defaults", "chosen", "cutoff only", "captions"):
            row["goal_yes_no"] = yes_no_goal(row)
            if "caption_CHAIR_i" in row:
                row["goal_captions"] = caption_goal(row, base)
    return rows


def greedy_row(run: dict) -> dict:
    row = {"kind": "greedy", "label": "greedy", "options": {}, **run["pope"]}
    row |= {"closed": 0.0, "recall_cost": 0.0, "flips": 0}
    row |= {f"caption_{k}": v for k, v in run["chair"].items()}
    row["examples"] = run.get("examples", [])
    margins = [r["margin"] for r in run["records"]]
    row["margin_disagreements"] = sum(
        (m > 0) != (r["pred"] == "yes") for m, r in zip(margins, run["records"], strict=True)
    )
    return row


def reference_shift_row(greedy: dict) -> dict:
    records = greedy["records"]
    preds = shifted([r["margin"] for r in records], REFERENCE_SHIFT)
    out = shift_scores(records, preds, greedy["pope"])
    return {
        "kind": "shift",
        "method": "shift only",
        "label": f"shift only (delta = {REFERENCE_SHIFT:g})",
        "options": {"delta": REFERENCE_SHIFT},
        **out,
        "recall_cost": greedy["pope"]["recall"] - out["recall"],
    }


def shift_curve(greedy: dict, points: int = 121) -> list[dict]:
    """P_cooc and recall of the shift over a range of deltas (the plot's curve)."""
    records = greedy["records"]
    margins = [r["margin"] for r in records]
    lo, hi = min(margins), max(margins)
    out = []
    for i in range(points):
        delta = -hi - 0.5 + (hi - lo + 1.0) * i / (points - 1)
        s = shift_scores(records, shifted(margins, delta), greedy["pope"])
        out.append(
            {"delta": delta, "recall": s["recall"], "precision_cooccur": s["precision_cooccur"]}
        )
    return out


def measure(
    bench: Bench,
    focus,
    ms: list[Method],
    chosen: dict[str, dict],
    part: dict,
    write,
    caption_chosen: dict[str, dict] | None = None,
) -> None:
    """Held-out rows of one pruning into ``part``: greedy, the reference shift, each method at
    its defaults, at its chosen setting, the chosen setting's cutoff-only twin, and its caption
    setting (``caption_chosen``) where that differs; ``write()`` after each."""
    caption_chosen = caption_chosen or {}
    greedy = bench.probe(focus, "none", {}, False, captions=True, margins=True)
    rows = part["rows"] = [greedy_row(greedy), reference_shift_row(greedy)]
    part["shift_curve"] = shift_curve(greedy)
    write()
    for m in ms:
        pick = chosen.get(m.label, {})
        todo = [("defaults", {}), *([("chosen", pick)] if pick else [])]
        twin = cutoff_only(m, m.options(pick))
        if twin is not None:
            todo.append(("cutoff only", {k: v for k, v in twin.items() if k not in m.base}))
        for_captions = caption_chosen.get(m.label, {})
        if for_captions and for_captions != pick:
            todo.append(("captions", for_captions))
        for kind, extra in todo:
            # greedy with a cutoff alone keeps the top token: its captions are greedy's too
            captions = kind != "cutoff only"
            run = bench.probe(focus, m.mitigation, m.options(extra), False, captions=captions)
            label = m.label if kind == "defaults" else f"{m.label} ({kind}: {words(extra)})"
            row = scored(kind, label, run, greedy, m.options(extra))
            row["changed"] = extra  # over the method's own options
            # the calibrated setting is the chosen one, or the defaults when none was chosen
            calibrated = kind == "chosen" or (kind == "defaults" and not pick)
            row["method"], row["setting"] = m.label, "chosen" if calibrated else kind
            # the caption goal counts the setting chosen on calibration captions (the yes/no
            # one for a method without a caption grid)
            target = caption_chosen.get(m.label, pick)
            row["caption_setting"] = kind != "cutoff only" and extra == target
            rows.append(row)
            with_goals(rows)
            write()


# --- main -----------------------------------------------------------------------------------
def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model",
        default="cooccur",
        help="a model folder, or cooccur (organism-cooccur, the default) or prior (organism-prior)",
    )
    parser.add_argument("--images", type=int, default=100, help="held-out probe scenes")
    parser.add_argument("--calibration", type=int, default=40, help="calibration probe scenes")
    parser.add_argument("--caption-tokens", type=int, default=64, help="new tokens per caption")
    parser.add_argument("--pruned", action="store_true", help=f"also pruned ({PRUNED_NAME})")
    parser.add_argument(
        "--embedded",
        type=int,
        default=0,
        metavar="N",
        help="also the embedded model's POPE adversarial / CHAIR on N images",
    )
    parser.add_argument(
        "--only",
        nargs="*",
        default=None,
        metavar="METHOD",
        help="only these methods (labels as the table writes them)",
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--fresh", action="store_true", help="ignore the finished runs' record")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args(argv)
    for name in ("images", "calibration", "caption_tokens"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.embedded < 0:
        parser.error("--embedded must be >= 0")
    named = {"cooccur": cooccur_model_path, "prior": prior_model_path}
    args.model_path = named[args.model]() if args.model in named else Path(args.model)
    if not args.model_path.is_dir():
        parser.error(f"--model {args.model}: no model folder at {args.model_path}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    torch.set_num_threads(args.threads)
    start = time.time()
    args.out.mkdir(parents=True, exist_ok=True)
    ms = methods()
    if args.only is not None:
        unknown = sorted(set(args.only) - {m.label for m in ms})
        if unknown:
            allowed = ", ".join(m.label for m in ms)
            raise SystemExit(f"unknown --only {', '.join(unknown)}; allowed: {allowed}")
        ms = [m for m in ms if m.label in args.only]
    settings = {"unpruned": None, **({PRUNED_NAME: PRUNED} if args.pruned else {})}
    runs = Runs(args.out / "hallucination_quality.runs.jsonl", args.fresh)
    model, processor = load_model(str(args.model_path))
    cutoffs = sum(cutoff_only(m, m.options()) is not None for m in ms)
    per = 2 + sum(len(grid(m)) for m in ms) + 2 * len(ms) + cutoffs
    per += 1 + sum(2 * len(caption_grid(m)) for m in ms if m.label in CAPTION_GRID)
    total = len(settings) * per + (1 + len(ms) if args.embedded else 0)
    report: dict = {"prunings": {}, "chosen": {}, "calibration_rows": {}}

    def write(partial: bool = True) -> None:
        report["run_timing"] = runs.timing()
        _write(args, argv, start, report, partial)

    with tqdm(total=total, desc="runs", dynamic_ncols=True) as bar:
        bench = Bench(args, model, processor, runs, bar)
        for name, focus in settings.items():
            chosen, cal = calibrate(bench, focus, ms)
            report["chosen"][name], report["calibration_rows"][name] = chosen, cal
            bar.total -= sum(not chosen[m.label] for m in ms)
            for_captions, cap_rows = calibrate_captions(bench, focus, ms)
            report.setdefault("caption_chosen", {})[name] = for_captions
            report.setdefault("caption_calibration_rows", {})[name] = cap_rows
            part = report["prunings"][name] = {"rows": []}
            measure(bench, focus, ms, chosen, part, write, for_captions)
        if args.embedded:
            report["embedded"] = embedded_table(args, ms, runs, bar)
    write(partial=False)
    print((args.out / "hallucination_quality.md").read_text())
    return 0


def _write(args, argv, start, report: dict, partial: bool) -> None:
    """The report's JSON, markdown and plot from the rows measured so far."""
    import transformers

    parts = {k: v for k, v in report["prunings"].items() if v.get("rows")}
    if not parts:
        return
    first = next(iter(parts.values()))["rows"][0]
    full = {
        "command": "python benchmarks/hallucination_quality.py "
        + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": f"{platform.machine()} ({torch.get_num_threads()} threads), CPU",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "seconds": time.time() - start,
        "partial": partial,
        "model": str(args.model_path),
        "images": args.images,
        "calibration": args.calibration,
        "caption_tokens": args.caption_tokens,
        "questions": first["n"],
        "pairs": [list(p) for p in COOCCUR_PAIRS],
        "pruned": "fastv, keep 0.25, layer 0 (the library's defaults for the rest)",
        "goals": GOALS,
        "grid": GRID,
        "caption_grid": CAPTION_GRID,
        **report,
        "prunings": parts,
    }
    (args.out / "hallucination_quality.json").write_text(json.dumps(finite(full), indent=1))
    (args.out / "hallucination_quality.md").write_text(markdown(full))
    plot(full, args.out / "hallucination_quality.png")


if __name__ == "__main__":
    raise SystemExit(main())
