"""Grounding and hallucination-mitigation quality on the embedded organism model's held-out scenes.

Measures, on generated scenes with exact boxes (``organism``):

* pointing game: the peak of the attention map read at the query's category token lands inside
  the queried object's box (layer 0, all layers, localization heads, relative attention, and the
  last prompt token as the query), against chance (the box's share of the image) and against
  landing on another object of the scene;
* COCO box AP (pycocotools) of ``grounding.boxes`` on the same maps, scored by blob mass or by
  the MTLA region score, over present and absent category queries;
* hallucination AUROC of the MTLA region score (present vs absent queried objects), next to the
  model's own P(yes) and VAS;
* POPE (random / popular / adversarial) accuracy, F1 and predicted yes-ratio of greedy decoding
  and of each mitigation (attention_reweight, visual_beam, instruction_contrast).

Writes ``grounding_quality.md``, ``grounding_quality.json``, ``grounding_quality.png``,
``grounding_examples.png`` and ``grounding_heads_organism.json`` under ``--out``.

    python benchmarks/grounding_quality.py                      # the shipped organism model
    python benchmarks/grounding_quality.py --images 100 --pope-images 50
    python benchmarks/grounding_quality.py --smoke   # random tiny model, temp dir: runs, no meaning
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from organism.pope import SPLITS, pope_eligible, pope_questions
from organism.questions import negative_category
from organism.scenes import (
    CATEGORIES,
    IMAGE_SIZE,
    coco_instances,
    generate_scene,
    heldout_scenes,
)
from organism.vocab import CAPTION_PROMPT, NO, POPE_SUFFIX, YES, presence_question
from vlm_focus import grounding as G
from vlm_focus import hallucination as H
from vlm_focus.eval import metrics
from vlm_focus.eval.coco import coco_gt
from vlm_focus.eval.pope import evaluate
from vlm_focus.geometry import Size
from vlm_focus.setting import RunSetting

CALIBRATION_SEED_BASE = 8_500_000  # neither training (>= 10M), held-out (9M) nor probe (8M)
QUERY_SEED = 4242


def _progress(items, desc: str):
    try:
        from tqdm import tqdm

        return tqdm(items, desc=desc, leave=False)
    except ImportError:
        return items


# --- model and inputs -----------------------------------------------------------------------
def load(args: argparse.Namespace):
    if args.smoke:
        from transformers import LlavaForConditionalGeneration

        from organism.vocab import SPECS, build_config, build_processor

        torch.manual_seed(0)
        config = build_config(SPECS["tiny"])
        config._attn_implementation = "sdpa"
        model = LlavaForConditionalGeneration(config).eval()
        return model, build_processor(SPECS["tiny"]), "random tiny organism (smoke test)"
    from vlm_focus.loading import load_model

    model, processor = load_model(args.model, dtype=torch.float32, attn_implementation="sdpa")
    return model.eval(), processor, str(args.model or "embedded organism-default")


def make_inputs(processor, scenes, questions) -> dict:
    prompts = [
        processor.apply_chat_template(
            [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": q}]}],
            add_generation_prompt=True,
        )
        for q in questions
    ]
    images = [Image.fromarray(s.image()) for s in scenes]
    return dict(processor(images=images, text=prompts, padding=True, return_tensors="pt"))


def batches(n: int, size: int):
    for start in range(0, n, size):
        yield slice(start, min(start + size, n))


# --- metrics: the library's, vlm_focus.eval.metrics ----------------------------------------
def present_vs_absent(present: list[float], absent: list[float]) -> float:
    """AUROC of scores of present (positive) against absent queries: the probability that a
    random present one scores above a random absent one, ties counted half
    (:func:`vlm_focus.eval.metrics.auroc`)."""
    return metrics.auroc([*present, *absent], [True] * len(present) + [False] * len(absent))


def roc_curve(positive: list[float], negative: list[float]) -> tuple[np.ndarray, np.ndarray]:
    scores = np.concatenate([positive, negative])
    labels = np.concatenate([np.ones(len(positive)), np.zeros(len(negative))])
    order = np.argsort(-scores, kind="stable")
    tp = np.concatenate([[0], np.cumsum(labels[order])]) / max(len(positive), 1)
    fp = np.concatenate([[0], np.cumsum(1 - labels[order])]) / max(len(negative), 1)
    return fp, tp


def inside(point: tuple[float, float], box) -> bool:
    """Pointing-game hit on one ``[x, y, w, h]`` box, borders included
    (:func:`vlm_focus.eval.metrics.point_in_boxes`)."""
    return metrics.point_in_boxes(point, [box])


def box_ap(gt, detections: list[dict]) -> tuple[float, float]:
    """(AP@[.5:.95], AP50) of ``detections`` against ``gt`` (a ``pycocotools`` COCO):
    :func:`vlm_focus.eval.metrics.coco_box_ap`, 0 for an empty detection list."""
    result = metrics.coco_box_ap(gt, detections)
    return result["AP"], result["AP50"]


# --- grounding ------------------------------------------------------------------------------
def grounding_queries(scenes) -> list[tuple]:
    """(scene, category, present) per query: every present category and as many absent ones
    (a third hard, a third companion, a third random, as in training)."""
    rng = np.random.default_rng(QUERY_SEED)
    out = []
    for s in scenes:
        for c in s.categories:
            out.append((s, c, True))
        for _ in s.categories:
            out.append((s, negative_category(s, rng), False))
    return out


def calibration_set(processor, n: int):
    scenes = []
    seed = CALIBRATION_SEED_BASE
    while len(scenes) < n:
        s = generate_scene(seed)
        seed += 1
        if len(s.objects) >= 2:
            scenes.append(s)
    items = []
    for s in scenes:
        c = s.categories[0]
        items.append(
            (make_inputs(processor, [s], [presence_question(CATEGORIES[c])]), CATEGORIES[c])
        )
    return items


@torch.no_grad()
def p_yes(model, inputs) -> torch.Tensor:
    logits = model(**inputs).logits[:, -1]
    return torch.softmax(logits[:, [YES, NO]].float(), -1)[:, 0]


def run_grounding(model, processor, scenes, heads, batch: int) -> dict:
    queries = grounding_queries(scenes)
    n_layers = len(model.model.language_model.layers)
    variants = {
        "layer 0": dict(layers=[0]),
        "all layers": dict(layers=list(range(n_layers))),  # None would be the default
        "localization heads": dict(heads=heads),
        "layer 0, relative": dict(layers=[0], relative=True),
        "last token, all layers": dict(layers=list(range(n_layers)), last=True),
    }
    hits = {k: [] for k in variants}
    other_hits = {k: [] for k in variants}
    chance = []
    detections = {k: {"mass": [], "mtla": []} for k in ("layer 0", "all layers")}
    region = {"present": [], "absent": []}
    region_all = {"present": [], "absent": []}
    yes = {"present": [], "absent": []}
    vas_scores = {"present": [], "absent": []}
    examples = []
    for sl in _progress(list(batches(len(queries), batch)), "grounding"):
        chunk = queries[sl]
        scenes_b = [q[0] for q in chunk]
        names = [CATEGORIES[q[1]] for q in chunk]
        inputs = make_inputs(processor, scenes_b, [presence_question(n) for n in names])
        generic = make_inputs(processor, scenes_b, [CAPTION_PROMPT] * len(chunk))
        seq = inputs["input_ids"].shape[1]
        last = torch.full((len(chunk), 1), seq - 1)
        cat_pos = torch.stack(
            [
                (inputs["input_ids"][b] == processor.tokenizer.convert_tokens_to_ids(n))
                .nonzero()
                .flatten()[-1:]
                for b, n in enumerate(names)
            ]
        )  # [B, 1] the category token
        maps = {}
        sizes = [Size(s.size, s.size) for s in scenes_b]  # the scenes' own pixels
        for name, v in variants.items():
            kwargs = {"layers": v.get("layers"), "heads": v.get("heads"), "sizes": sizes}
            if v.get("relative"):
                kwargs["relative_to"] = generic
            query = last if v.get("last") else cat_pos
            maps[name] = G.heatmap(model, inputs, query, **kwargs)
        py = p_yes(model, inputs)
        vas_b = H.vas(model, inputs, query_rows=cat_pos).per_layer[:, 0]  # layer-0 VAS, category
        for b, (scene, cat, present) in enumerate(chunk):
            key = "present" if present else "absent"
            heat0 = maps["layer 0"][b][0]
            top = G.boxes(heat0, max_boxes=1)
            region[key].append(G.box_share(heat0, top[0]) if top else 0.0)
            heat_all = maps["all layers"][b][0]
            top_all = G.boxes(heat_all, max_boxes=1)
            region_all[key].append(G.box_share(heat_all, top_all[0]) if top_all else 0.0)
            yes[key].append(float(py[b]))
            vas_scores[key].append(float(vas_b[b]))
            for name in ("layer 0", "all layers"):
                heat = maps[name][b][0]
                for box in G.boxes(heat, max_boxes=3):
                    base = {"image_id": scene.seed, "category_id": cat + 1, "bbox": box.xywh}
                    detections[name]["mass"].append({**base, "score": box.score})
                    detections[name]["mtla"].append({**base, "score": G.box_share(heat, box)})
            if not present:
                continue
            target = scene.find(cat).box(scene.size)
            others = [o.box(scene.size) for o in scene.objects if o.category != cat]
            chance.append(target[2] * target[3] / scene.size**2)
            for name in variants:
                pt = G.point(maps[name][b][0])
                hits[name].append(inside(pt, target))
                other_hits[name].append(
                    any(inside(pt, o) for o in others) and not inside(pt, target)
                )
            if len(examples) < 6 and len(scene.objects) >= 2:
                examples.append((scene, cat, maps["layer 0"][b][0], top[0] if top else None))
    gt = coco_gt(coco_instances(scenes))
    ap = {
        f"{name}, score={kind}": box_ap(gt, dets)
        for name, by_kind in detections.items()
        for kind, dets in by_kind.items()
    }
    return {
        "n_scenes": len(scenes),
        "n_present": len(region["present"]),
        "n_absent": len(region["absent"]),
        "n_layers": n_layers,
        "pointing": {k: float(np.mean(v)) for k, v in hits.items()},
        "pointing_other_object": {k: float(np.mean(v)) for k, v in other_hits.items()},
        "pointing_chance": float(np.mean(chance)),
        "box_ap": ap,
        "auroc": {
            "MTLA region score (layer 0, top box)": present_vs_absent(
                region["present"], region["absent"]
            ),
            "MTLA region score (all layers, top box)": present_vs_absent(
                region_all["present"], region_all["absent"]
            ),
            "VAS at the category token (layer 0)": present_vs_absent(
                vas_scores["present"], vas_scores["absent"]
            ),
            "model P(yes) (reference)": present_vs_absent(yes["present"], yes["absent"]),
        },
        "_roc": {"mtla": region, "p_yes": yes},
        "_examples": examples,
    }


# --- captions: describe_and_ground ---------------------------------------------------------
def run_captions(model, processor, scenes, batch: int, layers: list[int] | None) -> dict:
    """Caption each scene, ground every category the caption names (describe_and_ground) and
    score it (MTLA share inside its own box); compare with the scene's true objects."""
    present_scores, absent_scores, hits, iou50, n_mentions = [], [], [], [], 0
    for sl in _progress(list(batches(len(scenes), batch)), "captions"):
        chunk = scenes[sl]
        inputs = make_inputs(processor, chunk, [CAPTION_PROMPT] * len(chunk))
        described = G.describe_and_ground(
            model, inputs, processor=processor, objects=CATEGORIES, max_new_tokens=40,
            layers=layers, sizes=[Size(s.size, s.size) for s in chunk],
        )  # fmt: skip
        for scene, d in zip(chunk, described, strict=True):
            for phrase in d.phrases:
                n_mentions += 1
                obj = scene.find(CATEGORIES.index(phrase.text))
                if obj is None:
                    absent_scores.append(phrase.score)
                    continue
                present_scores.append(phrase.score)
                target = obj.box(scene.size)
                hits.append(inside(G.point(phrase.map), target))
                iou50.append(phrase.box is not None and G.iou(phrase.box, target) >= 0.5)
    return {
        "n_scenes": len(scenes),
        "mentions": n_mentions,
        "hallucinated_mentions": len(absent_scores),
        "chair_i": len(absent_scores) / max(n_mentions, 1),
        "pointing_present_mentions": float(np.mean(hits)) if hits else float("nan"),
        "acc_iou50_present_mentions": float(np.mean(iou50)) if iou50 else float("nan"),
        "auroc_mtla_present_vs_hallucinated": present_vs_absent(present_scores, absent_scores),
        "layers": "all" if layers is None else layers,
    }


