"""CHAIR (Rohrbach et al., 2018): object hallucination in captions; the protocol and its
metrics (the runner is :mod:`vlm_focus.eval.chair_run`, ``vlm-focus eval chair``).

Rules (docs/protocols.md):

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

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .synonyms import COCO_SYNONYMS, IRREGULAR_PLURALS

PROTOCOL_PROMPT = "Please describe this image in detail."
CHAIR_COLUMNS = (
    "setting",
    "pruner",
    "keep",
    "mitigate",
    "n",
    "CHAIR_s",
    "CHAIR_i",
    "recall",
    "length",
    "mentions",
)
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
