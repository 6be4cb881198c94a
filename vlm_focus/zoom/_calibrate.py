"""Calibrating the adaptive route on a model: plain answers and routing scores of held-out
questions, then the conformal threshold (:func:`~vlm_focus.zoom.calibrate`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from torch import nn

from ._options import ZoomOptions
from ._passes import first_pass, per_row
from ._routing import Calibration, calibrate, check_statistic


def answers_match(answer: str, reference: str) -> bool:
    """The default correctness rule of :func:`calibrate_model`: the answer's first word equals
    the reference's (letters, digits and ``_`` only, lower case). POPE-style evaluations pass
    their own parsing rule instead."""

    def first(text: str) -> str:
        words = str(text).strip().split()
        return "".join(ch for ch in words[0] if ch.isalnum() or ch == "_").lower() if words else ""

    return first(answer) == first(reference) != ""


def calibrate_model(
    model: nn.Module,
    processor: Any,
    images: Sequence[Any],
    questions: Sequence[str],
    references: Sequence[str],
    *,
    recall: float = 0.9,
    statistic: str = "top1",
    correct: Callable[[str, str], bool] | None = None,
    batch_size: int = 8,
    max_new_tokens: int = 16,
    generate_kwargs: dict[str, Any] | None = None,
    focus: str | Sequence[str | None] | None = None,
    config: ZoomOptions | None = None,
    **options: Any,
) -> tuple[Calibration, list[dict]]:
    """Calibrate the routing threshold on held-out questions: plain answers and routing scores
    in batches (:func:`first_pass`; an attention-map ``statistic`` reads the map as
    :func:`look_closer` does, with ``focus``, ``config`` and keyword ``options``), hard =
    ``not correct(answer, reference)`` (default :func:`answers_match`), then :func:`calibrate`
    over the questions that have a score (a map statistic has none where the zoom cannot crop:
    such a question is never routed).

    Returns the :class:`Calibration` and one record per question (``answer``, ``confidence``:
    the score or ``None``, ``hard``).
    """
    check_statistic(statistic)
    if not len(images) == len(questions) == len(references):
        raise ValueError(
            f"{len(images)} images, {len(questions)} questions, {len(references)} references"
        )
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size={batch_size!r} must be an int >= 1")
    correct = correct or answers_match
    focuses = per_row(focus, len(questions), "focus", False)
    records: list[dict] = []
    for start in range(0, len(questions), batch_size):
        part = slice(start, start + batch_size)
        texts, conf = first_pass(
            model,
            processor,
            list(images[part]),
            list(questions[part]),
            statistic=statistic,
            max_new_tokens=max_new_tokens,
            generate_kwargs=generate_kwargs,
            focus=focuses[part],
            config=config,
            **options,
        )
        for text, c, ref in zip(texts, conf, references[part], strict=True):
            records.append({"answer": text, "confidence": c, "hard": not correct(text, ref)})
    scored = [r for r in records if r["confidence"] is not None]
    if not scored:
        raise ValueError(
            f"statistic={statistic!r}: no calibration image is larger than the zoom's smallest "
            "crop, so no question has an attention-map score; calibrate on images the zoom "
            "can crop, or use a first-token statistic"
        )
    calibration = calibrate(
        [r["confidence"] for r in scored],
        [r["hard"] for r in scored],
        recall=recall,
        statistic=statistic,
    )
    return calibration, records
