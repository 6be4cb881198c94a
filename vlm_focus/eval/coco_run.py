"""``vlm-focus eval coco``: the runner of :mod:`vlm_focus.eval.coco` (attention grounding), with
a typed :class:`CocoConfig`.

Each map setting (the layers and heads the maps average) writes its own folder
``<out>/coco/<model>/<setting>/`` (queries, summary, detections, examples); every call rebuilds
``table.md`` and ``table.csv`` beside them from every setting run so far, each row scored on
the queries that every setting answered.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from ..core.options import option
from .coco import (
    COCO_COLUMNS,
    DEFAULT_TEMPLATE,
    check_template,
    detections,
    gt_boxes,
    queries,
    query_prompt,
    summarise,
)
from .common import EvalOptions, check_extras, on_shared_items, read_summaries, write_json
from .metrics import auroc, point_in_boxes
from .pope import image_categories


def parse_layers(text: str) -> list[int]:
    """``"0"`` or ``"0,1,3"``: decoder layers (ints >= 0)."""
    try:
        layers = [int(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        raise ValueError(
            f"layers={text!r} must be a comma list of layer indices, e.g. 0,1"
        ) from None
    if not layers or min(layers) < 0:
        raise ValueError(f"layers={text!r} must be a comma list of layer indices >= 0, e.g. 0,1")
    return sorted(set(layers))


def parse_heads(text: str) -> list[tuple[int, int]]:
    """``"3:4,3:1"``: (layer, head) pairs."""
    pairs = []
    for part in str(text).split(","):
        if not part.strip():
            continue
        match = re.fullmatch(r"\s*(\d+)\s*:\s*(\d+)\s*", part)
        if match is None:
            raise ValueError(
                f"heads={text!r}: give layer:head pairs (e.g. 3:4,3:1) or a heads JSON file "
                "written by grounding.save_heads"
            )
        pairs.append((int(match[1]), int(match[2])))
    if not pairs:
        raise ValueError(f"heads={text!r} names no head")
    return pairs


@dataclass
class CocoConfig(EvalOptions):
    """``vlm-focus eval coco``: box AP, pointing game and hallucination AUROC of attention maps."""

    command: ClassVar[str] = "coco"
    requires: ClassVar[tuple[str, ...]] = ("pycocotools.coco", "pycocotools.cocoeval")  # box AP
    plots: ClassVar[tuple[str, ...]] = ("examples.png",)

    n_images: int = option(500, "images to sample")
    absent: int = option(3, "absent categories asked per image")
    max_boxes: int = option(1, "boxes kept per query")
    prompt: str | None = option(
        None,
        "query template: {question} is the POPE question about the category "
        "('Is there a dog in the image?'), {category} its name; the map is read at the "
        "category's tokens",
        default_text=f"{DEFAULT_TEMPLATE!r}",
    )
    layers: str | None = option(
        None,
        "decoder layers whose maps are averaged, a comma list (e.g. 0)",
        default_text="the model's grounding default, grounding.default_layers (or the "
        "layers of --heads)",
    )
    heads: str | None = option(
        None,
        "localization heads whose maps are averaged: a JSON file written by "
        "grounding.save_heads, or layer:head pairs (e.g. 3:4,3:1)",
        default_text="every head of the layers",
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.n_images < 1 or self.max_boxes < 1 or self.absent < 0:
            raise ValueError(
                f"n_images={self.n_images} and max_boxes={self.max_boxes} must be >= 1, "
                f"absent={self.absent} >= 0"
            )
        check_template(DEFAULT_TEMPLATE if self.prompt is None else self.prompt)
        if self.layers is not None:
            parse_layers(self.layers)
        if self.heads is not None and Path(self.heads).suffix != ".json":
            parse_heads(self.heads)

    @property
    def template(self) -> str:
        return DEFAULT_TEMPLATE if self.prompt is None else self.prompt

    @property
    def setting(self) -> str:
        """The map setting's folder name: ``default-layers``, ``layers0``, ``heads-<file>``
        ..."""
        if self.heads is not None:
            if Path(self.heads).suffix == ".json":
                tag = f"heads-{Path(self.heads).stem}"
            else:
                tag = "heads-" + "_".join(f"{a}.{b}" for a, b in parse_heads(self.heads))
        else:
            tag = ""
        if self.layers is not None:
            tag += ("-" if tag else "") + "layers" + "-".join(map(str, parse_layers(self.layers)))
        return re.sub(r"[^A-Za-z0-9._-]+", "_", tag or "default-layers")


def map_heads(config: CocoConfig, model: Any) -> Any:
    """``heads`` for :func:`~vlm_focus.grounding.heatmap`: loaded (and checked against the
    model) from a JSON file, or the given pairs; ``None`` for every head."""
    if config.heads is None:
        return None
    if Path(config.heads).suffix == ".json":
        from .. import grounding

        if not Path(config.heads).is_file():
            raise FileNotFoundError(f"heads file not found: {config.heads}")
        return grounding.load_heads(config.heads, model)
    return parse_heads(config.heads)


def run_coco(config: CocoConfig) -> dict | None:
    """Run one map setting; returns its summary (on the main process)."""
    from .. import grounding
    from ..loading import load_image
    from ..setting import RunSetting
    from .data import resolve_set, split_missing
    from .generation import Generator
    from .runner import process_state
    from .tables import write_table

    if not isinstance(config, CocoConfig):
        raise TypeError(f"run_coco expects a CocoConfig, got {type(config).__name__}")
    draws = check_extras(config)
    template = config.template
    state = process_state()
    cocoset = resolve_set(config, state)
    present_cats = image_categories(cocoset.instances)
    ids = sorted(i for i, c in present_cats.items() if c)
    if len(ids) > config.n_images:
        rng = np.random.default_rng(config.seed)
        ids = sorted(int(i) for i in rng.choice(ids, config.n_images, replace=False))
    ids = ids[: config.limit] if config.limit else ids
    rows = queries(cocoset.instances, ids, config.absent, config.seed)
    rows, missing = split_missing(rows, cocoset, config.on_missing)
    missing_images = sorted({r["image_id"] for r in missing})
    ids = [i for i in ids if i not in set(missing_images)]
    model, processor = config.load(config.device_of(state))
    generator = Generator(model, processor, RunSetting())
    truth = gt_boxes(cocoset.instances)
    heads = map_heads(config, model)
    if config.layers is not None:
        layers = parse_layers(config.layers)
    elif heads is None:
        layers = grounding.default_layers(model)  # the one default of every grounding call
    else:
        layers = None  # the heads' own layers

    def process(batch: list[dict]) -> list[dict]:
        out: dict[str, dict] = {}
        groups: dict[str, list[dict]] = {}
        for r in batch:
            groups.setdefault(r["category"], []).append(r)
        for name, group in groups.items():
            images = [load_image(cocoset.images_dir / r["image"]) for r in group]
            inputs = generator.inputs(
                images, [query_prompt(template, r["category"]) for r in group]
            )
            generator.visual_counts(inputs)
            # the processor's own geometry (centre crop, padding, anyres) on each image's size
            maps = grounding.heatmap(
                model,
                inputs,
                name,
                processor=processor,
                images=images,
                layers=layers,
                heads=heads,
            )
            for r, row_maps in zip(group, maps, strict=True):
                heat = row_maps[0]
                x, y = grounding.point(heat)
                found = grounding.boxes(heat, max_boxes=config.max_boxes)
                boxes = [
                    {
                        "bbox": [round(v, 2) for v in b.xywh],
                        "score": float(grounding.box_share(heat, b)),
                    }
                    for b in found
                ]
                boxes.sort(key=lambda b: -b["score"])
                key = (r["image_id"], r["category_id"])
                out[r["query_id"]] = {
                    **{k: r[k] for k in ("query_id", "image_id", "category_id", "category")},
                    "present": r["present"],
                    "point": [x, y],
                    "hit": point_in_boxes((x, y), truth.get(key, [])) if r["present"] else None,
                    "boxes": boxes,
                    "score": boxes[0]["score"] if boxes else 0.0,
                }
        return [out[r["query_id"]] for r in batch]

    def metric(records: list[dict]) -> str:
        hits = [r["hit"] for r in records if r["present"]]
        a = auroc([r["score"] for r in records], [r["present"] for r in records])
        return f"pointing={sum(hits) / max(len(hits), 1):.3f} auroc={a:.3f}"

    root = config.results
    folder = root / config.setting
    map_layers = "the heads' layers" if layers is None else ",".join(map(str, layers))
    if config.layers is None and heads is None:
        map_layers += " (grounding.default_layers)"
    map_heads_text = "every head" if config.heads is None else str(config.heads)
    records = config.run_items(
        state,
        rows,
        process,
        folder / "queries.jsonl",
        key="query_id",
        desc=f"coco grounding {config.setting}",
        metric=metric,
        record={
            "prompt": template,
            "absent": config.absent,
            "max_boxes": config.max_boxes,
            "seed": config.seed,
            "instances": str(cocoset.instances_path),
            "layers": map_layers,
            "heads": map_heads_text,
        },
    )
    if not state.is_main_process:
        return None
    summary = {
        "setting": config.setting,
        "model": config.model_name,
        "layers": map_layers,
        "heads": map_heads_text,
        "n_images": len(ids),
        **summarise(records, cocoset.instances, ids),
        "n_missing_images": len(missing_images),
        "prompt": template,
        "absent_per_image": config.absent,
        "max_boxes": config.max_boxes,
        "map_rule": f"heatmap of the category tokens in the prompt, {map_layers}, {map_heads_text}",
        "box_rule": "grounding.boxes: Gaussian smoothing, Otsu threshold, connected components",
        "score_rule": "region score (MTLA) of each box = grounding.box_share of the same map",
        "pointing_rule": "hit when the map's peak lies inside any box of the queried category",
        "auroc_rule": "top box score, present (positive) vs absent queries",
        "set": cocoset.describe(),
        "processes": state.num_processes,
    }
    write_json(folder / "summary.json", summary)
    write_json(folder / "detections.json", detections(records))
    every = sorted(read_summaries(root, "*/summary.json"), key=lambda s: s["setting"])

    def shared_scores(s: dict, records: list[dict]) -> dict:
        images = sorted({r["image_id"] for r in records})
        return {"n_images": len(images), **summarise(records, cocoset.instances, images)}

    # every row on the queries that all map settings answered, so that rows share them
    rows = on_shared_items(
        every,
        lambda s: root / s["setting"] / "queries.jsonl",
        lambda r: (r["query_id"], r["category"], r["present"]),
        shared_scores,
        items="queries",
    )
    write_table(rows, COCO_COLUMNS, root / "table")
    if draws:
        from .plots import grounding_examples

        grounding_examples(records, truth, cocoset.image_path, folder / "examples.png")
    print(
        f"coco {config.setting}: AP {summary['AP']:.4f} AP50 {summary['AP50']:.4f} pointing "
        f"{summary['pointing']:.4f} AUROC {summary['auroc']:.4f} "
        f"({summary['n_queries']} queries, {summary['n_images']} images) -> {folder}",
        file=sys.stderr,
    )
    return summary
