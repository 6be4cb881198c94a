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
from paired_stats import (
    GOALS,
    caption_goal,
    equal_recall_shift,
    mcnemar,
    shifted,
    yes_no_goal,
)
from tqdm.auto import tqdm

from organism import cooccur_model_path, default_model_path
from organism.evaluate_cooccur import cooccur_eval, cooccur_scores, cooccur_set, yes_no_margins
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
#: Methods that change only the first answer token (content_free) have none.
CAPTION_GRID: dict[str, list[dict]] = {
    "attention_reweight[relevant]": [{"strength": 2.0}],
    "attention_reweight[pai]": [{"strength": 0.5}],
    "attention_reweight[vaf]": [{"strength": 2.0}],
    "visual_beam": [{"weight": 3.0}],
    "instruction_contrast": [{"alpha": 2.0}],
    **{
        f"visual_contrast[{branch}]": [
            {"weight": 2.0, "beta": 0.01},
            {"weight": 2.0, "beta": 0.03},
            {"weight": 4.0, "beta": 0.03},
            {"weight": 1.0, "beta": 0.01, "growth": 0.1},
        ]
        for branch in ("noise", "blank", "text")
    },
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
                f.write(json.dumps({"key": text, "result": _finite(self.done[text])}) + "\n")
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
            label = m.label if kind == "defaults" else f"{m.label} ({kind}: {_words(extra)})"
            row = scored(kind, label, run, greedy, m.options(extra))
            row["changed"] = extra  # over the method's own options
            # the calibrated setting is the chosen one, or the defaults when none was chosen
            calibrated = kind == "chosen" or (kind == "defaults" and not pick)
            row["method"], row["setting"] = m.label, "chosen" if calibrated else kind
            # the caption goal counts the setting chosen on calibration captions
            row["caption_setting"] = kind == "captions" or (
                calibrated and caption_chosen.get(m.label, {}) in ({}, pick)
            )
            rows.append(row)
            with_goals(rows)
            write()


# --- the embedded model's table -------------------------------------------------------------
def embedded_table(args, ms: list[Method], runs: Runs, bar) -> dict:
    """POPE adversarial and CHAIR on organism-default: greedy, the shift at each method's
    recall, and every method at its defaults (first ``args.embedded`` held-out images)."""
    from PIL import Image

    from vlm_focus.asset_paths import CAPTION_PROMPT, heldout_path
    from vlm_focus.eval.chair import (
        EMBEDDED_MAX_NEW_TOKENS,
        ObjectWords,
        chair_metrics,
        drop_unfinished,
        truth_objects,
    )
    from vlm_focus.eval.generation import Generator
    from vlm_focus.eval.metrics import pope_metrics
    from vlm_focus.eval.pope import LLAVA_SUFFIX, read_questions
    from vlm_focus.eval.pope import evaluate as evaluate_pope
    from vlm_focus.eval.scenes import generate_scene

    path = default_model_path()
    model, processor = load_model(str(path))
    rows = read_questions(heldout_path("pope_adversarial.jsonl"))
    ids = list(dict.fromkeys(r["image_id"] for r in rows))[: args.embedded]
    rows = [r for r in rows if r["image_id"] in set(ids)]
    instances = json.loads(heldout_path("instances.json").read_text())
    names = {c["id"]: c["name"] for c in instances["categories"]}
    table = ObjectWords.for_categories(names.values())
    refs: dict[int, list[str]] = {}
    for c in json.loads(heldout_path("captions.json").read_text()):
        refs.setdefault(c["image_id"], []).append(c["caption"])
    objs: dict[int, set[str]] = {i: set() for i in ids}
    for a in instances["annotations"]:
        if a["image_id"] in objs:
            objs[a["image_id"]].add(names[a["category_id"]])
    truth = {i: truth_objects(objs[i], refs.get(i, []), table) for i in ids}

    def image(row):
        return Image.fromarray(generate_scene(int(row["image_id"])).image())

    def run(mitigation: str, options: dict, margins: bool) -> dict:
        key = {
            "embedded": str(path),
            "n": len(ids),
            "mitigation": mitigation,
            "options": options,
            "margins": margins,
        }

        def compute() -> dict:
            setting = RunSetting(mitigation=mitigation, mitigation_options=options)
            pope = evaluate_pope(
                model,
                processor,
                rows,
                dataclasses.replace(setting, max_new_tokens=2),
                images=image,
                suffix=LLAVA_SUFFIX,
                batch_size=32,
            )
            records = [
                {"label": r["label"], "pred": r["pred"], "split": "all"} for r in pope.records
            ]
            if margins:
                found = yes_no_margins(model, processor, rows, image, setting, LLAVA_SUFFIX)
                for r, m in zip(records, found, strict=True):
                    r["margin"] = m
            tokens_max = EMBEDDED_MAX_NEW_TOKENS
            gen = Generator(
                model, processor, dataclasses.replace(setting, max_new_tokens=tokens_max)
            )
            caps, tokens = {}, []
            for i in range(0, len(ids), 32):
                chunk = ids[i : i + 32]
                pictures = [image({"image_id": j}) for j in chunk]
                texts, facts = gen(pictures, [CAPTION_PROMPT] * len(chunk))
                for j, text, fact in zip(chunk, texts, facts, strict=True):
                    cut = fact["new_tokens"] >= tokens_max
                    caps[j] = drop_unfinished(text) if cut else text
                    tokens.append(fact["new_tokens"])
            chair = chair_metrics(caps, truth, table)
            chair["tokens"] = sum(tokens) / max(len(tokens), 1)
            return {"pope": pope.scores(), "records": records, "chair": chair}

        out = runs.get(key, compute)
        bar.update()
        return out

    greedy = run("none", {}, True)
    labels = [r["label"] for r in greedy["records"]]
    margins = [r["margin"] for r in greedy["records"]]
    greedy_preds = [r["pred"] for r in greedy["records"]]
    out = [{"label": "greedy", **greedy["pope"], **_caption(greedy)}]
    for m in ms:
        done = run(m.mitigation, m.options(), False)
        preds = [r["pred"] for r in done["records"]]
        delta, shift_preds = equal_recall_shift(margins, labels, preds)
        shift = pope_metrics(labels, shift_preds)
        label = f"shift at {m.label}'s recall (delta = {delta:+.2f})"
        out.append({"label": label, "kind": "shift", **shift})
        out.append(
            {
                "label": m.label,
                **done["pope"],
                **_caption(done),
                "mcnemar_greedy": mcnemar(preds, greedy_preds, labels),
                "mcnemar_shift": mcnemar(preds, shift_preds, labels),
            }
        )
    return {"model": str(path), "images": len(ids), "questions": len(rows), "rows": out}


def _caption(run: dict) -> dict:
    return {f"caption_{k}": v for k, v in run["chair"].items()}


# --- report ---------------------------------------------------------------------------------
def _finite(value):
    """``value`` with NaN floats written as None, for strict JSON."""
    if isinstance(value, float) and value != value:
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def _pct(x) -> str:
    return "n/a" if x is None or x != x else f"{100 * x:.1f}"


def _p(test: dict | None) -> str:
    if not test:
        return "-"
    return f"{test['p']:.3g} ({test['a_only']}/{test['b_only']})"


def _words(options: dict) -> str:
    if not options:
        return "defaults"
    return ", ".join(f"{k}={Path(v).stem if k == 'centre' else v}" for k, v in options.items())


def _setting_words(row: dict) -> str:
    if row["kind"] == "shift":
        return row["label"]
    if row["kind"] in ("chosen", "cutoff only"):
        return f"{row['kind']}: {_words(row.get('changed', row['options']))}"
    return row["kind"]


def _tick(check: dict | None) -> str:
    """``met``, or ``no`` with the conditions that failed."""
    if not check:
        return "-"
    if check["met"]:
        return "**met**"
    return "no (" + ", ".join(k for k, v in check.items() if v is False and k != "met") + ")"


def markdown(report: dict) -> str:
    t = report.get("run_timing", {"runs": 0, "seconds": 0.0, "cpu_seconds": 0.0})
    q = report.get("questions", {})
    lines = [
        f"# Co-occurrence hallucination and its mitigations ({Path(report['model']).name})",
        "",
        f"`{report['command']}`",
        "",
        f"Machine: {report['machine']}; torch {report['torch']}, transformers "
        f"{report['transformers']}. Run took {report['seconds']:.0f} s"
        + (" (partial: still running or killed)" if report["partial"] else "")
        + f". Model: `{report['model']}`. {t['runs']} runs took {t['seconds']:.0f} s of wall "
        f"time and {t['cpu_seconds']:.0f} s of process CPU time, summed per run (resumed runs "
        "as they took).",
        "",
        f"{report['images']} held-out probe scenes (seeds from 9,700,000; {q.get('present')} "
        f"present, {q.get('cooccur')} cooccur and {q.get('other')} control questions); settings "
        f"chosen on {report['calibration']} "
        "calibration scenes (seeds from 8,700,000). In percent unless said. P_cooc / P_other: "
        "precision with the cooccur / the control questions (the same present questions); "
        "closed: share of greedy's gap closed by raising P_cooc; cost: recall points lost "
        "against greedy; flips: answers that differ from greedy's. shift: greedy's answers "
        "with the yes-minus-no logit moved by delta so that its recall equals the row's. "
        "McNemar: two-sided exact p on the present + cooccur questions (row right only / "
        "other right only). Captions: at most "
        f"{report['caption_tokens']} new tokens, the last unfinished sentence dropped; "
        "companion: captions naming an absent companion; obj recall: share of the scene's "
        "objects named; tokens: mean new tokens.",
    ]
    for pruning, part in report["prunings"].items():
        rows = part["rows"]
        lines += [
            "",
            f"## {pruning}: yes/no",
            "",
            "| method | setting | P_cooc | P_other | gap | closed | recall | cost | yes-ratio | "
            "flips | shift delta | shift P_cooc | shift closed | shift yes-ratio | "
            "McNemar vs greedy | McNemar vs shift | goal |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|---|",
        ]
        for r in rows:
            s = r.get("shift", {})
            delta = f"{s['delta']:+.2f}" if s else "-"
            lines.append(
                f"| {r.get('method', r['label'])} | {_setting_words(r)} | "
                f"{_pct(r['precision_cooccur'])} | {_pct(r['precision_other'])} | "
                f"{_pct(r['gap'])} | {_pct(r['closed'])} | {_pct(r['recall'])} | "
                f"{_pct(r['recall_cost'])} | {_pct(r['yes_ratio'])} | {r.get('flips', '-')} | "
                f"{delta} | {_pct(s.get('precision_cooccur'))} | {_pct(s.get('closed'))} | "
                f"{_pct(s.get('yes_ratio'))} | {_p(r.get('mcnemar_greedy'))} | "
                f"{_p(r.get('mcnemar_shift'))} | {_tick(r.get('goal_yes_no'))} |"
            )
        lines += [
            "",
            f"## {pruning}: captions",
            "",
            "| method | setting | CHAIR_i | CHAIR_s | companion | obj recall | tokens | words | "
            "goal |",
            "|---|---|---:|---:|---:|---:|---:|---:|---|",
        ]
        for r in rows:
            if "caption_CHAIR_i" not in r:
                continue
            lines.append(
                f"| {r.get('method', r['label'])} | {_setting_words(r)} | "
                f"{_pct(r['caption_CHAIR_i'])} | {_pct(r['caption_CHAIR_s'])} | "
                f"{_pct(r['caption_companion_rate'])} | {_pct(r['caption_recall'])} | "
                f"{r['caption_tokens']:.1f} | {r['caption_length']:.1f} | "
                f"{_tick(r.get('goal_captions'))} |"
            )
        lines += ["", *goal_lines(rows, pruning)]
    if report.get("embedded"):
        e = report["embedded"]
        lines += [
            "",
            f"## Embedded model ({Path(e['model']).name}): POPE adversarial and CHAIR",
            "",
            f"The shipped adversarial questions of the first {e['images']} held-out images "
            f"({e['questions']} questions, LLaVA suffix), greedy; every method at its defaults; "
            "the shift at each method's recall. McNemar on every question. Captions: "
            "organism prompt, 64 new tokens at most, unfinished sentence dropped.",
            "",
            "| row | accuracy | precision | recall | F1 | yes-ratio | McNemar vs greedy | "
            "McNemar vs shift | CHAIR_i | CHAIR_s | obj recall | tokens |",
            "|---|---:|---:|---:|---:|---:|---|---|---:|---:|---:|---:|",
        ]
        for r in e["rows"]:
            cap = "caption_CHAIR_i" in r
            lines.append(
                f"| {r['label']} | {_pct(r['accuracy'])} | {_pct(r['precision'])} | "
                f"{_pct(r['recall'])} | {_pct(r['f1'])} | {_pct(r['yes_ratio'])} | "
                f"{_p(r.get('mcnemar_greedy'))} | {_p(r.get('mcnemar_shift'))} | "
                + (
                    f"{_pct(r['caption_CHAIR_i'])} | {_pct(r['caption_CHAIR_s'])} | "
                    f"{_pct(r['caption_recall'])} | {r['caption_tokens']:.1f} |"
                    if cap
                    else "- | - | - | - |"
                )
            )
    lines += [
        "",
        "Calibration choices (largest calibration gain in P_cooc at a calibration recall cost "
        "<= 1 point; defaults when none qualifies): "
        + "; ".join(
            f"{p}: " + ", ".join(f"{m} {_words(o)}" for m, o in ch.items())
            for p, ch in report["chosen"].items()
        )
        + ". Caption choices (largest drop in captions naming an absent companion at a "
        "calibration cost <= 2 points of object recall; defaults when none qualifies): "
        + "; ".join(
            f"{p}: " + ", ".join(f"{m} {_words(o)}" for m, o in ch.items())
            for p, ch in report.get("caption_chosen", {}).items()
        )
        + ". Every calibration row is in the JSON file.",
        "",
        "![P_cooc against recall: the shift's curve and the methods](hallucination_quality.png)",
    ]
    return "\n".join(lines) + "\n"


def goal_lines(rows: list[dict], pruning: str) -> list[str]:
    """The goal lines and a plain reading of one pruning's rows."""
    ranked = [r for r in rows if r.get("setting") == "chosen"]
    yes_no = [r for r in ranked if r.get("goal_yes_no", {}).get("met")]
    for_captions = [r for r in rows if r.get("caption_setting")]
    caps = [r for r in for_captions if r.get("goal_captions", {}).get("met")]
    g = GOALS
    out = [
        f"**Yes/no goal** ({pruning}; calibrated settings: closes >= {100 * g['closed']:.0f}% of "
        f"the gap at <= {100 * g['recall_cost']:.0f} recall point, P_cooc above the shift at "
        f"equal recall, McNemar p < {g['p']} against greedy and against that shift): "
        + ("met by " + ", ".join(r["label"] for r in yes_no) if yes_no else "**not met**")
        + ".",
        "",
        f"**Caption goal** ({pruning}; settings chosen on calibration captions: >= "
        f"{100 * g['companion_drop']:.0f}% fewer captions "
        f"naming an absent companion, CHAIR_i down >= {100 * g['chair_drop']:.0f}% relative, "
        f"<= {100 * g['caption_recall_cost']:.0f} points of object recall lost): "
        + ("met by " + ", ".join(r["label"] for r in caps) if caps else "**not met**")
        + ".",
    ]
    best = max(
        (r for r in ranked if r["recall_cost"] <= g["recall_cost"] + 1e-12),
        key=lambda r: r["precision_cooccur"],
        default=None,
    )
    if best is not None:
        s = best["shift"]
        out += [
            "",
            f"Reading: among calibrated settings within {100 * g['recall_cost']:.0f} recall point, "
            f"{best['label']} has the highest P_cooc ({_pct(best['precision_cooccur'])}%, "
            f"closing {_pct(best['closed'])}% of the gap); the constant shift at its recall "
            f"reaches {_pct(s['precision_cooccur'])}% (closing {_pct(s['closed'])}%), "
            f"McNemar p = {best['mcnemar_shift']['p']:.3g} against it.",
        ]
    cut = [r for r in rows if r["kind"] == "cutoff only"]
    if cut:
        out += [
            "",
            "Cutoff only (the chosen cutoff, zero contrast weight): "
            + "; ".join(f"{r['method']}: {r['flips']} answers differ from greedy" for r in cut)
            + ".",
        ]
    return out


def plot(report: dict, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: skipped the plot", file=sys.stderr)
        return False
    parts = report["prunings"]
    fig, axes = plt.subplots(1, len(parts), figsize=(7 * len(parts), 5), squeeze=False)
    for ax, (pruning, part) in zip(axes[0], parts.items(), strict=True):
        shown = [100 * r["recall"] for r in part["rows"] if r["kind"] != "shift"]
        low = max(0.0, min(shown) - 20)  # the plot shows the recall around the methods
        curve = [c for c in part["shift_curve"] if 100 * c["recall"] >= max(low, 1e-9)]
        ax.plot(
            [100 * c["recall"] for c in curve],
            [100 * c["precision_cooccur"] for c in curve],
            color="grey",
            lw=1,
            label="constant shift of greedy's yes-no logit",
        )
        for r in part["rows"]:
            if r["kind"] == "shift":
                continue
            marker = {"greedy": "*", "defaults": "o", "chosen": "s", "cutoff only": "x"}[r["kind"]]
            ax.scatter(
                100 * r["recall"],
                100 * r["precision_cooccur"],
                marker=marker,
                label=r["label"],
                s=60 if r["kind"] == "greedy" else 30,
            )
        base = part["rows"][0]
        ax.axhline(
            100 * base["precision_other"],
            color="tab:green",
            lw=0.8,
            ls="--",
            label="greedy's P_other (no co-occurrence)",
        )
        ax.set_xlim(low, 101)
        ax.set_xlabel("recall (%)")
        ax.set_ylabel("P_cooc (%)")
        ax.set_title(f"{pruning}: methods against the shift's curve")
        ax.legend(fontsize=5)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


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
    (args.out / "hallucination_quality.json").write_text(json.dumps(_finite(full), indent=1))
    (args.out / "hallucination_quality.md").write_text(markdown(full))
    plot(full, args.out / "hallucination_quality.png")


if __name__ == "__main__":
    raise SystemExit(main())
