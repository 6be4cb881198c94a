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

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from ..generation import greedy_generate
from ..geometry import Frame, Size, as_size, frame_aspect, native_side
from ..grounding import Box, GroundingPass, HeatMap, Mention, boxes, point
from ..loading import build_inputs, decode_new_tokens, load_image, to_model
from ..model_adapters import get_adapter
from ._crop import crop_box, union_box
from ._reask import MODES, multi_image_inputs, reask_images, resolve_mode
from ._routing import (
    MAP_STATISTICS,
    STATISTICS,
    TOKEN_STATISTICS,
    Calibration,
    calibrate,
    check_statistic,
    check_threshold,
    first_token_confidence,
    map_statistic,
    route,
)

ROUTES = ("never", "always", "adaptive")
ANCHORS = ("box", "peak")
ASPECTS = ("view", "image", "box")


@dataclass
class ZoomOptions:
    """How :func:`look_closer` picks regions and when it zooms (serialisable; the evaluations
    record it with their results)."""

    route: str = field(
        default="always",
        metadata={
            "help": "always zoom, zoom when the routing statistic (the plain answer's "
            "first-token confidence or the question's attention map) is below threshold "
            "(adaptive), or never",
            "choices": ROUTES,
        },
    )
    threshold: float | None = field(
        default=None,
        metadata={
            "help": "adaptive routing: zoom when the statistic is below it (0: never, 1: "
            "every question the zoom can crop); from zoom.calibrate",
        },
    )
    statistic: str = field(
        default="top1",
        metadata={
            "help": "routing statistic, in [0, 1], low = zoom: the first answer token's top-1 "
            "probability (top1) or top-1 minus top-2 (margin), or the question's attention "
            "map's 1 - peak cell share (peak), normalised entropy (entropy) or share of mass "
            "outside the zoom's crop (outside); top1 measured best on the organism "
            "(zoom_quality.md)",
            "choices": STATISTICS,
        },
    )
    mode: str | None = field(
        default=None,
        metadata={
            "help": "re-ask with the image and its crops (both) or the crops alone (crop)",
            "choices": MODES,
            "default_text": "the model type's default (zoom.default_mode)",
        },
    )
    regions: int = field(
        default=1,
        metadata={
            "help": "crops per question (with mode crop, several are merged into one)",
        },
    )
    margin: float = field(
        default=0.25, metadata={"help": "share of the attention box's side added on each side"}
    )
    min_size: str | int | float = field(
        default="view",
        metadata={
            "help": "smallest crop side: 'view' (the encoder's input side, so a crop reaches it "
            "at no more than 1:1), pixels (int) or a share of the image's short side (float "
            "in (0, 1])",
        },
    )
    aspect: str | float = field(
        default="view",
        metadata={
            "help": "crop shape: 'view' (the model's view of the image: square for a centre "
            "crop or a pad), 'image', 'box' (the box's own) or a width/height ratio",
        },
    )
    anchor: str = field(
        default="box",
        metadata={"help": "crop around the map's top boxes or its peak", "choices": ANCHORS},
    )
    box_threshold: float | str = field(
        default="otsu", metadata={"help": "threshold of grounding.boxes on the map"}
    )
    layers: list[int] | None = field(
        default=None,
        metadata={"help": "decoder layers whose attention makes the map", "default_text": "all"},
    )
    heads: Any = field(
        default=None,
        metadata={
            "help": "localization heads (grounding.select_localization_heads) or {layer: [heads]}"
        },
    )
    max_new_tokens: int = field(default=16, metadata={"help": "new tokens per answer"})

    def __post_init__(self) -> None:
        if self.route not in ROUTES:
            raise ValueError(f"route={self.route!r}; allowed: {ROUTES}")
        if self.route == "adaptive" and self.threshold is None:
            raise ValueError(
                "route='adaptive' needs threshold= (a number in [0, 1], e.g. from "
                "zoom.calibrate(...).threshold)"
            )
        if self.threshold is not None:
            self.threshold = check_threshold(self.threshold)
        check_statistic(self.statistic)
        if self.mode is not None and self.mode not in MODES:
            raise ValueError(f"mode={self.mode!r}; allowed: {MODES} or None")
        if isinstance(self.regions, bool) or not isinstance(self.regions, int) or self.regions < 1:
            raise ValueError(f"regions={self.regions!r} must be an int >= 1")
        if self.anchor not in ANCHORS:
            raise ValueError(f"anchor={self.anchor!r}; allowed: {ANCHORS}")
        if self.anchor == "peak" and self.regions != 1:
            raise ValueError("anchor='peak' gives one region: use regions=1")
        if (
            isinstance(self.margin, bool)
            or not isinstance(self.margin, int | float)
            or (self.margin < 0)
        ):
            raise ValueError(f"margin={self.margin!r} must be a number >= 0")
        m = self.min_size
        if isinstance(m, str):
            if m != "view":
                raise ValueError(f"min_size={m!r}; allowed: 'view', pixels (int), share (float)")
        elif isinstance(m, bool) or not isinstance(m, int | float):
            raise ValueError(f"min_size={m!r}; allowed: 'view', pixels (int), share (float)")
        elif isinstance(m, float) and not 0 < m <= 1:
            raise ValueError(f"min_size={m!r}: a share of the short side lies in (0, 1]")
        elif isinstance(m, int) and m < 0:
            raise ValueError(f"min_size={m!r} pixels must be >= 0")
        a = self.aspect
        if isinstance(a, str):
            if a not in ASPECTS:
                raise ValueError(f"aspect={a!r}; allowed: {ASPECTS} or a ratio > 0")
        elif isinstance(a, bool) or not isinstance(a, int | float) or a <= 0:
            raise ValueError(f"aspect={a!r}; allowed: {ASPECTS} or a ratio > 0")
        if self.layers is not None:
            self.layers = [int(v) for v in self.layers]
        if (
            isinstance(self.max_new_tokens, bool)
            or not isinstance(self.max_new_tokens, int)
            or (self.max_new_tokens < 1)
        ):
            raise ValueError(f"max_new_tokens={self.max_new_tokens!r} must be an int >= 1")

    def to_json(self) -> dict:
        return asdict(self)


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


