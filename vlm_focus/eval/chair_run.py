"""``vlm-focus eval chair``: the runner of :mod:`vlm_focus.eval.chair` (caption hallucination),
with a typed :class:`ChairConfig`.

Each setting writes ``<setting>.jsonl`` and ``<setting>.json`` under
``<out>/chair/<model>/``; every call rebuilds ``table.md`` and ``table.csv`` there from every
setting run so far, each row scored on the images that every setting captioned.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from ..asset_paths import CAPTION_PROMPT, is_embedded
from ..core.options import option
from .chair import (
    CHAIR_COLUMNS,
    EMBEDDED_MAX_NEW_TOKENS,
    PROTOCOL_MAX_NEW_TOKENS,
    PROTOCOL_PROMPT,
    SHIPPED_IDS,
    ObjectWords,
    chair_metrics,
    drop_unfinished,
    extract_objects,
    truth_objects,
)
from .common import PruneOptions, check_extras, on_shared_items, read_summaries, write_json


@dataclass
class ChairConfig(PruneOptions):
    """``vlm-focus eval chair``: CHAIR_i, CHAIR_s, recall and length of generated captions."""

    command: ClassVar[str] = "chair"

    captions: Path | None = option(
        None,
        "COCO captions json (reference captions, part of the ground truth)",
        default_text="the embedded held-out set's",
    )
    image_ids: Path | None = option(
        None,
        "json list of the image ids to caption",
        default_text="the shipped list on the embedded set, else a seeded sample of --n-images",
    )
    n_images: int = option(500, "images of the seeded sample")
    prompt: str | None = option(
        None,
        "caption instruction",
        default_text=f"{PROTOCOL_PROMPT!r}; {CAPTION_PROMPT!r} on the embedded model "
        "(the prompt it was trained with)",
    )
    max_new_tokens: int | None = option(
        None,
        "new tokens per caption (below the protocol's, the unfinished last sentence is dropped)",
        default_text=f"{PROTOCOL_MAX_NEW_TOKENS}, the protocol's; "
        f"{EMBEDDED_MAX_NEW_TOKENS} on the embedded model",
        metavar="N",
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        self.captions = None if self.captions is None else Path(self.captions)
        self.image_ids = None if self.image_ids is None else Path(self.image_ids)
        if self.prompt is not None and not self.prompt.strip():
            raise ValueError(
                f"prompt={self.prompt!r} is empty; give an instruction or leave it out for "
                "the default"
            )
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={self.max_new_tokens} must be >= 1")

    @property
    def embedded(self) -> bool:
        return is_embedded(self.model)

    @property
    def caption_prompt(self) -> str:
        if self.prompt is not None:
            return self.prompt
        return CAPTION_PROMPT if self.embedded else PROTOCOL_PROMPT

    @property
    def new_tokens(self) -> int:
        if self.max_new_tokens is not None:
            return self.max_new_tokens
        return EMBEDDED_MAX_NEW_TOKENS if self.embedded else PROTOCOL_MAX_NEW_TOKENS


def image_ids(config: ChairConfig, cocoset: Any, embedded_set: bool) -> tuple[list[int], str]:
    """The fixed image-id list: ``image_ids``, the shipped list on the embedded set, or a
    seeded sample."""
    import numpy as np

    if config.image_ids is not None:
        ids = json.loads(Path(config.image_ids).read_text())
        source = str(config.image_ids)
    elif embedded_set:
        ids = json.loads(SHIPPED_IDS.read_text())
        source = f"shipped list {SHIPPED_IDS.name}"
    else:
        every = sorted(cocoset.images_by_id)
        if len(every) > config.n_images:
            rng = np.random.default_rng(config.seed)
            every = sorted(int(i) for i in rng.choice(every, config.n_images, replace=False))
        ids, source = every, f"seeded sample (seed={config.seed}, n={config.n_images})"
    if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
        raise ValueError(f"{source}: an image-id list is a JSON list of ints")
    unknown = [i for i in ids if i not in cocoset.images_by_id]
    if unknown:
        raise ValueError(f"{source}: {len(unknown)} ids not in the set, e.g. {unknown[:3]}")
    return ids, source


def run_chair(config: ChairConfig) -> dict | None:
    """Caption the images under one setting; returns its summary (on the main process)."""
    from .data import resolve_set, split_missing
    from .generation import Generator
    from .runner import process_state
    from .tables import write_table

    if not isinstance(config, ChairConfig):
        raise TypeError(f"run_chair expects a ChairConfig, got {type(config).__name__}")
    check_extras(config)
    state = process_state()
    embedded_set = config.images is None and config.instances is None
    cocoset = resolve_set(config, state)
    ids, id_source = image_ids(config, cocoset, embedded_set)
    ids = ids[: config.limit] if config.limit else ids
    prompt, max_new = config.caption_prompt, config.new_tokens
    setting = config.setting(max_new_tokens=max_new)
    items = [{"image_id": i, "image": cocoset.images_by_id[i]["file_name"]} for i in ids]
    present, missing = split_missing(items, cocoset, config.on_missing)
    model, processor = config.load(config.device_of(state))
    guide = setting.load_guide(config.device_of(state)) or (None, None)
    generator = Generator(model, processor, setting, guide=guide[0], guide_processor=guide[1])
    table = ObjectWords.for_categories(cocoset.category_names.values())
    truth = _truth(cocoset, table)

    def process(batch: list[dict]) -> list[dict]:
        images = [cocoset.images_dir / r["image"] for r in batch]
        texts, facts = generator(images, [prompt] * len(batch))
        out = []
        for r, text, fact in zip(batch, texts, facts, strict=True):
            cut = fact["new_tokens"] >= max_new and max_new < PROTOCOL_MAX_NEW_TOKENS
            caption = drop_unfinished(text) if cut else text
            out.append(
                {
                    "image_id": r["image_id"],
                    "image": r["image"],
                    "raw": text,
                    "caption": caption,
                    "objects": extract_objects(caption, table),
                    **fact,
                }
            )
        return out

    def metric(records: list[dict]) -> str:
        m = chair_metrics({r["image_id"]: r["caption"] for r in records}, truth, table)
        return f"CHAIR_s={m['CHAIR_s']:.3f} CHAIR_i={m['CHAIR_i']:.3f} recall={m['recall']:.3f}"

    root = config.results
    records = config.run_items(
        state,
        present,
        process,
        root / f"{setting.tag}.jsonl",
        key="image_id",
        desc=f"chair {setting.tag}",
        metric=metric,
        record={**setting.describe(), "prompt": prompt},
    )
    if not state.is_main_process:
        return None
    summary = {
        "setting": setting.tag,
        **setting.describe(),
        **chair_metrics({r["image_id"]: r["caption"] for r in records}, truth, table),
        "n_missing_images": len(missing),
        "model": config.model_name,
        "prompt": prompt,
        "unfinished_sentence": (
            "dropped when the caption hit max_new_tokens"
            if max_new < PROTOCOL_MAX_NEW_TOKENS
            else "kept"
        ),
        "image_ids": id_source,
        "truth": "instance categories + objects named in reference captions",
        "mention_rule": "two-word names first, then singularised words; repeats counted",
        "set": cocoset.describe(),
        "processes": state.num_processes,
    }
    write_json(root / f"{setting.tag}.json", summary)
    write_json(root / "image_ids.json", ids)
    every = sorted(
        read_summaries(root, "*.json"), key=lambda s: (s["pruner"] is not None, s["setting"])
    )
    # every row on the images that all settings captioned, so that rows share them and n
    rows = on_shared_items(
        every,
        lambda s: root / f"{s['setting']}.jsonl",
        lambda r: r["image_id"],
        lambda s, records: chair_metrics(
            {r["image_id"]: r["caption"] for r in records}, truth, table
        ),
        items="images",
    )
    write_table(rows, CHAIR_COLUMNS, root / "table")
    print(
        f"chair {setting.tag}: CHAIR_s {summary['CHAIR_s']:.4f} CHAIR_i {summary['CHAIR_i']:.4f} "
        f"recall {summary['recall']:.4f} length {summary['length']:.1f} (n={summary['n']}) "
        f"-> {root}",
        file=sys.stderr,
    )
    return summary


def _truth(cocoset: Any, table: ObjectWords) -> dict[int, set[str]]:
    names: dict[int, set[str]] = {i: set() for i in cocoset.images_by_id}
    for ann in cocoset.instances["annotations"]:
        names.setdefault(ann["image_id"], set()).add(cocoset.category_names[ann["category_id"]])
    return {i: truth_objects(names[i], cocoset.captions.get(i, []), table) for i in names}
