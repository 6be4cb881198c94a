"""lmms-eval tasks shipped with vlm_focus (``--include_path`` this folder).

- ``vf_pope_organism_random|popular|adversarial`` (group ``vf_pope_organism``): the embedded
  organism's held-out POPE splits (``vlm_focus/assets/heldout/pope_*.jsonl``), images
  regenerated from their scene seeds, so the whole chain runs offline. Prompt, answer parsing
  and metrics are those of ``vlm-focus eval pope``: the question plus LLaVA's suffix, the
  POPE/LLaVA yes/no rule (:func:`vlm_focus.eval.parse_yes_no`), and
  :func:`vlm_focus.eval.pope_metrics` with ``yes`` positive and the yes-ratio of the
  PREDICTIONS; ``unparseable`` counts answers with neither a yes nor a no word.
- ``vf_pope``: lmms-eval's own POPE (its dataset, prompt, scoring and aggregations) except the
  yes-ratio, which is the share of predicted ``yes`` (:func:`predicted_yes_ratio`). lmms-eval
  0.7.3's ``pope_yes_ratio`` averages the ground-truth labels, so it reads 0.5 on every
  balanced split whatever the model answers.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

from ...eval import parse_yes_no, pope_metrics
from ...eval.pope import LLAVA_SUFFIX

ORGANISM_METRICS = ("accuracy", "precision", "recall", "f1", "yes_ratio", "unparseable")


def tasks_path() -> str:
    """This folder, for lmms-eval's ``--include_path``."""
    return str(Path(__file__).resolve().parent)


# --- the organism's held-out POPE ------------------------------------------------------------
@functools.lru_cache(maxsize=64)
def _scene_image(image_id: int) -> Any:
    from PIL import Image

    from ...eval.scenes import generate_scene

    return Image.fromarray(generate_scene(int(image_id)).image()).convert("RGB")


def organism_doc_to_visual(doc: dict) -> list:
    """The held-out scene of the question, regenerated from its seed (its ``image_id``)."""
    return [_scene_image(doc["image_id"])]


def organism_doc_to_text(doc: dict, lmms_eval_specific_kwargs: dict | None = None) -> str:
    """``pre_prompt + question + post_prompt``; the post prompt defaults to LLaVA's suffix, as
    in ``vlm-focus eval pope``."""
    kwargs = lmms_eval_specific_kwargs or {}
    return f"{kwargs.get('pre_prompt', '')}{doc['text']}{kwargs.get('post_prompt', LLAVA_SUFFIX)}"


def organism_process_results(doc: dict, results: list) -> dict:
    """One answer parsed by the POPE/LLaVA rule; the same record feeds every metric."""
    answer = str(results[0]).strip()
    pred, parseable = parse_yes_no(answer)
    record = {
        "question_id": doc["question_id"],
        "label": str(doc["label"]).strip().lower(),
        "pred": pred,
        "parseable": parseable,
        "answer": answer,
    }
    return {name: record for name in ORGANISM_METRICS}


def _metric(records: list[dict], name: str) -> float:
    return pope_metrics([r["label"] for r in records], [r["pred"] for r in records])[name]


def organism_accuracy(records: list[dict]) -> float:
    return _metric(records, "accuracy")


def organism_precision(records: list[dict]) -> float:
    return _metric(records, "precision")


def organism_recall(records: list[dict]) -> float:
    return _metric(records, "recall")


def organism_f1(records: list[dict]) -> float:
    return _metric(records, "f1")


def organism_yes_ratio(records: list[dict]) -> float:
    """Share of PREDICTED yes."""
    return _metric(records, "yes_ratio")


def organism_unparseable(records: list[dict]) -> int:
    return sum(not r["parseable"] for r in records)


# --- lmms-eval's POPE with the yes-ratio of the predictions ----------------------------------
def predicted_yes_ratio(results: list[dict]) -> float:
    """``#(prediction == "yes") / N`` over lmms-eval POPE result records (``prediction`` is
    the lower-cased, stripped answer, as lmms-eval's POPE precision and recall read it)."""
    if not results:
        return 0.0
    return sum(r["prediction"] == "yes" for r in results) / len(results)