# --- regions ----------------------------------------------------------------------------------
def _min_side(options: ZoomOptions, size: Size, processor: Any) -> float:
    m = options.min_size
    if m == "view":
        try:
            return float(native_side(processor))
        except ValueError as error:
            raise ValueError(f"min_size='view': {error}; pass min_size in pixels") from None
    if isinstance(m, float):
        return m * min(size.width, size.height)
    return float(m)


def _aspect(options: ZoomOptions, heat: HeatMap, size: Size) -> float | None:
    a = options.aspect
    if a == "view":
        _, frames = heat.require_pixels()
        return frame_aspect(frames[0])  # the base view: the model's view of the whole image
    if a == "image":
        return size.width / size.height
    if a == "box":
        return None
    return float(a)


def choose_crops(
    heat: HeatMap,
    options: ZoomOptions | None = None,
    *,
    processor: Any = None,
    mode: str = "crop",
    **overrides: Any,
) -> tuple[list[Box], list[Frame]]:
    """The attention boxes of ``heat`` and the crops grown from them (``options`` as in
    :class:`ZoomOptions`; keywords override it).

    ``anchor="box"``: the map's top ``regions`` boxes (:func:`vlm_focus.grounding.boxes`);
    ``"peak"``: a 1-pixel box at its peak (:func:`vlm_focus.grounding.point`). A map without
    mass anchors at the image's centre. Each box becomes :func:`crop_box` with the margin, the
    minimum side and the aspect; with ``mode="crop"`` several crops merge into one, the crop of
    their union (a one-image prompt has room for one).
    """
    options = _options(options, overrides)
    if mode not in MODES:
        raise ValueError(f"mode={mode!r}; allowed: {MODES}")
    size, _ = heat.require_pixels()
    size = as_size(size)
    found: list[Box] = []
    if heat.mass > 0 and options.anchor == "box":
        found = boxes(heat, threshold=options.box_threshold, max_boxes=options.regions)
    if not found:
        if heat.mass > 0:
            x, y = point(heat)
        else:
            x, y = size.width / 2, size.height / 2
        found = [Box(x - 0.5, y - 0.5, 1.0, 1.0, 0.0)]
    min_side = _min_side(options, size, processor)
    aspect = _aspect(options, heat, size)
    crops = [
        crop_box(b, size, margin=options.margin, min_size=min_side, aspect=aspect) for b in found
    ]
    if mode == "crop" and len(crops) > 1:
        crops = [crop_box(union_box(crops), size, margin=0.0, min_size=min_side, aspect=aspect)]
    return found, crops


# --- passes -----------------------------------------------------------------------------------
def _options(config: ZoomOptions | None, overrides: dict[str, Any]) -> ZoomOptions:
    if config is not None and not isinstance(config, ZoomOptions):
        raise TypeError(f"config must be a ZoomOptions, got {type(config).__name__}")
    if not overrides:
        return config or ZoomOptions()
    known = set(ZoomOptions.__dataclass_fields__)
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise ValueError(f"unknown zoom option(s) {unknown}; allowed: {sorted(known)}")
    base = asdict(config) if config is not None else {}
    if config is not None:
        base["heads"] = config.heads  # keep the object, not its dict
    return ZoomOptions(**{**base, **overrides})


