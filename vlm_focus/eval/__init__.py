"""Evaluations: POPE (object-presence yes/no), COCO attention grounding (box AP, pointing game,
hallucination AUROC) and CHAIR (caption hallucination), with the protocols of docs/protocols.md.

Command line: ``vlm-focus eval pope|coco|chair`` (see :mod:`vlm_focus.eval.cli`). Runs are
resumable JSONL logs (:mod:`vlm_focus.eval.runner`) and shard across ``accelerate launch``
processes.
"""

from .chair import chair_metrics, extract_objects
from .metrics import auroc, coco_box_ap, parse_yes_no, point_in_boxes, pope_metrics
from .pope import SPLITS, build_questions, read_questions

__all__ = [
    "SPLITS",
    "auroc",
    "build_questions",
    "chair_metrics",
    "coco_box_ap",
    "extract_objects",
    "parse_yes_no",
    "point_in_boxes",
    "pope_metrics",
    "read_questions",
]
