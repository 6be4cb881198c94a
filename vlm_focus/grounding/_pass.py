"""One probed forward pass, read many ways: maps, points, boxes, region scores and mentions.

    from vlm_focus import grounding
    gp = grounding.GroundingPass(model, inputs, processor=processor, images=[image])
    heat = gp.map("red_circle")           # HeatMap: .grid (cells), .pixels (original pixels)
    x, y = gp.point("red_circle")         # peak, in the image's pixels
    best = gp.boxes("red_circle")[0]      # Box(x0, y0, width, height, score)
    gp.region_score("red_circle", best)   # MTLA share in [0, 1], one per row

:func:`heatmap`, :func:`region_score`, :func:`ground` (:mod:`._wrappers`) and
:func:`describe_and_ground` (:mod:`._describe`) are thin wrappers over it.

The forward pass and its attention rows come from :mod:`._image_attention`, the query tokens
from :mod:`._token_masks` and the maps from :mod:`._heatmap`.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..generation import extend_with_answer
from ..geometry import (
    RULES,
    Frame,
    Size,
    as_sizes,
    describe_seen,
    images_per_row,
    layout_sizes,
    seen_region,
    unknown_size_message,
)
from ..loading import to_model
from ..model_adapters import get_adapter, merge_views
from ._boxes import Box, boxes, point
from ._defaults import default_layers
from ._heatmap import HeatMap, build_map
from ._image_attention import HeadSpec, head_pairs, head_weights, image_rows, probe_forward
from ._region import box_share
from ._token_masks import (
    Query,
    answer_mask,
    instruction,
    query_mask,
    text_tokens,
    tokenizer_of,
)
from ._words import find_mentions

#: A prompt that asks about nothing in particular: the same image under it gives the
#: prompt-independent attention that ``relative_to=`` divides out (the mitigations' generic
#: contrast asks it too).
GENERIC_PROMPT = "Write a general description of the image."
SOURCES = ("prompt", "answer")


def _grouped(
    per_row: list[list[torch.Tensor]], groups: list[list[list[int]]], dim: int
) -> list[list[torch.Tensor]]:
    """Per row, each group's image blocks' tensors joined along ``dim`` (their tokens)."""
    return [
        [torch.cat([row[i] for i in group], dim) for group in row_groups]
        for row, row_groups in zip(per_row, groups, strict=True)
    ]


class UnseenRegionWarning(UserWarning):
    """Grounding an image the model saw only part of (a centre crop of a wide photo): outside
    :attr:`HeatMap.seen` the map is 0, and nothing there can be found."""


@dataclass(frozen=True)
class Mention:
    """A mention of something in one row: its text, its sequence positions in the pass's input
    (prompt + answer) and whether it lies in the ``"prompt"`` or the ``"answer"``."""

    text: str
    positions: tuple[int, ...]
    row: int
    source: str


MentionQuery = Mention | Sequence[Mention]


class GroundingPass:
    """One teacher-forced forward over the prompt (plus ``answer``) whose attention rows give
    maps for any phrase of it (TAG), points, boxes, MTLA region scores and object mentions.

    For query tokens ``T``, selected (layer, head) pairs ``P`` and an image's visual tokens ``v``::

        map[v] = 1/|P| sum_{(l,h) in P} 1/|T| sum_{t in T} A^{l,h}[t, v]
        A^{l,h}[t, :] = softmax_s(q_t^{l,h} . k_s^{l,h} / sqrt(d))   (causal, padding masked)

    scattered to the token's grid cell and, through :mod:`vlm_focus.geometry`, into the original
    image's pixels. With ``relative_to`` (the same image under a generic prompt such as
    :data:`GENERIC_PROMPT`) every map is divided by the generic prompt's instruction map,
    ``map / (generic + eps)`` with ``eps = 0.05 * mean(generic)``, which removes
    prompt-independent sinks.

    Args:
        model: a supported VLM (SDPA, eager or flash).
        inputs: the processor's output (``input_ids``, ``attention_mask``, pixels, grids).
        processor: the processor that made ``inputs``: its tokenizer finds phrases and its image
            processor's settings place the grids on the image. A bare tokenizer works for
            phrases; the geometry then falls back to the model adapter's rule.
        images: the PIL images given to the processor (one for every image, one per image in
            batch order, or one list per row); their sizes are the pixel frame of the maps.
        sizes: instead of ``images``: :class:`~vlm_focus.geometry.Size` values (or
            ``{"width", "height"}`` mappings), in the same forms.
        answer: generated tokens ``[B, T]`` (``generate()`` output after the prompt), trimmed at
            each row's first end-of-sequence or padding token, appended and read in the same
            pass.
        layers: decoder layers to average (default: :func:`default_layers`, the model's
            measured choice or the first quarter of its layers; ``heads`` implies its own).
        heads: localization heads (:func:`select_localization_heads`) or ``{layer: [heads]}``.
        rows: which tokens may be queried later (a query as in :meth:`map`); default every text
            token of the prompt and the answer. Fewer rows use less memory.
        relative_to: processor outputs of the same images under a generic prompt.
        geometry: one of :data:`vlm_focus.geometry.RULES` for every view, overriding the
            processor's settings.

    LLaVA-NeXT and LLaVA-OneVision inputs carry each image's size (``image_sizes``); for the
    others pass ``images`` (or ``sizes``) to get pixels. Without them the grid maps work and
    anything in pixels raises, saying what to pass.
    """

    def __init__(
        self,
        model: nn.Module,
        inputs: Mapping[str, Any],
        *,
        processor: Any = None,
        images: Any = None,
        sizes: Any = None,
        answer: torch.Tensor | None = None,
        layers: Sequence[int] | None = None,
        heads: HeadSpec = None,
        rows: Query | MentionQuery = None,
        relative_to: Mapping[str, Any] | None = None,
        geometry: str | None = None,
    ) -> None:
        if not isinstance(inputs, Mapping) or "input_ids" not in inputs:
            raise TypeError("inputs must be the processor's output mapping with input_ids")
        if geometry is not None and geometry not in RULES:
            raise ValueError(f"geometry={geometry!r}; allowed: {RULES} or None (the processor's)")
        if images is not None and sizes is not None:
            raise ValueError("pass images= or sizes=, not both")
        given = as_sizes(images, name="images") if images is not None else None
        if sizes is not None:
            given = as_sizes(sizes, name="sizes")
        if heads is not None and layers is None:
            layers = sorted({layer for layer, _ in head_pairs(heads)})
        elif layers is None:
            layers = default_layers(model)  # the model's measured choice, or the rule
        self.model = model
        self.processor = processor
        self.geometry = geometry
        self.adapter = get_adapter(model)
        inputs = to_model(model, inputs)
        self.prompt_length = int(inputs["input_ids"].shape[1])
        if answer is not None:
            keep = answer_mask(model, answer.to(inputs["input_ids"].device))
            full, is_answer = extend_with_answer(inputs, answer, keep)
        else:
            full = dict(inputs)
            is_answer = torch.zeros_like(full["input_ids"], dtype=torch.bool)
        self.inputs = full
        self.is_answer = is_answer  # [B, S] the answer's kept tokens
        self.has_answer = answer is not None
        self.prompt_text = text_tokens(model, full) & ~is_answer  # [B, S]
        self._instruction = instruction(model, full, require=False) & ~is_answer
        record = self.prompt_text | is_answer if rows is None else self._resolve(rows, None)
        prompt_end = self.prompt_length if answer is not None else None
        probed = probe_forward(model, full, record, layers, prompt_end)
        self.layers = probed.layers
        self.weights = head_weights(heads, probed.layers, probed.n_heads)  # [L, H]
        self.layouts = probed.layout
        self._slabs = image_rows(probed, self.weights)  # per row, image: [Tq, n]
        # an image and the crops its processor wrote as blocks of their own: one image
        self._groups = self.adapter.crop_groups(
            self.layouts, images_per_row(given, [len(row) for row in self.layouts])
        )
        if self._groups is not None:
            self.layouts = [
                [merge_views([row[i] for i in group]) for group in groups]
                for row, groups in zip(self.layouts, self._groups, strict=True)
            ]
            self._slabs = _grouped(self._slabs, self._groups, dim=1)
        self._positions = probed.records[0].positions.cpu()  # [B, Tq]
        self._recorded = probed.records[0].mask.cpu()  # [B, Tq]
        self.sizes: list[list[Size | None]] = layout_sizes(self.layouts, given)
        self.frames: list[list[list[Frame] | None]] = [
            [self._frames(layout, size, b, i) for i, (layout, size) in enumerate(zip(row, srow))]
            for b, (row, srow) in enumerate(zip(self.layouts, self.sizes, strict=True))
        ]
        #: ``[B, V]`` next-token logits after the last input token (``None`` with ``answer``)
        self.next_logits = probed.logits if answer is None else None
        self._warn_unseen()
        self._generic = None
        if relative_to is not None:
            generic = GroundingPass(model, relative_to, layers=self.layers, heads=heads, rows=None)
            values = generic._values(generic._instruction, range(len(generic.layouts)))
            blocks = [sum(map(len, groups)) for groups in self._groups or []]
            if self._groups is not None and [len(row) for row in values] == blocks:
                values = _grouped(values, self._groups, dim=0)
            if len(values) != len(self.layouts) or any(
                len(a) != len(b) or any(g.shape[0] != s.shape[1] for g, s in zip(a, b))
                for a, b in zip(values, self._slabs, strict=True)
            ):
                raise ValueError(
                    "relative_to must hold the same images (same rows, same visual tokens) as "
                    "inputs"
                )
            self._generic = values

    # --- geometry -----------------------------------------------------------------------------
    def _frames(self, layout: Any, size: Size | None, row: int, image: int) -> list[Frame] | None:
        if size is None:
            return None
        try:
            return self.adapter.frames(layout, size, processor=self.processor, rule=self.geometry)
        except ValueError as err:
            raise ValueError(f"row {row}, image {image}: {err}") from None

    def seen(self, row: int = 0, image: int = 0) -> Frame:
        """The part of row ``row``'s image ``image`` the model saw, in its pixels
        (:attr:`HeatMap.seen`); ``ValueError`` when the image's size is unknown."""
        self._check_index(row, image)
        size, frames = self.sizes[row][image], self.frames[row][image]
        if size is None or frames is None:
            raise ValueError(unknown_size_message(self.adapter.model_type, row, image))
        return seen_region(size, frames)[0]

    def _warn_unseen(self) -> None:
        """One :class:`UnseenRegionWarning` naming every image the model saw only part of."""
        parts = []
        for b, (sizes, frames) in enumerate(zip(self.sizes, self.frames, strict=True)):
            for i, (size, frame) in enumerate(zip(sizes, frames, strict=True)):
                if size is None or frame is None:
                    continue
                region, share = seen_region(size, frame)
                if share < 1.0:
                    parts.append(f"row {b}, image {i}: {describe_seen(size, region, share)}")
        if parts:
            warnings.warn(
                "the model saw only part of the image (its processor crops it): "
                + "; ".join(parts)
                + ". Maps are 0 and boxes cannot reach outside that region (HeatMap.seen); "
                "pad the photo to the processor's aspect ratio to ground all of it",
                UnseenRegionWarning,
                stacklevel=3,
            )

    # --- queries ------------------------------------------------------------------------------
    def _source(self, source: str | None) -> str:
        if source is None:
            return "answer" if self.has_answer else "prompt"
        if source not in SOURCES:
            raise ValueError(f"source={source!r}; allowed: {SOURCES}")
        if source == "answer" and not self.has_answer:
            raise ValueError("source='answer' needs answer= (the generated tokens)")
        return source

    def _resolve(
        self, query: Query | MentionQuery, source: str | None, only: int | None = None
    ) -> torch.Tensor:
        """``[B, S]`` bool query tokens (only row ``only`` filled when given)."""
        ids = self.inputs["input_ids"]
        if isinstance(query, Mention) or (
            isinstance(query, Sequence) and query and all(isinstance(m, Mention) for m in query)
        ):
            mentions = [query] if isinstance(query, Mention) else list(query)
            mask = torch.zeros_like(ids, dtype=torch.bool)
            for m in mentions:
                mask[m.row, list(m.positions)] = True
            return mask
        source = self._source(source)
        where = self.is_answer if source == "answer" else self.prompt_text
        if query is None:
            mask = self.is_answer if source == "answer" else self._instruction
            rows = range(ids.shape[0]) if only is None else [only]
            if any(not bool(mask[b].any()) for b in rows):
                raise ValueError(f"a row has no {source} tokens to use as the query")
            return mask if only is None else _only(mask, only)
        if isinstance(query, torch.Tensor):
            return query_mask(ids, query, where=where, source=source)
        name = "answer" if source == "answer" else "prompt's text"
        tok = tokenizer_of(self.processor) if self.processor is not None else None
        if only is None:
            return query_mask(ids, query, where=where, tokenizer=tok, source=name)
        part = query_mask(
            ids[only : only + 1], query, where=where[only : only + 1], tokenizer=tok, source=name
        )
        mask = torch.zeros_like(ids, dtype=torch.bool)
        mask[only] = part[0]
        return mask

    def _values(self, query: torch.Tensor, rows: Sequence[int] | range) -> list[list[torch.Tensor]]:
        """Per row in ``rows`` and image, ``[n]``: the mean attention of the row's query
        tokens (divided by the generic map with ``relative_to``)."""
        query = query.cpu()
        out = []
        for b in rows:
            picked = query[b].gather(0, self._positions[b]) & self._recorded[b]  # [Tq]
            wanted = int(query[b].sum())
            if int(picked.sum()) != wanted:
                missing = sorted(
                    set(torch.nonzero(query[b]).flatten().tolist())
                    - set(self._positions[b][self._recorded[b]].tolist())
                )
                raise ValueError(
                    f"row {b}: query positions {missing} were not recorded by this pass "
                    "(pass rows= covering them, or leave rows=None)"
                )
            if wanted == 0:
                raise ValueError(f"row {b} has no query tokens")
            w = picked.float() / wanted
            values = [w @ slab for slab in self._slabs[b]]  # [n] per image
            if self._generic is not None:
                values = [
                    v / (g + 0.05 * g.mean() + 1e-12)
                    for v, g in zip(values, self._generic[b], strict=True)
                ]
            out.append(values)
        return out

    def _heat(self, values: torch.Tensor, b: int, i: int) -> HeatMap:
        return build_map(
            values,
            self.layouts[b][i],
            self.sizes[b][i],
            self.frames[b][i],
            b,
            i,
            self.adapter.model_type,
        )

    # --- maps ---------------------------------------------------------------------------------
    def maps(
        self, query: Query | MentionQuery = None, *, source: str | None = None
    ) -> list[list[HeatMap]]:
        """Per batch row, one :class:`HeatMap` per image, for a query in every row.

        ``query``: a phrase (``str``), a token-id span, a ``[B, S]`` bool mask or ``[B, Tq]``
        positions, or :class:`Mention` values; default the answer's tokens when the pass has
        an answer, else the instruction (the text after the image). Phrases are searched in
        ``source`` (``"answer"`` when there is one, else ``"prompt"``), last occurrence first.
        """
        mask = self._resolve(query, source)
        values = self._values(mask, range(mask.shape[0]))
        return [[self._heat(v, b, i) for i, v in enumerate(row)] for b, row in enumerate(values)]

    def map(
        self,
        query: Query | MentionQuery = None,
        *,
        row: int = 0,
        image: int = 0,
        source: str | None = None,
    ) -> HeatMap:
        """The :class:`HeatMap` of one row's image for a query (as in :meth:`maps`; a phrase
        need only be in this row). :class:`Mention` queries use their own row."""
        if isinstance(query, Mention):
            row = query.row
        elif isinstance(query, Sequence) and query and all(isinstance(m, Mention) for m in query):
            rows = {m.row for m in query}
            if len(rows) != 1:
                raise ValueError(f"mentions of one map must share a row, got rows {sorted(rows)}")
            row = rows.pop()
        self._check_index(row, image)
        mask = self._resolve(query, source, only=row)
        return self._heat(self._values(mask, [row])[0][image], row, image)

    def _check_index(self, row: int, image: int) -> None:
        if not 0 <= row < len(self.layouts):
            raise ValueError(f"row={row}: the batch has {len(self.layouts)} rows")
        if not 0 <= image < len(self.layouts[row]):
            raise ValueError(
                f"image={image}, but row {row} holds {len(self.layouts[row])} image(s)"
            )

    def point(
        self,
        query: Query | MentionQuery = None,
        *,
        row: int = 0,
        image: int = 0,
        source: str | None = None,
        sigma: float | None = None,
    ) -> tuple[float, float]:
        """The map's peak ``(x, y)`` in original image pixels (:func:`point`)."""
        return point(self.map(query, row=row, image=image, source=source), sigma=sigma)

    def boxes(
        self,
        query: Query | MentionQuery = None,
        *,
        row: int = 0,
        image: int = 0,
        source: str | None = None,
        **options: Any,
    ) -> list[Box]:
        """Boxes (:class:`Box`, original image pixels) around the map's blobs, best first
        (:func:`boxes`; ``options`` are its ``threshold``, ``sigma``, ``max_boxes``,
        ``min_area``)."""
        return boxes(self.map(query, row=row, image=image, source=source), **options)

    def region_score(
        self,
        query: Query | MentionQuery,
        box: Any,
        *,
        image: int = 0,
        source: str | None = None,
    ) -> torch.Tensor:
        """MTLA region score of ``box`` (a :class:`~vlm_focus.geometry.Frame` or
        ``[x, y, w, h]`` in original pixels, one for every row or one per row): the share of
        the query's image attention inside it, ``[B]``.

        For the query tokens ``T``, cells ``c`` with attention ``a_t(c)`` and the share ``w_c``
        of cell ``c``'s area that the box covers::

            score = sum_{t in T} sum_c w_c a_t(c)  /  sum_{t in T} sum_c a_t(c)
        """
        maps = self.maps(query, source=source)
        batch = len(maps)
        per_row = (
            isinstance(box, torch.Tensor)
            and box.dim() == 2
            or (isinstance(box, Sequence) and len(box) > 0 and isinstance(box[0], Sequence | Frame))
        )
        if per_row and len(box) != batch:
            raise ValueError(f"got {len(box)} boxes for {batch} rows")
        scores = []
        for b, row in enumerate(maps):
            self._check_index(b, image)
            scores.append(box_share(row[image], box[b] if per_row else box))
        return torch.tensor(scores)

    # --- answers and mentions -----------------------------------------------------------------
    def answer_ids(self, row: int = 0) -> torch.Tensor:
        """Row ``row``'s answer tokens, trimmed at its first end-of-sequence or padding token."""
        return self.inputs["input_ids"][row][self.is_answer[row]]

    def answer_text(self, row: int = 0) -> str:
        """Row ``row``'s trimmed answer, decoded (special tokens skipped)."""
        tok = tokenizer_of(self.processor)
        return tok.decode(self.answer_ids(row).tolist(), skip_special_tokens=True)

    def mentions(
        self,
        *,
        source: str | None = None,
        objects: Sequence[str] | None = None,
        within: str | None = None,
    ) -> list[list[Mention]]:
        """Per row, the mentions of the answer (or of the prompt's instruction, the text after
        the image): each ``objects`` name's spans, or, without a vocabulary, every token that
        decodes to a content word (longer than two letters, not a stop word).

        ``within`` narrows the search to a phrase's last occurrence (for example the user's
        question inside the chat template); where it is not found, the whole source is used.
        """
        if self.processor is None:
            raise ValueError("mentions need processor= (to decode tokens)")
        source = self._source(source)
        region = self.is_answer if source == "answer" else self._instruction
        ids = self.inputs["input_ids"]
        out = []
        for b in range(ids.shape[0]):
            where = region[b]
            if within is not None:
                try:
                    where = where & self._resolve(within, source, only=b)[b]
                except ValueError:
                    pass  # not found: the whole source
            positions = torch.nonzero(where).flatten().tolist()
            found = find_mentions(ids[b, positions].tolist(), self.processor, objects)
            out.append(
                [Mention(text, tuple(positions[i] for i in idx), b, source) for text, idx in found]
            )
        return out


def _only(mask: torch.Tensor, row: int) -> torch.Tensor:
    out = torch.zeros_like(mask)
    out[row] = mask[row]
    return out
