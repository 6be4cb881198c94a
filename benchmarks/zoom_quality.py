"""Attention-guided zoom on the organism: accuracy and mean latency of no zoom, always zoom and
adaptive zoom on the normal and the high-resolution POPE sets, and how often the zoom crop holds
the queried object.

Sets, both built from the same held-out POPE scenes (>= 3 objects, one POPE split, 3 present
and 3 absent categories per scene, ``Is there a {category} in the image?``):

* normal: the 192 x 192 scenes themselves, the native size the model was trained at;
* high-res: the same scenes placed whole on a ``--canvas`` canvas (576: the view shrinks them 3x,
  objects fall to 9-17 px, about one 16-px cell or less; :mod:`organism.highres`).

Methods, every one a ``zoom.look_closer`` call over the same batches:

* no zoom: ``route="never"`` (the plain pass);
* always zoom: ``route="always"``, the organism's default re-ask (``crop``: the crop alone), and
  also ``mode="both"`` (image + crop, a two-image prompt the organism never saw in training);
* adaptive zoom: ``route="adaptive"`` at the calibrated threshold of each ``--recall``, once
  routed by the first token's ``--statistic`` (a plain pass first) and once by the attention
  map's ``--map-statistic`` (the map first, for every question the zoom can crop).

Routing statistics (``zoom.STATISTICS``, low = zoom): first-token ``top1`` and ``margin``;
attention-map ``peak`` (1 - the peak cell's share), ``entropy`` (normalised entropy of the
cells) and ``outside`` (the map's mass outside the zoom's crop). Each one's AUROC for a wrong
plain answer is reported on the calibration and the test questions (normal, high-res, both),
with its accuracy-against-routed-share curve on the high-res test questions.

Chosen on calibration scenes (seeds from 8,500,000, never the test scenes):

* the map's layers and the crop anchor: the candidate whose crops hold the queried object most
  often on high-res calibration questions about present objects;
* the threshold: the conformal quantile (``zoom.calibrate``) at recall ``r`` of the hard cases
  (plain answer wrong) of the calibration questions of both sets together (a map statistic has a
  score only where the zoom can crop: the high-res questions);
* the map statistic (``--map-statistic auto``): the one with the best high-res calibration AUROC.

Goals: on high-res, adaptive zoom recovers at least half of the accuracy the downscaling loses
(against the same scenes at native size) while routing at most 50% of the questions (issue 17),
and the attention-map routing finds the hard cases with AUROC >= 0.8; on the normal set it loses
nothing (within 0.5 points).

    python benchmarks/zoom_quality.py [--images 50] [--calibration-images 30] [--threads 2]
        [--statistic top1] [--map-statistic auto]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from tqdm import tqdm

from organism import highres
from organism.pope import pope_questions
from vlm_focus import grounding as G
from vlm_focus import zoom
from vlm_focus.asset_paths import default_model_path
from vlm_focus.eval.metrics import auroc, parse_yes_no, pope_metrics
from vlm_focus.geometry import Frame
from vlm_focus.loading import build_inputs, load_model
from vlm_focus.model_adapters import get_adapter

CALIBRATION_SEED = 8_500_000
LAYER_CANDIDATES = {"layer 0": [0], "layer 1": [1], "layer 2": [2], "layer 3": [3], "all": None}


# --- data ------------------------------------------------------------------------------------
def build_sets(n: int, canvas: int, split: str, first_seed: int | None) -> dict:
    """Native and high-res versions of the same POPE questions (one row list, two images)."""
    placed = highres.highres_scenes(n, canvas=canvas, first_seed=first_seed)
    native_rows = pope_questions([s.native for s in placed], split)
    high_rows = highres.highres_pope(placed, split)
    strip = [(r["image_id"], r["text"], r["label"]) for r in native_rows]
    if strip != [(r["image_id"], r["text"], r["label"]) for r in high_rows]:
        raise RuntimeError("placement changed the POPE questions")
    by_seed = {s.seed: s for s in placed}
    return {"rows": native_rows, "scenes": by_seed}


def images_of(data: dict, which: str) -> list[Image.Image]:
    cache: dict[int, Image.Image] = {}
    out = []
    for r in data["rows"]:
        seed = r["image_id"]
        if seed not in cache:
            s = data["scenes"][seed]
            cache[seed] = Image.fromarray(s.native_image() if which == "normal" else s.image())
        out.append(cache[seed])
    return out


def object_box(data: dict, row: dict, which: str) -> tuple[int, int, int, int] | None:
    s = data["scenes"][row["image_id"]]
    category = row["category_id"] - 1
    if which == "normal":
        found = s.native.find(category)
        return None if found is None else found.box(s.native.size)
    return s.box(category)


def batches(n: int, size: int) -> list[slice]:
    return [slice(i, min(i + size, n)) for i in range(0, n, size)]


# --- calibration -----------------------------------------------------------------------------
def choose_map(model, processor, data: dict, batch: int) -> dict:
    """Per layer set and anchor, on high-res calibration questions about present objects: how
    often the crop is a real zoom (smaller than the image) that covers the whole object. The
    best candidate wins (the first in candidate order on a tie)."""
    images = images_of(data, "high")
    rows = data["rows"]
    positives = [i for i, r in enumerate(rows) if r["label"] == "yes"]
    table, covers = {}, {}
    every = list(range(len(get_adapter(model).decoder_layers(model))))
    for name, layers in LAYER_CANDIDATES.items():
        layers = every if layers is None else layers  # "all": every layer, as look_closer reads
        useful = {"box": 0, "peak": 0}
        covered = {"box": 0, "peak": 0}
        for part in batches(len(positives), batch):
            idx = positives[part]
            pictures = [images[i] for i in idx]
            inputs = build_inputs(processor, pictures, [rows[i]["text"] for i in idx])
            gp = G.GroundingPass(model, inputs, processor=processor, images=pictures, layers=layers)
            for j, i in enumerate(idx):
                heat = gp.map(rows[i]["category"], row=j, source="prompt")
                box = object_box(data, rows[i], "high")
                for anchor in useful:
                    _, (crop,) = zoom.choose_crops(heat, processor=processor, anchor=anchor)
                    hit = crop.covers(box)
                    covered[anchor] += hit
                    useful[anchor] += hit and not crop.is_whole(heat.size)
        for anchor in useful:
            table[(name, anchor)] = useful[anchor] / len(positives)
            covers[(name, anchor)] = covered[anchor] / len(positives)
    best = max(table, key=lambda k: table[k])
    return {
        "table": {f"{k[0]}, {k[1]}": v for k, v in table.items()},
        "covers": {f"{k[0]}, {k[1]}": v for k, v in covers.items()},
        "layers": LAYER_CANDIDATES[best[0]],
        "layers_name": best[0],
        "anchor": best[1],
        "n_positives": len(positives),
    }


def all_statistics(model, processor, images, rows, batch: int, choice: dict) -> dict:
    """Plain answers and every routing statistic of each question, read as ``look_closer``
    reads them (``zoom.routing_statistics``, the chosen map). Where the zoom cannot crop (the
    normal set) the library computes no map statistic; for the AUROC table they are read here
    from the same map (``zoom.map_statistic`` on ``zoom.choose_crops``)."""
    answers: list[str] = []
    values: dict[str, list] = {name: [] for name in zoom.STATISTICS}
    for part in batches(len(rows), batch):
        texts, got = zoom.routing_statistics(
            model, processor, images[part], [r["text"] for r in rows[part]],
            focus=[r["category"] for r in rows[part]], layers=choice["layers"],
            anchor=choice["anchor"], max_new_tokens=4,
        )  # fmt: skip
        answers += texts
        missing = [j for j, v in enumerate(got[zoom.MAP_STATISTICS[0]]) if v is None]
        if missing:
            idx = [part.start + j for j in missing]
            pictures = [images[i] for i in idx]
            inputs = build_inputs(processor, pictures, [rows[i]["text"] for i in idx])
            layers = choice["layers"]
            if layers is None:  # as look_closer reads it: every layer
                layers = list(range(len(get_adapter(model).decoder_layers(model))))
            gp = G.GroundingPass(model, inputs, processor=processor, images=pictures, layers=layers)
            for k, (j, i) in enumerate(zip(missing, idx, strict=True)):
                heat = gp.map(rows[i]["category"], row=k, source="prompt")
                _, crops = zoom.choose_crops(heat, processor=processor, anchor=choice["anchor"])
                for name in zoom.MAP_STATISTICS:
                    got[name][j] = zoom.map_statistic(heat, name, crops)
        for name in zoom.STATISTICS:
            values[name] += got[name]
    hard = [parse_yes_no(a)[0] != r["label"] for a, r in zip(answers, rows, strict=True)]
    return {"answers": answers, "values": values, "hard": hard}


def auroc_table(stats: dict) -> dict:
    """AUROC of a low score for a wrong plain answer, per statistic and set (and pooled)."""
    out: dict = {}
    for name in zoom.STATISTICS:
        row, pooled_s, pooled_h = {}, [], []
        for which, st in stats.items():
            scores = [-v for v in st["values"][name]]
            row[which] = auroc(scores, st["hard"])
            pooled_s += scores
            pooled_h += st["hard"]
        row["both"] = auroc(pooled_s, pooled_h)
        out[name] = row
    return out


# --- evaluation ------------------------------------------------------------------------------
def run_methods(
    model, processor, images: dict, rows, batch: int, methods: dict
) -> dict[str, dict[str, list[zoom.ZoomAnswer]]]:
    """Every method on every set and batch, interleaved batch by batch (the order of the
    (set, method) pairs rotating), so that a changing load on the machine hits all alike."""
    pairs = [(which, name) for which in images for name in methods]
    out: dict = {which: {name: [] for name in methods} for which in images}
    for k, part in enumerate(tqdm(batches(len(rows), batch), desc="test batches")):
        questions = [r["text"] for r in rows[part]]
        focus = [r["category"] for r in rows[part]]
        for which, name in pairs[k % len(pairs) :] + pairs[: k % len(pairs)]:
            out[which][name] += zoom.look_closer(
                model, processor, images[which][part], questions, focus=focus, max_new_tokens=4,
                **methods[name],
            )  # fmt: skip
    return out


def chance_cover(crop: Frame, box, width: int, height: int) -> float:
    """Probability that a crop of the same size at a uniformly random position covers ``box``."""
    bx, by, bw, bh = box
    nx, ny = width - crop.width + 1, height - crop.height + 1
    ok_x = max(0, min(bx, width - crop.width) - max(0, bx + bw - crop.width) + 1)
    ok_y = max(0, min(by, height - crop.height) - max(0, by + bh - crop.height) + 1)
    return (ok_x / nx) * (ok_y / ny)


def summarise(found: list[zoom.ZoomAnswer], rows, data, which: str) -> dict:
    preds = [parse_yes_no(f.answer)[0] for f in found]
    labels = [r["label"] for r in rows]
    m = pope_metrics(labels, preds)
    size = 192 if which == "normal" else next(iter(data["scenes"].values())).canvas
    cover = centre = chance = 0.0
    n_pos_zoomed = 0
    for f, r in zip(found, rows, strict=True):
        if r["label"] != "yes" or not f.zoomed:
            continue
        box = object_box(data, r, which)
        (crop,) = f.crops
        n_pos_zoomed += 1
        cover += crop.covers(box)
        centre += crop.contains(box[0] + box[2] / 2, box[1] + box[3] / 2)
        chance += chance_cover(crop, box, size, size)
    n = len(found)
    return {
        "accuracy": m["accuracy"],
        "f1": m["f1"],
        "yes_ratio": m["yes_ratio"],
        "unparseable": sum(not parse_yes_no(f.answer)[1] for f in found),
        "mean_latency_ms": 1000 * float(np.mean([f.seconds["total"] for f in found])),
        "phase_ms": {
            phase: 1000 * float(np.mean([f.seconds[phase] for f in found]))
            for phase in ("plain", "map", "reask")
        },
        "routed": sum(f.routed for f in found) / n,
        "zoomed": sum(f.zoomed for f in found) / n,
        "positives_zoomed": n_pos_zoomed,
        "crop_covers_object": cover / n_pos_zoomed if n_pos_zoomed else None,
        "crop_holds_centre": centre / n_pos_zoomed if n_pos_zoomed else None,
        "chance_cover": chance / n_pos_zoomed if n_pos_zoomed else None,
        "n": n,
    }


def curve(plain_ok, zoom_ok, conf) -> dict:
    """Accuracy against the routed share when the ``k`` least confident questions are zoomed
    (the adaptive rule at every threshold), and the random-routing line."""
    order = np.argsort(np.asarray(conf), kind="mergesort")
    plain_ok, zoom_ok = np.asarray(plain_ok, float), np.asarray(zoom_ok, float)
    n = len(order)
    shares, accs = [0.0], [plain_ok.mean()]
    acc = plain_ok.sum()
    for k, i in enumerate(order, start=1):
        acc += zoom_ok[i] - plain_ok[i]
        shares.append(k / n)
        accs.append(acc / n)
    random_line = [plain_ok.mean() + s * (zoom_ok.mean() - plain_ok.mean()) for s in shares]
    return {"share": shares, "accuracy": accs, "random": random_line}


# --- report ----------------------------------------------------------------------------------
def draw(path: Path, report: dict, example: dict | None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.4))
    ax = axes[0]
    names = list(report["results"]["high-res"])
    x = np.arange(len(names))
    for k, (which, colour) in enumerate([("normal", "#4c72b0"), ("high-res", "#dd8452")]):
        accs = [report["results"][which][m]["accuracy"] for m in names]
        bars = ax.bar(x + (k - 0.5) * 0.38, accs, 0.38, label=which, color=colour)
        for b, m in zip(bars, names, strict=True):
            ratio = time_ratio(report["results"][which], m)
            ax.text(b.get_x() + b.get_width() / 2, b.get_height() + 0.01, f"{ratio:.1f}x",
                    ha="center", fontsize=6, rotation=90)  # fmt: skip
    ax.set_xticks(x, [n.replace(" (", "\n(").replace(", ", ",\n") for n in names], fontsize=7)
    ax.set_ylim(0.4, 1.12)
    ax.set_ylabel("POPE accuracy")
    ax.set_title("accuracy (bars) and time per question vs no zoom (labels)", fontsize=9)
    ax.legend(fontsize=8, loc="lower right")

    ax = axes[1]
    colours = dict(zip(report["curves_high_res"], ["#dd8452", "#8172b3", "#55a868", "#c44e52",
                                                    "#4c72b0"]))  # fmt: skip
    auc = report["test_auroc_hard"]
    for name, c in report["curves_high_res"].items():
        ax.plot(c["share"], c["accuracy"], color=colours[name], lw=1.1,
                label=f"{name} (AUROC {auc[name]['high-res']:.2f})")  # fmt: skip
    c = next(iter(report["curves_high_res"].values()))
    ax.plot(c["share"], c["random"], "--", label="random routing", color="grey")
    goal = report["goal"]
    ax.axhline(goal["half_recovered_accuracy"], color="green", lw=0.8, ls=":",
               label="half of the loss recovered")  # fmt: skip
    ax.axvline(0.5, color="black", lw=0.6, ls=":")
    for name, point in report["adaptive_points_high_res"].items():
        statistic = name.split()[1].rstrip(",")
        ax.plot([point["routed"]], [point["accuracy"]], "o", color=colours[statistic])
        ax.annotate(name.replace("adaptive ", "").replace("recall ", "r"),
                    (point["routed"], point["accuracy"]), fontsize=6,
                    textcoords="offset points", xytext=(4, -9))  # fmt: skip
    ax.set_xlabel("share of questions zoomed (lowest score first)")
    ax.set_ylabel("high-res accuracy")
    ax.set_title("routing curves by statistic (high-res test); dots: conformal thresholds",
                 fontsize=9)  # fmt: skip
    ax.legend(fontsize=6, loc="lower right")

    ax = axes[2]
    if example is not None:
        ax.imshow(example["image"])
        ax.imshow(example["map"], alpha=0.45, cmap="magma",
                  extent=(0, example["image"].width, example["image"].height, 0))  # fmt: skip
        for (bx, by, bw, bh), colour, label in [
            (example["crop"], "cyan", "zoom crop"),
            (example["object"], "lime", "object"),
        ]:
            ax.add_patch(plt.Rectangle((bx, by), bw, bh, fill=False, color=colour, lw=1.5,
                                       label=label))  # fmt: skip
        ax.set_title(f"{example['question']}\nplain: {example['plain']}, zoomed: "
                     f"{example['zoomed']}", fontsize=8)  # fmt: skip
        ax.legend(fontsize=7, loc="lower left")
    ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def time_ratio(methods: dict, name: str) -> float:
    """Mean time per question of ``name`` over the same set's no-zoom run (CPU times are
    quoted only as ratios)."""
    return methods[name]["mean_latency_ms"] / methods["no zoom"]["mean_latency_ms"]


def pct(v) -> str:
    return "-" if v is None else f"{100 * v:.1f}%"


def write_markdown(path: Path, report: dict) -> None:
    r = report
    lines = [
        "# Attention-guided zoom on the organism",
        "",
        f"Model: embedded organism-default (`model.safetensors` sha256 `{r['model_sha'][:12]}...`)."
        f" Machine: {r['machine']}. {r['versions']}. Run took {r['seconds']:.0f} s.",
        "",
        f"Command: `{r['command']}`",
        "",
        f"Test set: {r['n_scenes']} held-out POPE scenes, split `{r['split']}`, "
        f"{r['n_questions']} questions per set, prompt `Is there a {{category}} in the image?` "
        "in the chat template, greedy, answers parsed by the POPE rule. normal = the 192 x 192 "
        f"scenes (native size); high-res = the same scenes placed whole on a {r['canvas']} x "
        f"{r['canvas']} canvas (shrunk {r['canvas'] / 192:g}x in the model's view). Batch "
        f"{r['batch']}; time = wall time per question, batch time divided evenly, as a ratio "
        "to the same set's no zoom; every (set, method) pair runs interleaved batch by batch, "
        "so that the shared machine's changing load hits all alike (mean seconds per phase: "
        "plain pass / map / re-ask in the JSON).",
        "",
        f"Calibration: {r['n_calibration_scenes']} scenes from seed {CALIBRATION_SEED:,} "
        f"({r['calibration']['n_questions']} questions per set). Zoom settings: "
        f"re-ask `{r['mode']}` (the organism's default), margin 0.25, minimum crop side "
        f"'view' = {r['native_side']} px (the encoder's input: a crop reaches it at <= 1:1), "
        "aspect of the model's view (square).",
        "",
        "## Where the map is read (chosen on high-res calibration questions about present "
        "objects: a crop smaller than the image that covers the whole object)",
        "",
        "| map | anchor | zoomed crop covers the object | crop covers it (whole image included) |",
        "|---|---|---|---|",
    ]
    for key, v in r["map_choice"]["table"].items():
        layer, anchor = key.split(", ")
        mark = " (chosen)" if (layer, anchor) == (r["map_choice"]["layers_name"],
                                                   r["map_choice"]["anchor"]) else ""  # fmt: skip
        covers = r["map_choice"]["covers"][key]
        lines.append(f"| {layer} | {anchor}{mark} | {pct(v)} | {pct(covers)} |")
    lines += [
        "",
        "## Routing thresholds (conformal at recall r of the calibration hard cases; the first-"
        "token statistic over both sets, the map statistic over the questions the zoom can crop, "
        "the high-res ones)",
        "",
        "| statistic | recall r | threshold | hard cases | calibration routed | "
        "calibration hard routed |",
        "|---|---|---|---|---|---|",
    ]
    for statistic, by_recall in r["calibration"]["thresholds"].items():
        for name, cal in by_recall.items():
            lines.append(
                f"| {statistic} | {name} | {cal['threshold']:.6f} | {cal['n_hard']} of "
                f"{cal['n']} | {pct(cal['routed'])} | {pct(cal['hard_routed'])} |"
            )
    lines += [
        "",
        "How well each routing statistic finds the hard cases (AUROC of a low score for a wrong "
        "plain answer; 0.5 = chance, nan = no wrong answer in that set). Map statistics on the "
        "normal set are read from the same map for this table only: the zoom cannot crop there, "
        "so the library neither maps nor routes those questions.",
        "",
        "| statistic | kind | calibration normal | calibration high-res | calibration both | "
        "test normal | test high-res | test both |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for statistic, a in r["calibration"]["auroc_hard"].items():
        t = r["test_auroc_hard"][statistic]
        kind = "first token" if statistic in zoom.TOKEN_STATISTICS else "attention map"
        mark = " (chosen map statistic)" if statistic == r["map_statistic"] else ""
        lines.append(
            f"| {statistic}{mark} | {kind} | {a['normal']:.3f} | {a['high-res']:.3f} | "
            f"{a['both']:.3f} | {t['normal']:.3f} | {t['high-res']:.3f} | {t['both']:.3f} |"
        )
    lines += [
        "",
        "## Results",
        "",
        "| set | method | accuracy | F1 | yes-ratio | time vs no zoom | routed | zoomed | "
        "crop covers object | crop holds its centre | chance (random crop, same size) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for which, methods in r["results"].items():
        for name, m in methods.items():
            lines.append(
                f"| {which} | {name} | {m['accuracy']:.3f} | {m['f1']:.3f} | "
                f"{m['yes_ratio']:.3f} | {time_ratio(methods, name):.2f}x | {pct(m['routed'])} | "
                f"{pct(m['zoomed'])} | {pct(m['crop_covers_object'])} | "
                f"{pct(m['crop_holds_centre'])} | {pct(m['chance_cover'])} |"
            )
    g = r["goal"]
    lines += [
        "",
        "Crop columns: over the zoomed questions about present objects, against the exact "
        "ground-truth boxes.",
        "",
        "## Goal",
        "",
        f"- Accuracy lost to downscaling: {g['native_accuracy']:.3f} (normal, no zoom) - "
        f"{g['highres_plain_accuracy']:.3f} (high-res, no zoom) = {g['loss']:.3f}; half of it "
        f"recovered means high-res accuracy >= {g['half_recovered_accuracy']:.3f}.",
    ]
    for name, v in g["adaptive"].items():
        lines.append(
            f"- {name}: high-res {v['accuracy']:.3f}, recovers {pct(v['recovered'])} of the loss "
            f"(random routing of the same share: {pct(v['random_recovered'])}), routes "
            f"{pct(v['routed'])}, time {v['time_ratio']:.2f}x no zoom; normal "
            f"{v['normal_accuracy']:.3f} ({v['normal_delta'] * 100:+.1f} points). Goal met: "
            f"**{v['met']}** (recovery >= 50%: {v['recovered'] >= 0.5}, routed <= 50%: "
            f"{v['routed'] <= 0.5}, normal within 0.5 points: {v['normal_delta'] >= -0.005})."
        )
    lines += [
        f"- Attention-map routing ({g['map_statistic']}, chosen on calibration) finds the "
        f"high-res hard cases with test AUROC {g['map_auroc_high_res']:.3f}: goal >= 0.8 met: "
        f"**{g['map_auroc_met']}**.",
        f"- Always zoom (no routing): high-res {g['always_accuracy']:.3f}, recovers "
        f"{pct(g['always_recovered'])} of the loss.",
        "- Best operating point with at most 50% routed, per statistic (threshold sweep on the "
        "test questions themselves, not a calibrated result): "
        + ", ".join(
            f"{name} {v['accuracy']:.3f} ({pct(v['recovered'])})"
            for name, v in g["oracle_half"].items()
        )
        + f"; random routing of 50% recovers {pct(g['random_half_recovered'])}.",
        f"- Adaptive answers that differ from the plain (not zoomed) or always-zoom (zoomed) "
        f"answer of the same question: {g['mismatches']} (a routed subset is batched differently).",
        "",
        "![zoom quality](zoom_quality.png)",
        "",
    ]
    path.write_text("\n".join(lines))


# --- main ------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--images", type=int, default=50, help="held-out POPE scenes")
    parser.add_argument("--calibration-images", type=int, default=30)
    parser.add_argument("--canvas", type=int, default=576)
    parser.add_argument("--split", default="adversarial")
    parser.add_argument("--recall", type=float, nargs="+", default=[0.9, 0.5])
    parser.add_argument(
        "--statistic", choices=zoom.TOKEN_STATISTICS, default="top1",
        help="first-token statistic of the first adaptive runs",
    )  # fmt: skip
    parser.add_argument(
        "--map-statistic", choices=("auto", *zoom.MAP_STATISTICS), default="auto",
        help="attention-map statistic of the second adaptive runs (auto: best high-res "
        "calibration AUROC)",
    )  # fmt: skip
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    model, processor = load_model(None)
    native_side = zoom.native_side(processor)

    # calibration: where to read the map, and the thresholds
    cal_data = build_sets(args.calibration_images, args.canvas, args.split, CALIBRATION_SEED)
    print(f"calibration: {len(cal_data['rows'])} questions per set; choosing the map ...")
    choice = choose_map(model, processor, cal_data, args.batch)
    print(f"  map: {choice['layers_name']}, anchor {choice['anchor']}")
    cal_images = {"normal": images_of(cal_data, "normal"), "high-res": images_of(cal_data, "high")}
    cal_stats = {
        which: all_statistics(model, processor, imgs, cal_data["rows"], args.batch, choice)
        for which, imgs in tqdm(cal_images.items(), desc="calibration statistics")
    }
    auroc_hard = auroc_table(cal_stats)
    map_statistic = args.map_statistic
    if map_statistic == "auto":
        map_statistic = max(zoom.MAP_STATISTICS, key=lambda k: auroc_hard[k]["high-res"])
    print(f"  map statistic: {map_statistic}")

    def calibrated(statistic: str, r: float) -> zoom.Calibration:
        """The conformal threshold over both sets' calibration questions that the library
        scores (a map statistic: the questions the zoom can crop, i.e. high-res)."""
        scores, hard = [], []
        for which, st in cal_stats.items():
            library_scores = st["values"][statistic]
            if statistic in zoom.MAP_STATISTICS and which == "normal":
                continue  # the zoom cannot crop there: no library score, never routed
            scores += library_scores
            hard += st["hard"]
        return zoom.calibrate(scores, hard, recall=r, statistic=statistic)

    thresholds = {
        statistic: {f"recall {r:g}": calibrated(statistic, r) for r in args.recall}
        for statistic in (args.statistic, map_statistic)
    }
    for statistic, by_recall in thresholds.items():
        for name, cal in by_recall.items():
            print(f"  {statistic}, {name}: threshold {cal.threshold:.6f}, routes {cal.routed:.1%}")

    # test
    data = build_sets(args.images, args.canvas, args.split, None)
    rows = data["rows"]
    common = dict(layers=choice["layers"], anchor=choice["anchor"])
    methods = {"no zoom": dict(route="never"), "always zoom (crop)": dict(route="always"),
               "always zoom (both)": dict(route="always", mode="both")}  # fmt: skip
    for statistic, by_recall in thresholds.items():
        for name, cal in by_recall.items():
            methods[f"adaptive {statistic}, {name}"] = dict(
                route="adaptive", threshold=cal.threshold, statistic=statistic
            )
    results: dict = {}
    images = {"normal": images_of(data, "normal"), "high-res": images_of(data, "high")}
    warm = images["high-res"][: min(4, len(rows))]
    zoom.look_closer(model, processor, warm, [r["text"] for r in rows[: len(warm)]], **common)
    settings = {name: {**common, **options} for name, options in methods.items()}
    raw = run_methods(model, processor, images, rows, args.batch, settings)
    for which, found_by in raw.items():
        results[which] = {
            name: summarise(found, rows, data, which) for name, found in found_by.items()
        }
    test_stats = {
        which: all_statistics(model, processor, imgs, rows, args.batch, choice)
        for which, imgs in tqdm(images.items(), desc="test statistics")
    }
    test_auroc = auroc_table(test_stats)
    # consistency: adaptive = plain where not routed, always-zoom where zoomed
    mismatches = 0
    for which in raw:
        plain_answers = [f.answer for f in raw[which]["no zoom"]]
        always = [f.answer for f in raw[which]["always zoom (crop)"]]
        for name in methods:
            if not name.startswith("adaptive"):
                continue
            for f, pl, z in zip(raw[which][name], plain_answers, always, strict=True):
                mismatches += f.answer != (z if f.zoomed else pl)

    labels = [r["label"] for r in rows]
    hi = raw["high-res"]
    plain_ok = [parse_yes_no(f.answer)[0] == lab for f, lab in zip(hi["no zoom"], labels)]
    zoom_ok = [parse_yes_no(f.answer)[0] == lab for f, lab in zip(hi["always zoom (crop)"], labels)]
    sweeps = {
        name: curve(plain_ok, zoom_ok, test_stats["high-res"]["values"][name])
        for name in zoom.STATISTICS
    }
    native = results["normal"]["no zoom"]["accuracy"]
    low = results["high-res"]["no zoom"]["accuracy"]
    loss = native - low
    half = low + loss / 2
    always_acc = results["high-res"]["always zoom (crop)"]["accuracy"]
    k = int(math.floor(0.5 * len(rows)))
    goal = {
        "native_accuracy": native,
        "highres_plain_accuracy": low,
        "loss": loss,
        "half_recovered_accuracy": half,
        "always_accuracy": always_acc,
        "always_recovered": (always_acc - low) / loss,
        "random_half_recovered": (sweeps[args.statistic]["random"][k] - low) / loss,
        "oracle_half": {
            name: {
                "accuracy": max(c["accuracy"][: k + 1]),
                "recovered": (max(c["accuracy"][: k + 1]) - low) / loss,
            }
            for name, c in sweeps.items()
        },
        "map_statistic": map_statistic,
        "map_auroc_high_res": test_auroc[map_statistic]["high-res"],
        "map_auroc_met": test_auroc[map_statistic]["high-res"] >= 0.8,
        "mismatches": int(mismatches),
        "adaptive": {},
    }
    points: dict = {}
    for name in methods:
        if not name.startswith("adaptive"):
            continue
        h = results["high-res"][name]
        nrm = results["normal"][name]
        recovered = (h["accuracy"] - low) / loss
        delta = nrm["accuracy"] - native
        met = recovered >= 0.5 and h["routed"] <= 0.5 and delta >= -0.005
        goal["adaptive"][name] = {
            "accuracy": h["accuracy"], "recovered": recovered, "routed": h["routed"],
            "random_recovered": h["routed"] * (always_acc - low) / loss,
            "normal_accuracy": nrm["accuracy"], "normal_delta": delta, "met": met,
            "time_ratio": time_ratio(results["high-res"], name),
        }  # fmt: skip
        points[name] = {"routed": h["routed"], "accuracy": h["accuracy"]}

    example = None
    for f, r in zip(hi["always zoom (crop)"], rows):
        if r["label"] == "yes" and f.zoomed and f.map is not None:
            s = data["scenes"][r["image_id"]]
            example = {
                "image": Image.fromarray(s.image()),
                "map": f.map.pixels.numpy(),
                "crop": f.crops[0].xywh,
                "object": s.box(r["category_id"] - 1),
                "question": r["text"],
                "plain": hi["no zoom"][rows.index(r)].answer,
                "zoomed": f.answer,
            }
            break

    weights = default_model_path() / "model.safetensors"
    report = {
        "command": " ".join(["python benchmarks/zoom_quality.py", *(argv or sys.argv[1:])]),
        "machine": f"{platform.machine()} {platform.processor() or ''} "
        f"({torch.get_num_threads()} threads), "
        + (torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU"),
        "versions": f"torch {torch.__version__}, transformers {_version('transformers')}",
        "model_sha": hashlib.sha256(weights.read_bytes()).hexdigest(),
        "seconds": time.perf_counter() - started,
        "split": args.split,
        "canvas": args.canvas,
        "batch": args.batch,
        "n_scenes": args.images,
        "n_calibration_scenes": args.calibration_images,
        "n_questions": len(rows),
        "statistic": args.statistic,
        "map_statistic": map_statistic,
        "mode": zoom.default_mode(model),
        "native_side": native_side,
        "map_choice": choice,
        "calibration": {
            "n_questions": len(cal_data["rows"]),
            "auroc_hard": auroc_hard,
            "thresholds": {
                st: {k: v.to_json() for k, v in by.items()} for st, by in thresholds.items()
            },
        },
        "test_auroc_hard": test_auroc,
        "results": results,
        "goal": goal,
        "curves_high_res": sweeps,
        "adaptive_points_high_res": points,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "zoom_quality.json").write_text(json.dumps(report, indent=1) + "\n")
    write_markdown(args.out / "zoom_quality.md", report)
    draw(args.out / "zoom_quality.png", report, example)
    print((args.out / "zoom_quality.md").read_text())
    return 0


def _version(name: str) -> str:
    from importlib.metadata import version

    return version(name)


if __name__ == "__main__":
    raise SystemExit(main())