def _picture(image: Any) -> Any:
    if hasattr(image, "ndim") and hasattr(image, "shape") and not hasattr(image, "crop"):
        from PIL import Image

        image = Image.fromarray(image)
    return load_image(image)


def _clock(model: nn.Module) -> Callable[[], float]:
    device = next(model.parameters()).device
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def now() -> float:
        sync()
        return time.perf_counter()

    return now


def _inputs(processor: Any, image_rows: Sequence[Sequence[Any]], questions: Sequence[str]) -> dict:
    if all(len(row) == 1 for row in image_rows):
        return build_inputs(processor, [row[0] for row in image_rows], list(questions))
    return multi_image_inputs(processor, image_rows, questions)


def _generate(
    model: nn.Module,
    processor: Any,
    image_rows: Sequence[Sequence[Any]],
    questions: Sequence[str],
    max_new_tokens: int,
    generate_kwargs: dict[str, Any] | None,
    logits: bool,
) -> tuple[list[str], torch.Tensor | None]:
    """Answers (and the first answer token's logits ``[B, V]``) for rows of images."""
    inputs = to_model(model, _inputs(processor, image_rows, questions))
    sequences, first = greedy_generate(
        model,
        inputs,
        max_new_tokens=max_new_tokens,
        first_logits=logits,
        **(generate_kwargs or {}),
    )
    return decode_new_tokens(processor, inputs, sequences), first


def _croppable(options: ZoomOptions, size: Size, processor: Any) -> bool:
    """Whether the zoom can crop the image: its smallest allowed crop is smaller than the image
    (with ``min_size="view"``: the processor shrinks the image)."""
    return _min_side(options, size, processor) < max(size)


def _map_rows(
    model: nn.Module,
    processor: Any,
    pictures: Sequence[Any],
    questions: Sequence[str],
    focuses: Sequence[str | None],
    rows: Sequence[int],
    options: ZoomOptions,
    mode: str,
) -> dict[int, tuple[HeatMap, list[Box], list[Frame]]]:
    """One :class:`GroundingPass` over ``rows``: each row's question map, its boxes and crops."""
    if not rows:
        return {}
    inputs = to_model(
        model, build_inputs(processor, [pictures[b] for b in rows], [questions[b] for b in rows])
    )
    layers = options.layers
    if layers is None and options.heads is None:
        # every layer: the zoom's measured best map on small objects (zoom_quality.md),
        # unlike grounding's default layers, which point best at native size
        layers = list(range(len(get_adapter(model).decoder_layers(model))))
    gp = GroundingPass(
        model,
        inputs,
        processor=processor,
        images=[pictures[b] for b in rows],
        layers=layers,
        heads=options.heads,
    )
    out = {}
    for j, b in enumerate(rows):
        heat = _focus_map(gp, j, focuses[b], questions[b])
        found, crops = choose_crops(heat, options, processor=processor, mode=mode)
        out[b] = (heat, found, crops)
    return out


def routing_statistics(
    model: nn.Module,
    processor: Any,
    images: Sequence[Any],
    questions: Sequence[str],
    *,
    statistics: Sequence[str] = STATISTICS,
    focus: str | Sequence[str | None] | None = None,
    config: ZoomOptions | None = None,
    generate_kwargs: dict[str, Any] | None = None,
    **options: Any,
) -> tuple[list[str], dict[str, list[float | None]]]:
    """The plain answers of one batch and every requested routing statistic of each question
    (:mod:`._routing`): first-token ones from the plain pass's logits, attention-map ones from
    one map pass over the questions the zoom can crop, exactly as :func:`look_closer` reads
    them (``focus``, ``config`` and keyword ``options`` as there: layers, heads, crop rules,
    ``max_new_tokens``). A map statistic is ``None`` for an image the zoom cannot crop."""
    opts = _options(config, options)
    wanted = [check_statistic(name) for name in statistics]
    questions = list(questions)
    if len(images) != len(questions):
        raise ValueError(f"{len(images)} images but {len(questions)} questions")
    focuses = _rows_of(focus, len(questions), "focus", False)
    pictures = [_picture(i) for i in images]
    texts, logits = _generate(
        model,
        processor,
        [[p] for p in pictures],
        questions,
        opts.max_new_tokens,
        generate_kwargs,
        logits=True,
    )
    values: dict[str, list[float | None]] = {}
    for name in wanted:
        if name in TOKEN_STATISTICS:
            values[name] = first_token_confidence(logits, name).tolist()
    if any(name in MAP_STATISTICS for name in wanted):
        mode = resolve_mode(model, opts.mode)
        rows = [b for b, p in enumerate(pictures) if _croppable(opts, as_size(p), processor)]
        mapped = _map_rows(model, processor, pictures, questions, focuses, rows, opts, mode)
        for name in wanted:
            if name in MAP_STATISTICS:
                values[name] = [
                    map_statistic(mapped[b][0], name, mapped[b][2]) if b in mapped else None
                    for b in range(len(questions))
                ]
    return texts, {name: values[name] for name in wanted}