# --- POPE with mitigations ------------------------------------------------------------------
def run_pope(model, processor, n_images: int, batch: int, methods: list[str]) -> dict:
    """Per split and method, the POPE scores of ``vlm_focus.eval.pope.evaluate`` (greedy, 3 new
    tokens, LLaVA's suffix); every mitigation runs as `vlm-focus eval --mitigate` runs it: by its
    registry name, with the registry's defaults."""
    scenes = {s.seed: s for s in pope_eligible(n_images)}
    rows = [
        {**r, "split": split}
        for split in SPLITS
        for r in pope_questions(list(scenes.values()), split)
    ]
    results: dict[str, dict] = {split: {} for split in SPLITS}
    for method in methods:
        setting = RunSetting(mitigation="none" if method == "greedy" else method, max_new_tokens=3)
        result = evaluate(
            model,
            processor,
            rows,
            setting,
            images=lambda row: Image.fromarray(scenes[row["image_id"]].image()),
            suffix=POPE_SUFFIX,
            batch_size=batch,
            progress=f"POPE {method}",
        )
        for split in SPLITS:
            scores = result.scores(split)
            scores["unparsed"] = scores.pop("unparseable")
            results[split][method] = scores
    return results


# --- report ---------------------------------------------------------------------------------
def plot(grounding: dict, pope: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(17, 4.8))
    names = list(grounding["pointing"])
    axes[0].barh(names, [grounding["pointing"][n] for n in names], color="tab:blue")
    axes[0].axvline(grounding["pointing_chance"], color="k", ls="--", label="chance (box area)")
    axes[0].set_xlim(0, 1)
    axes[0].set_title("pointing game (peak inside the queried box)")
    axes[0].legend(loc="lower right")
    for key, label in (("mtla", "MTLA region score"), ("p_yes", "model P(yes)")):
        fp, tp = roc_curve(grounding["_roc"][key]["present"], grounding["_roc"][key]["absent"])
        axes[1].plot(fp, tp, label=label)
    axes[1].plot([0, 1], [0, 1], "k:")
    axes[1].set_title("present vs absent object queries (ROC)")
    axes[1].set_xlabel("false positive rate")
    axes[1].set_ylabel("true positive rate")
    axes[1].legend()
    methods = list(next(iter(pope.values())))
    width = 0.8 / len(methods)
    x = np.arange(len(pope))
    for i, m in enumerate(methods):
        axes[2].bar(x + i * width, [pope[s][m]["f1"] for s in pope], width, label=m)
        axes[2].scatter(
            x + i * width, [pope[s][m]["yes_ratio"] for s in pope], color="k", marker="_", s=80
        )
    axes[2].set_xticks(x + 0.4 - width / 2, list(pope))
    axes[2].set_ylim(0, 1.05)
    axes[2].set_title("POPE F1 (bars) and predicted yes-ratio (ticks)")
    axes[2].legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(out / "grounding_quality.png", dpi=110)
    plt.close(fig)

    examples = grounding["_examples"]
    if examples:
        fig, axes = plt.subplots(1, len(examples), figsize=(3.2 * len(examples), 3.4))
        for ax, (scene, cat, heat, box) in zip(np.atleast_1d(axes), examples, strict=False):
            ax.imshow(scene.image())
            ax.imshow(heat.pixels.numpy(), alpha=0.55, cmap="jet")
            gx, gy, gw, gh = scene.find(cat).box(scene.size)
            ax.add_patch(plt.Rectangle((gx, gy), gw, gh, fill=False, ec="white", lw=2))
            if box is not None:
                bx, by, bw, bh = box.xywh
                ax.add_patch(plt.Rectangle((bx, by), bw, bh, fill=False, ec="magenta", lw=2))
            px, py = G.point(heat)
            ax.plot(px, py, "w+", ms=12, mew=2)
            ax.set_title(CATEGORIES[cat], fontsize=9)
            ax.axis("off")
        fig.suptitle("layer-0 map at the category token; white: true box, magenta: boxes()[0]")
        fig.tight_layout()
        fig.savefig(out / "grounding_examples.png", dpi=100)
        plt.close(fig)


