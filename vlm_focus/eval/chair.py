"""CHAIR (Rohrbach et al., 2018): object hallucination in captions.

Rules (PROTOCOLS.md):

- a caption's object mentions are found by lower-casing, splitting into words (``_`` stays inside a
  word, so ``red_circle`` is one word), then scanning left to right: a two-word name ("hot dog",
  "teddy bear") is matched before single words, and words are singularised before lookup;
  each mention maps to a category through :data:`~vlm_focus.eval.synonyms.COCO_SYNONYMS`
  (other categories are named by their own name);
- ground truth per image: its instance categories plus the objects its reference captions name;
- ``CHAIR_i = hallucinated mentions / all mentions`` (every mention counts, repeats included);
  ``CHAIR_s = captions with >= 1 hallucinated mention / captions``;
  ``recall = sum_images |mentioned & truth| / sum_images |truth|``; ``length`` = mean words.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .synonyms import COCO_SYNONYMS, IRREGULAR_PLURALS

PROTOCOL_PROMPT = "Please describe this image in detail."
PROTOCOL_MAX_NEW_TOKENS = 512
EMBEDDED_MAX_NEW_TOKENS = 64
SHIPPED_IDS = Path(__file__).resolve().parent / "chair_image_ids_organism.json"
_WORD = re.compile(r"[a-z0-9]+(?:_[a-z0-9]+)*")


def singular(word: str) -> str:
    """English singular of a lower-case word: irregular table, then suffix rules
    (``-ies -> -y``, ``-ches/-shes/-xes/-sses -> -`` (drop ``es``), ``-s -> -`` except ``-ss``,
    ``-us``, ``-is``)."""
    if word in IRREGULAR_PLURALS:
        return IRREGULAR_PLURALS[word]
    if len(word) > 4 and word.endswith("ies"):
        return word[:-3] + "y"
    if word.endswith(("ches", "shes", "xes", "sses")):
        return word[:-2]
    if len(word) > 3 and word.endswith("s") and not word.endswith(("ss", "us", "is")):
        return word[:-1]
    return word


@dataclass(frozen=True)
class ObjectWords:
    """Lookup tables from singular words and two-word phrases to category names."""

    single: dict[str, str]
    double: dict[str, str]

    @classmethod
    def for_categories(cls, names: Iterable[str]) -> ObjectWords:
        """Tables for a category set: COCO synonyms where the name is a COCO category, and the
        name itself for every category."""
        single: dict[str, str] = {}
        double: dict[str, str] = {}
        for name in names:
            for phrase in (*COCO_SYNONYMS.get(name, ()), name):
                words = [singular(w) for w in _WORD.findall(phrase.lower())]
                if len(words) == 1:
                    single.setdefault(words[0], name)
                elif len(words) == 2:
                    double.setdefault(" ".join(words), name)
                elif len(words) > 2:
                    raise ValueError(f"object name {phrase!r} has more than two words")
        return cls(single, double)


def extract_objects(caption: str, table: ObjectWords) -> list[str]:
    """Category names mentioned in ``caption``, in order, repeats kept."""
    words = [singular(w) for w in _WORD.findall(caption.lower())]
    found, i = [], 0
    while i < len(words):
        if i + 1 < len(words) and f"{words[i]} {words[i + 1]}" in table.double:
            found.append(table.double[f"{words[i]} {words[i + 1]}"])
            i += 2
            continue
        if words[i] in table.single:
            found.append(table.single[words[i]])
        i += 1
    return found


def truth_objects(
    instance_names: Iterable[str], references: Iterable[str], table: ObjectWords
) -> set[str]:
    """Ground-truth objects of an image: instance categories and objects named by references."""
    truth = set(instance_names)
    for ref in references:
        truth.update(extract_objects(ref, table))
    return truth


def chair_metrics(
    captions: Mapping[Any, str], truth: Mapping[Any, set[str]], table: ObjectWords
) -> dict[str, float]:
    """CHAIR_i, CHAIR_s, recall and mean length (words) of ``captions`` by image id."""
    mentions = hallucinated = bad_captions = covered = total_truth = words = 0
    for image_id, caption in captions.items():
        found = extract_objects(caption, table)
        gt = truth[image_id]
        wrong = [m for m in found if m not in gt]
        mentions += len(found)
        hallucinated += len(wrong)
        bad_captions += bool(wrong)
        covered += len(set(found) & gt)
        total_truth += len(gt)
        words += len(caption.split())
    n = len(captions)
    return {
        "CHAIR_i": hallucinated / mentions if mentions else 0.0,
        "CHAIR_s": bad_captions / n if n else 0.0,
        "recall": covered / total_truth if total_truth else 0.0,
        "length": words / n if n else 0.0,
        "mentions": mentions,
        "n": n,
    }


def drop_unfinished(text: str) -> str:
    """Drop the last unfinished sentence (text after the last '.'), when a '.' exists."""
    cut = text.rfind(".")
    return text[: cut + 1] if cut >= 0 else text


# --- the command --------------------------------------------------------------------------------
def image_ids(args: argparse.Namespace, cocoset: Any, embedded: bool) -> tuple[list[int], str]:
    """The fixed image-id list: ``--image-ids``, the shipped organism list, or a seeded sample."""
    import numpy as np

    if args.image_ids is not None:
        ids = json.loads(Path(args.image_ids).read_text())
        source = str(args.image_ids)
    elif embedded:
        ids = json.loads(SHIPPED_IDS.read_text())
        source = f"shipped list {SHIPPED_IDS.name}"
    else:
        every = sorted(cocoset.images_by_id)
        if len(every) > args.n_images:
            rng = np.random.default_rng(args.seed)
            every = sorted(int(i) for i in rng.choice(every, args.n_images, replace=False))
        ids, source = every, f"seeded sample (seed={args.seed}, n={args.n_images})"
    if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
        raise ValueError(f"{source}: an image-id list is a JSON list of ints")
    unknown = [i for i in ids if i not in cocoset.images_by_id]
    if unknown:
        raise ValueError(f"{source}: {len(unknown)} ids not in the set, e.g. {unknown[:3]}")
    return ids, source


def run_chair(args: argparse.Namespace) -> dict | None:
    from .cli import load, load_guide, model_tag, write_json
    from .data import resolve_set, split_missing
    from .generation import Generator, Setting
    from .runner import process_state, run_items

    state = process_state()
    embedded = args.images is None and args.instances is None
    cocoset = resolve_set(args, state)
    ids, id_source = image_ids(args, cocoset, embedded)
    ids = ids[: args.limit] if args.limit else ids
    prompt = args.prompt or (_organism_prompt() if _embedded(args) else PROTOCOL_PROMPT)
    default_tokens = EMBEDDED_MAX_NEW_TOKENS if _embedded(args) else PROTOCOL_MAX_NEW_TOKENS
    max_new = args.max_new_tokens or default_tokens
    setting = Setting(
        pruner=args.pruner,
        keep=args.keep if args.pruner else 1.0,
        layer=args.layer,
        mitigate=args.mitigate,
        max_new_tokens=max_new,
    )
    items = [
        {"image_id": i, "image": cocoset.images_by_id[i]["file_name"]} for i in ids
    ]  # fmt: skip
    present, missing = split_missing(items, cocoset, args.on_missing)
    model, processor = load(args, state)
    guide = (
        load_guide(args, state) if setting.pruned and setting.pruner == "guided" else (None,) * 2
    )
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

    root = args.out / "chair" / model_tag(args.model)
    records = run_items(
        present,
        process,
        root / f"{setting.tag}.jsonl",
        key="image_id",
        batch_size=args.batch_size,
        state=state,
        desc=f"chair {setting.tag}",
        metric=metric,
        config={"model": args.model or "embedded", **setting.describe(), "prompt": prompt},
    )
    if not state.is_main_process:
        return None
    summary = {
        "setting": setting.tag,
        **setting.describe(),
        **chair_metrics({r["image_id"]: r["caption"] for r in records}, truth, table),
        "n_missing_images": len(missing),
        "model": args.model or "embedded",
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
    from .tables import write_table

    write_table([summary], CHAIR_COLUMNS, root / f"{setting.tag}-table")
    print(
        f"chair {setting.tag}: CHAIR_s {summary['CHAIR_s']:.4f} CHAIR_i {summary['CHAIR_i']:.4f} "
        f"recall {summary['recall']:.4f} length {summary['length']:.1f} (n={summary['n']}) "
        f"-> {root}",
        file=sys.stderr,
    )
    return summary


CHAIR_COLUMNS = ("setting", "mitigate", "n", "CHAIR_s", "CHAIR_i", "recall", "length", "mentions")


def _organism_prompt() -> str:
    from ..organism.vocab import CAPTION_PROMPT

    return CAPTION_PROMPT


def _truth(cocoset: Any, table: ObjectWords) -> dict[int, set[str]]:
    names: dict[int, set[str]] = {i: set() for i in cocoset.images_by_id}
    for ann in cocoset.instances["annotations"]:
        names.setdefault(ann["image_id"], set()).add(cocoset.category_names[ann["category_id"]])
    return {
        i: truth_objects(names[i], cocoset.captions.get(i, []), table) for i in names
    }  # fmt: skip


def _embedded(args: argparse.Namespace) -> bool:
    return args.model in (None, "embedded")
