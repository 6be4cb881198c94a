"""``look_closer``: answer, read where the question looked, crop there, ask again.

    from vlm_focus import zoom
    found = zoom.look_closer(model, processor, image, "Is there a red_circle in the image?")
    found.answer, found.crops[0], found.map, found.seconds

The steps, per batch of questions (each row one image and one question):

1. plain pass (``route="never"``, or ``"adaptive"`` with a first-token ``statistic``):
   ``generate()`` answers every question; the first answer token's distribution gives the
   routing score (:mod:`._routing`). With an attention-map ``statistic`` (``peak``,
   ``entropy``, ``outside``) the map comes first instead: every question the zoom can crop is
   mapped (step 2), its map's score routes it, and only the rows not routed are answered
   plainly;
2. map (routed rows): one :class:`~vlm_focus.grounding.GroundingPass` over the prompts reads
   the attention of the question's content words (its :meth:`mentions`, or ``focus=``) at the
   chosen ``layers`` or localization ``heads``: a :class:`~vlm_focus.grounding.HeatMap` in the
   image's pixels;
3. regions: the map's top boxes (:func:`vlm_focus.grounding.boxes`), or a point box at its
   peak, grown into crops by :func:`crop_box` (margin, minimum size, the aspect of the model's
   view, clipped to the image);
4. re-ask: the question again with the image and the crops (``"both"``) or the crops alone
   (``"crop"``); the default per model type is ``zoom.default_mode``. A crop that is the whole
   image shows nothing new: such a row keeps its plain answer (or is asked plainly). Where the
   smallest allowed crop already covers the image (with ``min_size="view"``: an image the
   processor does not shrink) no map is read at all.

It works on a model wrapped by :func:`vlm_focus.wrap`: both passes then run pruned, and the
probe reads the attention the pruned model computes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..geometry import Frame, as_size
from ..grounding import Box, HeatMap
from ._options import ZoomOptions, merged
from ._passes import clock, generate_answers, map_rows, per_row, picture
from ._reask import reask_images, resolve_mode
from ._regions import can_crop
from ._routing import MAP_STATISTICS, TOKEN_STATISTICS, first_token_confidence, map_statistic, route


@dataclass
class ZoomAnswer:
    """One question's result.

    Attributes:
        question: the question asked.
        answer: the final answer (the zoomed one where the row was zoomed).
        plain_answer: the plain pass's answer (``None`` for a row asked zoomed only: with
            ``route="always"``, or routed by an attention-map statistic); a row that is not
            :attr:`zoomed` is asked plainly, and this is its answer.
        confidence: the routing statistic's score (``ZoomOptions.statistic``): the plain
            pass's first-token confidence, or the attention map's score; ``None`` where it was
            not computed (``route="always"``; a map statistic on an image the zoom cannot crop).
        routed: whether the row went to the zoom.
        zoomed: whether it was re-asked with a crop (a crop equal to the whole image is not).
        mode: ``"both"`` or ``"crop"``.
        crops: the chosen regions in the image's pixels (empty when not routed).
        boxes: the attention boxes they grew from (a peak gives a 1-pixel box).
        map: the question's attention map (``None`` when no map was read: not routed under a
            first-token statistic, or the smallest crop already covers the image).
        seconds: this row's share of each phase's batch time (``plain``, ``map``, ``reask``)
            and their sum (``total``); the mean of ``total`` is the batch's wall time per row.
            A row that is not :attr:`zoomed` has no ``reask`` time: its one pass is plain.
    """

    question: str
    answer: str
    plain_answer: str | None
    confidence: float | None
    routed: bool
    zoomed: bool
    mode: str
    crops: list[Frame] = field(default_factory=list)
    boxes: list[Box] = field(default_factory=list)
    map: HeatMap | None = field(default=None, repr=False)
    seconds: dict[str, float] = field(default_factory=dict)

    def to_json(self) -> dict:
        """A JSON record (the map left out)."""
        return {
            "question": self.question,
            "answer": self.answer,
            "plain_answer": self.plain_answer,
            "confidence": self.confidence,
            "routed": self.routed,
            "zoomed": self.zoomed,
            "mode": self.mode,
            "crops": [c.xywh for c in self.crops],
            "boxes": [[*b.xywh, b.score] for b in self.boxes],
            "seconds": dict(self.seconds),
        }


def look_closer(
    model: nn.Module,
    processor: Any,
    image: Any,
    question: str | Sequence[str],
    *,
    focus: str | Sequence[str | None] | None = None,
    config: ZoomOptions | None = None,
    generate_kwargs: dict[str, Any] | None = None,
    **options: Any,
) -> ZoomAnswer | list[ZoomAnswer]:
    """Answer ``question`` about ``image``, looking closer where the model's attention points.

    Args:
        model: a supported VLM, plain or wrapped by :func:`vlm_focus.wrap`.
        processor: its processor (chat template, tokenizer, image settings).
        image: a PIL image, a path or an ``[H, W, 3]`` uint8 array; or a list, one per question.
        question: one question, or a list (one batch).
        focus: the phrase of each question whose attention picks the region (one for every
            row, or one per row); default the question's content words.
        config: :class:`ZoomOptions`; keyword ``options`` build or override it (``route``,
            ``threshold``, ``statistic``, ``mode``, ``regions``, ``margin``, ``min_size``,
            ``aspect``, ``anchor``, ``layers``, ``heads``, ``max_new_tokens``, ...).
        generate_kwargs: extra ``generate()`` arguments for both passes (greedy by default).

    Returns:
        a :class:`ZoomAnswer` for one question, a list of them for a list.
    """
    opts = merged(config, options)
    single = isinstance(question, str)
    questions = [question] if single else list(question)
    images = [image] if single else list(image)
    if len(images) != len(questions):
        raise ValueError(f"{len(images)} images but {len(questions)} questions")
    if not questions:
        raise ValueError("no questions")
    for q in questions:
        if not isinstance(q, str) or not q.strip():
            raise ValueError(f"every question must be a non-empty str, got {q!r}")
    focuses = per_row(focus, len(questions), "focus", single)
    mode = resolve_mode(model, opts.mode)
    pictures = [picture(i) for i in images]
    sizes = [as_size(p) for p in pictures]
    n = len(questions)
    now = clock(model)
    spent = {"plain": [0.0] * n, "map": [0.0] * n, "reask": [0.0] * n}
    # where the smallest allowed crop already covers the image (an image the processor does
    # not shrink), every crop is the whole image: no map is needed
    croppable = [can_crop(opts, sizes[b], processor) for b in range(n)]

    plain: list[str | None] = [None] * n
    confidence: list[float | None] = [None] * n
    routed = [True] * n
    heats: list[HeatMap | None] = [None] * n
    found: list[list[Box]] = [[] for _ in range(n)]
    crops: list[list[Frame]] = [[] for _ in range(n)]

    def read_maps(rows: list[int]) -> None:
        if not rows:
            return
        start = now()
        mapped = map_rows(model, processor, pictures, questions, focuses, rows, opts, mode)
        share = (now() - start) / len(rows)
        for b, (heat, boxes_b, crops_b) in mapped.items():
            heats[b], found[b], crops[b] = heat, boxes_b, crops_b
            spent["map"][b] = share

    def answer(rows: list[int], phase: str, logits: bool) -> tuple[list[str], torch.Tensor | None]:
        """One batch of answers: the image (``plain``) or the image and its crops (``reask``);
        each row's share of the batch's wall time is its time in ``phase``."""
        start = now()
        image_rows = [
            [pictures[b]] if phase == "plain" else reask_images(pictures[b], crops[b], mode)
            for b in rows
        ]
        texts, first = generate_answers(
            model,
            processor,
            image_rows,
            [questions[b] for b in rows],
            opts.max_new_tokens,
            generate_kwargs,
            logits=logits,
        )
        share = (now() - start) / len(rows)
        for b in rows:
            spent[phase][b] = share
        return texts, first

    def ask_plainly(rows: list[int], logits: bool) -> torch.Tensor | None:
        if not rows:
            return None
        texts, first = answer(rows, "plain", logits)
        for b, text in zip(rows, texts, strict=True):
            plain[b] = text
        return first

    by_map = opts.route == "adaptive" and opts.statistic in MAP_STATISTICS
    if by_map:
        # map first: the map's score routes; only the rows not routed are answered plainly
        read_maps([b for b in range(n) if croppable[b]])
        for b in range(n):
            if heats[b] is not None:
                confidence[b] = map_statistic(heats[b], opts.statistic, crops[b])
        routed = [c is not None and route([c], opts.threshold)[0] for c in confidence]
        for b in range(n):
            if not routed[b]:
                found[b], crops[b] = [], []
        ask_plainly([b for b in range(n) if not routed[b]], logits=False)
    elif opts.route != "always":
        logits = ask_plainly(list(range(n)), logits=opts.statistic in TOKEN_STATISTICS)
        if logits is not None:
            confidence = first_token_confidence(logits, opts.statistic).tolist()
        if opts.route == "never":
            routed = [False] * n
        else:
            routed = route(confidence, opts.threshold)

    zoomed = [False] * n
    rows = [b for b in range(n) if routed[b]]
    for b in rows:
        if not croppable[b]:
            crops[b] = [Frame(0, 0, sizes[b].width, sizes[b].height)]
    if not by_map:
        read_maps([b for b in rows if croppable[b]])
    for b in rows:
        zoomed[b] = not all(c.is_whole(sizes[b]) for c in crops[b])
    # a crop equal to the whole image shows nothing new: such a row keeps (or gets) the plain
    # answer, from a plain pass, timed as one
    ask_plainly([b for b in rows if not zoomed[b] and plain[b] is None], logits=False)
    answers: list[str | None] = list(plain)
    ask = [b for b in rows if zoomed[b]]
    if ask:
        texts, _ = answer(ask, "reask", logits=False)
        for b, text in zip(ask, texts, strict=True):
            answers[b] = text

    out = []
    for b in range(n):
        seconds = {k: v[b] for k, v in spent.items()}
        seconds["total"] = sum(seconds.values())
        out.append(
            ZoomAnswer(
                question=questions[b],
                answer=str(answers[b]),
                plain_answer=plain[b],
                confidence=confidence[b],
                routed=routed[b],
                zoomed=zoomed[b],
                mode=mode,
                crops=crops[b],
                boxes=found[b],
                map=heats[b],
                seconds=seconds,
            )
        )
    return out[0] if single else out


def reask(
    model: nn.Module,
    processor: Any,
    image: Any,
    question: str | Sequence[str],
    crops: Sequence[Frame] | Sequence[Sequence[Frame]],
    *,
    mode: str | None = None,
    max_new_tokens: int = 16,
    generate_kwargs: dict[str, Any] | None = None,
) -> str | list[str]:
    """Ask ``question`` again with given crops (``Frame`` values in the image's pixels):
    the image and the crops (``mode="both"``) or the crops alone (``"crop"``); default the
    model type's mode. One question takes a list of crops; a list of questions takes one list
    of crops per question."""
    mode = resolve_mode(model, mode)
    single = isinstance(question, str)
    questions = [question] if single else list(question)
    images = [image] if single else list(image)
    per_row = [list(crops)] if single else [list(c) for c in crops]
    if not (len(images) == len(questions) == len(per_row)):
        raise ValueError(
            f"{len(images)} images, {len(questions)} questions and {len(per_row)} crop lists"
        )
    for b, row in enumerate(per_row):
        if not row or not all(isinstance(c, Frame) for c in row):
            raise TypeError(f"row {b}: crops must be a non-empty list of vlm_focus.geometry.Frame")
    pictures = [picture(i) for i in images]
    image_rows = [reask_images(p, row, mode) for p, row in zip(pictures, per_row, strict=True)]
    texts, _ = generate_answers(
        model, processor, image_rows, questions, max_new_tokens, generate_kwargs, logits=False
    )
    return texts[0] if single else texts