def write_report(report: dict, out: Path) -> None:
    g, pope = report["grounding"], report["pope"]
    lines = [
        "# Grounding and hallucination mitigation on the organism model",
        "",
        f"Model: {report['model']}. Machine: {report['machine']}. "
        f"torch {report['torch']}, transformers {report['transformers']}. "
        f"Run took {report['seconds']:.0f} s.",
        "",
        f"Command: `{report['command']}`",
        "",
        f"Held-out scenes: {g['n_scenes']} ({g['n_present']} present and {g['n_absent']} absent "
        f"category queries, prompt `Is there a {{category}} in the image?` in the chat template). "
        f"Localization heads chosen on {report['calibration']} calibration scenes "
        f"(seeds from {CALIBRATION_SEED_BASE}): {report['heads']}.",
        "",
        "## Pointing game (map peak inside the queried object's box)",
        "",
        "| map | hit rate | peak on another object |",
        "|---|---|---|",
    ]
    for name, value in g["pointing"].items():
        lines.append(f"| {name} | {value:.3f} | {g['pointing_other_object'][name]:.3f} |")
    lines += [
        f"| chance (box share of the image) | {g['pointing_chance']:.3f} | |",
        "",
        "## Box AP (pycocotools, boxes() on the map, up to 3 per query, present + absent queries)",
        "",
        "| map, score | AP@[.5:.95] | AP50 |",
        "|---|---|---|",
    ]
    for name, (ap, ap50) in g["box_ap"].items():
        lines.append(f"| {name} | {ap:.3f} | {ap50:.3f} |")
    lines += [
        "",
        "## Hallucination AUROC (present vs absent queried object)",
        "",
        "| score | AUROC |",
        "|---|---|",
    ]
    for name, value in g["auroc"].items():
        lines.append(f"| {name} | {value:.3f} |")
    c = report.get("captions")
    if c:
        lines += [
            "",
            f"## Captions grounded with describe_and_ground ({c['n_scenes']} scenes, prompt "
            f"`{CAPTION_PROMPT}`, maps at layers {c['layers']})",
            "",
            "| mentions | hallucinated (CHAIR_i) | pointing (present) | Acc@0.5 (present) | "
            "AUROC of MTLA score, present vs hallucinated |",
            "|---|---|---|---|---|",
            f"| {c['mentions']} | {c['hallucinated_mentions']} ({c['chair_i']:.3f}) | "
            f"{c['pointing_present_mentions']:.3f} | {c['acc_iou50_present_mentions']:.3f} | "
            f"{c['auroc_mtla_present_vs_hallucinated']:.3f} |",
        ]
    lines += [
        "",
        f"## POPE ({report['pope_images']} images x 6 questions per split; suffix "
        f"`{POPE_SUFFIX.strip()}`; greedy unless noted)",
        "",
        "| split | method | accuracy | F1 | yes-ratio | dF1 | d yes-ratio | unparsed |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for split, by_method in pope.items():
        base = by_method["greedy"]
        for method, m in by_method.items():
            lines.append(
                f"| {split} | {method} | {m['accuracy']:.3f} | {m['f1']:.3f} | "
                f"{m['yes_ratio']:.3f} | {m['f1'] - base['f1']:+.3f} | "
                f"{m['yes_ratio'] - base['yes_ratio']:+.3f} | {m['unparsed']} |"
            )
    settings = []
    for method in by_method:
        if method != "greedy":
            m = H.get_mitigation(method)
            params = {**m.parameters(), **m.generate_args}
            text = ", ".join(f"{k}={'all' if v is None else v}" for k, v in params.items())
            if m.generic_prompt is not None:
                text += f", generic prompt `{m.generic_prompt}`"
            settings.append(f"{method}: {text}")
    lines += [
        "",
        "Settings (the registry's defaults, `hal.mitigate`): " + "; ".join(settings) + ".",
        "",
        "![quality](grounding_quality.png)",
        "",
        "![examples](grounding_examples.png)",
        "",
    ]
    (out / "grounding_quality.md").write_text("\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="model folder (default: embedded organism)")
    parser.add_argument("--images", type=int, default=200, help="held-out grounding scenes")
    parser.add_argument("--pope-images", type=int, default=100, help="POPE images per split")
    parser.add_argument("--calibration", type=int, default=32, help="head-selection scenes")
    parser.add_argument("--caption-images", type=int, default=100, help="captioned scenes")
    parser.add_argument("--caption-layers", default="0", help="a layer index or 'all'")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads (1 is fastest on a busy CPU)"
    )
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    parser.add_argument("--smoke", action="store_true", help="random tiny model, tiny sizes")
    parser.add_argument(
        "--methods",
        default="greedy,attention_reweight,visual_beam,instruction_contrast",
        help="POPE methods, comma-separated",
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    start = time.time()
    model, processor, name = load(args)
    out = args.out
    if args.smoke:
        import tempfile

        out = Path(tempfile.mkdtemp(prefix="grounding_smoke_"))
        args.images, args.pope_images, args.calibration, args.caption_images = 6, 3, 4, 4
    out.mkdir(parents=True, exist_ok=True)
    heads = G.select_localization_heads(
        model, calibration_set(processor, args.calibration), top_k=3, processor=processor
    )
    G.save_heads(heads, out / "grounding_heads_organism.json")
    grounding = run_grounding(model, processor, heldout_scenes(args.images), heads, args.batch)
    n_layers = len(model.model.language_model.layers)
    caption_layers = (
        list(range(n_layers)) if args.caption_layers == "all" else [int(args.caption_layers)]
    )
    captions = run_captions(
        model, processor, heldout_scenes(args.caption_images), args.batch, caption_layers
    )
    pope = run_pope(model, processor, args.pope_images, args.batch, args.methods.split(","))
    import transformers

    report = {
        "model": name,
        "machine": f"{platform.machine()} {platform.processor() or ''} "
        f"({torch.get_num_threads()} threads), CPU",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "command": "python benchmarks/grounding_quality.py "
        + " ".join(argv if argv is not None else __import__("sys").argv[1:]),
        "seconds": time.time() - start,
        "calibration": args.calibration,
        "heads": heads.heads,
        "pope_images": args.pope_images,
        "image_size": IMAGE_SIZE,
        "grounding": grounding,
        "pope": pope,
        "captions": captions,
    }
    plot(grounding, pope, out)
    write_report(report, out)
    public = {k: v for k, v in report.items() if k != "grounding"}
    public["grounding"] = {k: v for k, v in grounding.items() if not k.startswith("_")}
    (out / "grounding_quality.json").write_text(json.dumps(public, indent=1, default=str))
    print((out / "grounding_quality.md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