def first_pass(
    model: nn.Module,
    processor: Any,
    images: Sequence[Any],
    questions: Sequence[str],
    *,
    statistic: str = "top1",
    max_new_tokens: int = 16,
    generate_kwargs: dict[str, Any] | None = None,
    focus: str | Sequence[str | None] | None = None,
    config: ZoomOptions | None = None,
    **options: Any,
) -> tuple[list[str], list[float | None]]:
    """The plain answers of one batch and their routing scores (:mod:`._routing`): the
    first-token confidence, or an attention-map statistic (``None`` for an image the zoom
    cannot crop; map settings as in :func:`routing_statistics`)."""
    texts, values = routing_statistics(
        model,
        processor,
        images,
        questions,
        statistics=[statistic],
        focus=focus,
        config=config,
        generate_kwargs=generate_kwargs,
        **{**options, "max_new_tokens": max_new_tokens},
    )
    return texts, values[statistic]


def _focus_map(gp: GroundingPass, row: int, focus: str | None, question: str) -> HeatMap:
    """The map of ``focus`` in the row's prompt, else of the question's content words
    (:meth:`GroundingPass.mentions` within the question), else of the whole instruction."""
    if focus is not None:
        return gp.map(focus, row=row, source="prompt")
    found: list[Mention] = gp.mentions(source="prompt", within=question)[row]
    if found:
        return gp.map(found)
    return gp.map(None, row=row, source="prompt")


def _rows_of(value: Any, n: int, name: str, single: bool) -> list[Any]:
    if value is None or isinstance(value, str):
        return [value] * n
    if single:
        raise TypeError(f"{name} must be a str or None for one question, got {value!r}")
    value = list(value)
    if len(value) != n:
        raise ValueError(f"{name} has {len(value)} entries for {n} questions")
    return value


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
    opts = _options(config, options)
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
    focuses = _rows_of(focus, len(questions), "focus", single)
    mode = resolve_mode(model, opts.mode)
    pictures = [_picture(i) for i in images]
    sizes = [as_size(p) for p in pictures]
    n = len(questions)
    now = _clock(model)
    spent = {"plain": [0.0] * n, "map": [0.0] * n, "reask": [0.0] * n}
    # where the smallest allowed crop already covers the image (an image the processor does
    # not shrink), every crop is the whole image: no map is needed
    croppable = [_croppable(opts, sizes[b], processor) for b in range(n)]

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
        mapped = _map_rows(model, processor, pictures, questions, focuses, rows, opts, mode)
        share = (now() - start) / len(rows)
        for b, (heat, boxes_b, crops_b) in mapped.items():
            heats[b], found[b], crops[b] = heat, boxes_b, crops_b
            spent["map"][b] = share

    def ask_plainly(rows: list[int], logits: bool) -> torch.Tensor | None:
        if not rows:
            return None
        start = now()
        texts, first = _generate(
            model,
            processor,
            [[pictures[b]] for b in rows],
            [questions[b] for b in rows],
            opts.max_new_tokens,
            generate_kwargs,
            logits=logits,
        )
        share = (now() - start) / len(rows)
        for b, text in zip(rows, texts, strict=True):
            plain[b] = text
            spent["plain"][b] = share
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
        start = now()
        texts, _ = _generate(
            model,
            processor,
            [reask_images(pictures[b], crops[b], mode) for b in ask],
            [questions[b] for b in ask],
            opts.max_new_tokens,
            generate_kwargs,
            logits=False,
        )
        share = (now() - start) / len(ask)
        for b, text in zip(ask, texts, strict=True):
            answers[b] = text
            spent["reask"][b] = share

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
    pictures = [_picture(i) for i in images]
    image_rows = [reask_images(p, row, mode) for p, row in zip(pictures, per_row, strict=True)]
    texts, _ = _generate(
        model, processor, image_rows, questions, max_new_tokens, generate_kwargs, logits=False
    )
    return texts[0] if single else texts


# --- calibration on a model -------------------------------------------------------------------
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
    focuses = _rows_of(focus, len(questions), "focus", False)
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
