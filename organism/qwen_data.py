"""Data of organism-qwen: scenes at dynamic resolution, clips of moving objects, their questions,
and the real Qwen2.5-VL processor that turns them into model inputs.

- **Images** are organism scenes (``scenes.generate_scene``) drawn at 196-280 px and cropped to
  a rectangle that keeps every object whole, with sides that are multiples of 28 px (one merged
  token), so that grids differ in size and aspect ratio and no resampling blurs the labels.
- **Clips** are :mod:`.clips`' moving objects, asked about time ("which object appears first",
  "at the end of the video, is there a red_circle?").
- The vocabulary, tokenizer, processor and config are :mod:`.vocab`'s Qwen section: the
  organisms' words plus the ChatML and vision markers of Qwen and the words of the video questions.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image

from .clips import CLIP_SIZE, FRAMES, GROUPS, TEMPORAL, Clip
from .questions import IGNORE, QA, named_objects, presence_qa, relation_qa, two_hop_qa
from .scenes import CATEGORIES, RELATIONS, Scene, generate_scene
from .vocab import (
    IM_END,
    IMAGE_PAD,
    IMAGE_PLACEHOLDER,
    QWEN_ID,
    QWEN_VOCAB,
    TOKEN,
    VIDEO_PAD,
    VIDEO_PLACEHOLDER,
    VISION_END,
    words,
)

FPS = 2.0  # a clip's frame rate (qwen-vl-utils' default sampling): temporal patches 1 s apart
IMAGE_SIDES = (196, 224, 252, 280)  # px per side of the square scene an image is cropped from
MIN_SIDE = 140  # px: the shortest side of a cropped image

CATEGORY_TOKENS = frozenset(QWEN_ID[c] for c in CATEGORIES)
TIME_WORDS = frozenset(QWEN_ID[w] for w in ("start", "end"))  # the start / end questions


TRAIN_SEED_BASE = 30_000_000
HELDOUT_SEED_BASE = 9_300_000  # held-out images and clips; training seeds never reach here


# ---- images at dynamic resolution ------------------------------------------------------------


@dataclass
class CroppedScene:
    """An organism scene cropped to ``box`` = (x0, y0, width, height) px; every object whole."""

    scene: Scene
    box: tuple[int, int, int, int]

    @property
    def seed(self) -> int:
        return self.scene.seed

    @property
    def categories(self) -> list[int]:
        return self.scene.categories

    def image(self) -> np.ndarray:
        x0, y0, w, h = self.box
        return self.scene.image()[y0 : y0 + h, x0 : x0 + w]

    def masks(self) -> list[np.ndarray]:
        """Each object's exact mask in the crop, `[H, W]` bool."""
        x0, y0, w, h = self.box
        return [o.mask(self.scene.size)[y0 : y0 + h, x0 : x0 + w] for o in self.scene.objects]

    def object_boxes(self) -> list[tuple[int, int, int, int]]:
        """Each object's tight COCO box `[x, y, w, h]` in the crop's pixels."""
        x0, y0, _, _ = self.box
        return [
            (bx - x0, by - y0, bw, bh)
            for bx, by, bw, bh in (o.box(self.scene.size) for o in self.scene.objects)
        ]


def cropped_scene(seed: int) -> CroppedScene:
    """Deterministic image for `seed`: a square scene of one of :data:`IMAGE_SIDES`, cropped to a
    random rectangle (sides multiples of 28 px, at least 140 px) that keeps every object whole."""
    rng = np.random.default_rng([seed, 28])
    side = int(rng.choice(IMAGE_SIDES))
    scene = generate_scene(seed, size=side)
    lo = np.array(
        [min(o.cx - o.radius for o in scene.objects), min(o.cy - o.radius for o in scene.objects)]
    )
    hi = np.array(
        [max(o.cx + o.radius for o in scene.objects), max(o.cy + o.radius for o in scene.objects)]
    )
    lo, hi = np.floor(lo) - 1, np.ceil(hi) + 1
    box = []
    for axis in range(2):
        need = hi[axis] - lo[axis]
        sizes = [s for s in range(MIN_SIDE, side + 1, TOKEN) if s >= need]
        size = int(rng.choice(sizes)) if sizes else side
        first = max(0, int(hi[axis]) - size)
        last = min(int(lo[axis]), side - size)
        box.append((int(rng.integers(first, last + 1)) if last >= first else 0, size))
    (x0, w), (y0, h) = box
    return CroppedScene(scene, (x0, y0, w, h))


def token_labels(
    masks: list[np.ndarray], categories: list[int], shape: tuple[int, int]
) -> np.ndarray:
    """Category label (1 + index, 0 = background) of each merged token `[rows * cols]` in raster
    order: the object covering most of the token's 28 x 28 pixels, if it covers at least a
    quarter of them."""
    rows, cols = shape
    best = np.zeros(rows * cols, dtype=np.int64)
    cover = np.full(rows * cols, TOKEN * TOKEN / 4)
    for mask, cat in zip(masks, categories, strict=True):
        share = mask[: rows * TOKEN, : cols * TOKEN].reshape(rows, TOKEN, cols, TOKEN).sum((1, 3))
        share = share.reshape(-1).astype(np.float64)
        win = share >= cover
        best[win], cover[win] = cat + 1, share[win]
    return best


# ---- questions --------------------------------------------------------------------------------


# the category comes last, after the time word, as in the category-last form ("start
# red_circle yes"): a category before the time word would have to answer at a token that cannot
# yet tell a start question from an end one
def end_question(category: str) -> str:
    return f"At the end of the video, is there a {category}?"


def start_question(category: str) -> str:
    return f"At the start of the video, is there a {category}?"


FIRST_QUESTION = "Which object appears first in the video?"
VIDEO_CAPTION_PROMPT = "Describe the video."


def video_caption(clip: Clip) -> str:
    """The objects in the order they appear: `red_circle , blue_square`."""
    return " , ".join(CATEGORIES[t.category] for t in sorted(clip.tracks, key=lambda t: t.start))


VIDEO_MIX = {"first": 0.15, "end": 0.3, "start": 0.35, "caption": 0.2}


def video_qa(
    clip: Clip, rng: np.random.Generator, kind: str | None = None, mix: dict | None = None
) -> QA:
    """A question that needs time: which object appears first, whether an object is there at
    the start / end (half yes; a no names an object of the clip that is off screen then, or,
    one time in four, a category the clip never shows), or a caption that names the objects in
    the order they appear. Without `kind`, one is drawn with the weights of `mix` (default
    :data:`VIDEO_MIX`)."""
    mix = mix or VIDEO_MIX
    kind = kind or str(rng.choice(list(mix), p=np.array(list(mix.values())) / sum(mix.values())))
    if kind == "caption":
        return QA("caption", VIDEO_CAPTION_PROMPT, video_caption(clip), _short("describe"), ())
    if kind == "first":
        first = clip.first()
        return QA(
            "first",
            FIRST_QUESTION,
            CATEGORIES[first.category],
            _short("first"),
            (clip.tracks.index(first),),
        )
    on = [t for t in clip.tracks if (t.stop == GROUPS if kind == "end" else t.start == 0)]
    off = [t for t in clip.tracks if t not in on]
    positive = bool(rng.random() < 0.5) and bool(on)
    if positive:
        name = CATEGORIES[int(rng.choice([t.category for t in on]))]
    elif off and rng.random() < 0.75:
        name = CATEGORIES[int(rng.choice([t.category for t in off]))]
    else:
        name = CATEGORIES[
            int(rng.choice([c for c in range(len(CATEGORIES)) if c not in clip.categories]))
        ]
    question = end_question(name) if kind == "end" else start_question(name)
    return QA(kind, question, "yes" if positive else "no", _short(f"{kind} {name}"))


IMAGE_KINDS = ("presence", "relation", "twohop")


def image_qa(scene: CroppedScene, rng: np.random.Generator, mix: dict[str, float]) -> QA:
    """A presence, relation or two-hop question about an image (`mix` weighs the kinds of
    :data:`IMAGE_KINDS`); a presence question where the scene has no pair the kind drawn needs."""
    kinds = [k for k in IMAGE_KINDS if mix.get(k)]
    weights = np.array([mix[k] for k in kinds])
    kind = str(rng.choice(kinds, p=weights / weights.sum()))
    if kind != "presence":
        qa = (relation_qa if kind == "relation" else two_hop_qa)(scene.scene, rng)
        if qa is not None:
            return qa
    return presence_qa(scene.scene, rng)


def presence_pair(scene: CroppedScene, rng: np.random.Generator) -> tuple[QA, QA]:
    """One yes and one no presence question about `scene` (POPE's balanced pairs)."""
    return presence_qa(scene.scene, rng, positive=True), presence_qa(
        scene.scene, rng, positive=False
    )


def _short(text: str) -> list[int]:
    return [QWEN_ID[w] for w in words(text)]


# ---- model inputs through the processor ------------------------------------------------------


@dataclass
class Row:
    """One training or evaluation row: an image or a clip, and its questions (with answers)."""

    media: CroppedScene | Clip
    qas: list[QA]

    @property
    def is_video(self) -> bool:
        return isinstance(self.media, Clip)


def media_inputs(*media: CroppedScene | Clip) -> dict:
    """What the processor takes for these media, in order: ``images=[PIL, ...]`` and
    ``videos=[frames, ...]`` with ``video_metadata`` at :data:`FPS` (keys only for the kinds
    present). Without a frame rate the processor assumes 24 fps, which puts a clip's temporal
    patches 1/12 s apart: 0.33 of M-RoPE's temporal positions, so that three of the four share
    one and the model cannot tell the start of a clip from its end."""
    out: dict[str, list] = {}
    for m in media:
        if isinstance(m, Clip):
            out.setdefault("videos", []).append(list(m.frames()))
            out.setdefault("video_metadata", []).append(clip_metadata())
        else:
            out.setdefault("images", []).append(Image.fromarray(m.image()))
    return out


def clip_metadata() -> dict:
    """A clip's video metadata: :data:`FRAMES` frames at :data:`FPS`, all of them used."""
    return {"fps": FPS, "total_num_frames": FRAMES, "frames_indices": list(range(FRAMES))}


def chat_text(processor, is_video: bool, question: str, answer: str | None = None) -> str:
    """The chat prompt for one question (and its answer turn when given), as the template
    writes it."""
    item = {"type": "video"} if is_video else {"type": "image"}
    messages = [{"role": "user", "content": [item, {"type": "text", "text": question}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return text if answer is None else text + answer + "<|im_end|>"


def _find_last(ids: list[int], token: int) -> int:
    return len(ids) - 1 - ids[::-1].index(token)


def encode_row(
    processor, row: Row, form: str, query_labels: bool = False, targets: bool = False
) -> dict:
    """Processor outputs of one row plus its labels `[L]` (IGNORE except the answers).

    `form` "cat_last" packs every question in its short form after the visual tokens, each answer
    right after its question (`<|vision_start|>...<|vision_end|> is there a red_circle yes ...`);
    "chat" writes the row's one question with the chat template. With `query_labels`, a chat row's
    answer is also the target at the question's last category token (or "first"), where the
    category-last form answers. With `targets`, the row also carries the circuits' targets
    (:func:`circuit_targets`) and, with `query_labels`, a chat row's `copy_targets` (the position
    that answers, that category token) for `losses.copy_loss`."""
    placeholder = VIDEO_PLACEHOLDER if row.is_video else IMAGE_PLACEHOLDER
    if form == "cat_last":
        text = placeholder + "".join(
            " " + " ".join(QWEN_VOCAB[i] for i in qa.short) + " " + qa.answer for qa in row.qas
        )
    else:
        (qa,) = row.qas
        text = chat_text(processor, row.is_video, qa.question, qa.answer)
    out = processor(text=[text], return_tensors="pt", **media_inputs(row.media))
    ids = out["input_ids"][0].tolist()
    labels = [IGNORE] * len(ids)
    spans = []  # (first token, tokens) of each question
    copies = []  # (answering position, the question's last category token) of a chat row
    if form == "cat_last":
        end = len(ids)
        for qa in reversed(row.qas):  # from the end backwards: answer, then its question
            n = len(words(qa.answer))
            labels[end - n : end] = ids[end - n : end]
            end -= n + len(qa.short)
            spans.insert(0, (end, qa.short))
    else:
        n = len(words(qa.answer)) + 1  # the answer and <|im_end|>
        labels[-n:] = ids[-n:]
        anchor = _anchor_token(qa)
        if query_labels and anchor is not None:
            at = _find_last(ids[: -n - 1], anchor)
            labels[at + 1] = ids[-n]
            copies.append((len(ids) - n - 1, at))
        start = _find_last(ids, VISION_END) + 1
        spans.append((start, ids[start : ids.index(IM_END, start)]))
    out["labels"] = torch.tensor([labels])
    if targets:
        out.update(circuit_targets(row, spans))
        out["copy_targets"] = torch.tensor(copies, dtype=torch.float32).reshape(-1, 2)
        if form == "cat_last":  # each question answers at its last word
            answering = [start + len(tokens) - 1 for start, tokens in spans]
            reading = answering
        else:  # where the category-last form answers (see `query_labels`)
            anchor = _anchor_token(qa)
            answering = [-1 if anchor is None else _find_last(ids[: -n - 1], anchor)]
            reading = [len(ids) - n - 1]  # the chat answer's own position reads the hop-2 object
        first = ids.index(VIDEO_PAD if row.is_video else IMAGE_PAD)
        out.update(hop_targets(row, spans, reading, first))
        out.update(look_targets(row, spans, first))
        out.update(gather_targets(row, spans, None if form == "cat_last" else reading[0]))
    return out


MAX_TOKENS = (max(IMAGE_SIDES) // TOKEN) ** 2  # merged tokens of the largest image


def hop_targets(
    row: Row, spans: list[tuple[int, list[int]]], answering: list[int], first: int
) -> dict[str, torch.Tensor]:
    """The two-hop circuit's targets of an image row (``losses.hop_loss``'s layout): for each
    two-hop question (`spans` as in :func:`circuit_targets`, answered at the positions of
    `answering`), `hop_targets` (answering position, anchor position, the anchor's centre x, y
    in :func:`circuit_targets`' units, relation index, first image token `first`) and
    `hop_masks` (`[MAX_TOKENS]`: 1 on the merged tokens the hop-2 object covers an eighth of, in
    raster order, 0 beyond the image's tokens)."""
    hops, masks = [], []
    if not row.is_video:
        x0, y0, w, h = row.media.box
        half = max(IMAGE_SIDES) / TOKEN / 2
        objects = row.media.scene.objects
        crop_masks = row.media.masks()
        for qa, (start, tokens), q in zip(row.qas, spans, answering, strict=True):
            if qa.kind != "twohop":
                continue
            (anchor_pos, anchor), target = named_objects(start, tokens, qa)[0], qa.objects[1]
            a = objects[anchor]
            centre = ((a.cx - x0) / TOKEN / half - 1, (a.cy - y0) / TOKEN / half - 1)
            hops.append((q, anchor_pos, *centre, RELATIONS.index(qa.relation), first))
            masks.append(_covered(crop_masks[target], (h // TOKEN, w // TOKEN)))
    return {
        "hop_targets": torch.tensor(hops, dtype=torch.float32).reshape(-1, 6),
        "hop_masks": torch.tensor(np.array(masks), dtype=torch.float32).reshape(-1, MAX_TOKENS),
    }


def look_targets(
    row: Row, spans: list[tuple[int, list[int]]], first: int
) -> dict[str, torch.Tensor]:
    """The lookup a hybrid decoder's first full-attention layer does (``losses.look_loss``):
    for each image question that names a present object (a positive presence question's
    category, a two-hop question's anchor), `look_targets` (that category token's position,
    first image token) and `look_masks` (`[MAX_TOKENS]`: the merged tokens of that object, as in
    :func:`hop_targets`; a scene holds each category once). `spans` as in
    :func:`circuit_targets`."""
    looks, masks = [], []
    if not row.is_video:
        _, _, w, h = row.media.box
        crop_masks = row.media.masks()
        for qa, (start, tokens) in zip(row.qas, spans, strict=True):
            named = named_objects(start, tokens, qa)
            if qa.kind not in ("presence", "twohop") or not named:
                continue
            position, index = named[0]
            looks.append((position, first))
            masks.append(_covered(crop_masks[index], (h // TOKEN, w // TOKEN)))
    return {
        "look_targets": torch.tensor(looks, dtype=torch.float32).reshape(-1, 2),
        "look_masks": torch.tensor(np.array(masks), dtype=torch.float32).reshape(-1, MAX_TOKENS),
    }


CLIP_TOKENS = GROUPS * (CLIP_SIZE // TOKEN) ** 2  # merged tokens of a clip


def gather_targets(
    row: Row, spans: list[tuple[int, list[int]]], chat_answer: int | None
) -> dict[str, torch.Tensor]:
    """The gather a hybrid decoder's last full-attention layer does for a start / end question
    about a clip that shows the object it names (``qwen_train.gather_terms``): from the position
    that answers (the category token in the category-last form, `chat_answer` in a chat row),
    one head puts its mass on that object's tokens in every temporal patch, and after that
    layer the position holds the patches the object is on screen in.
    `gather_targets`: (answering position, the category token's position, category index, 0
    for "start" or 1 for "end", then 1 or 0 per temporal patch); `gather_masks`
    (`[CLIP_TOKENS]`: 1 on the object's merged tokens, patch by patch as the clip's tokens
    run)."""
    gathers, masks = [], []
    if row.is_video:
        side = CLIP_SIZE // TOKEN
        groups = [row.media.group_masks(g) for g in range(GROUPS)]
        for start, tokens in spans:
            if TIME_WORDS.isdisjoint(tokens):
                continue
            word = int(QWEN_ID["end"] in tokens)
            for i, tok in enumerate(tokens):
                if tok not in CATEGORY_TOKENS:
                    continue
                category = CATEGORIES.index(QWEN_VOCAB[tok])
                if category not in row.media.categories:
                    continue  # nothing to gather: the answer is "no" from the lookup alone
                k = row.media.categories.index(category)
                track = row.media.tracks[k]
                on = [float(track.visible(g * TEMPORAL)) for g in range(GROUPS)]
                cover = [_covered(groups[g][k], (side, side))[: side * side] for g in range(GROUPS)]
                mask = np.concatenate([c * v for c, v in zip(cover, on, strict=True)])
                q = start + i if chat_answer is None else chat_answer
                gathers.append((q, start + i, category, word, *on))
                masks.append(mask)
    return {
        "gather_targets": torch.tensor(gathers, dtype=torch.float32).reshape(-1, 4 + GROUPS),
        "gather_masks": torch.tensor(np.array(masks), dtype=torch.float32).reshape(-1, CLIP_TOKENS),
    }


def _covered(mask: np.ndarray, shape: tuple[int, int]) -> np.ndarray:
    """`[MAX_TOKENS]` 1 where the object of `mask` covers an eighth of a merged token, raster
    order over a `shape` = (rows, cols) grid; the most covered token where none reaches that."""
    rows, cols = shape
    share = mask[: rows * TOKEN, : cols * TOKEN].reshape(rows, TOKEN, cols, TOKEN).sum((1, 3))
    share = share.reshape(-1)
    out = np.zeros(MAX_TOKENS, dtype=np.float32)
    hit = share >= TOKEN * TOKEN / 8
    out[: rows * cols] = hit if hit.any() else share == share.max()
    return out


def circuit_targets(row: Row, spans: list[tuple[int, list[int]]]) -> dict[str, torch.Tensor]:
    """The relation circuit's targets (`losses.relation_loss`) of an image row whose questions
    start at the token positions and have the tokens of `spans`:
    - `place_targets` (position, x, y) for each category token that names an object: its
      centre in merged tokens from the crop's top left, scaled so that the widest crop (10
      tokens) spans [-1, 1], since the LM sees a token's place as its M-RoPE row and column, in
      tokens, whatever the crop's size;
    - `relation_targets` (second category position, first category position, the first
      object's x, y, index of the relation in RELATIONS) for each relation question;
    - `grid_targets` (x, y) of each image token's own centre, in the same units, in raster
      order.
    A clip row has instead `seen_targets` (position, then 1 or 0 for each temporal patch) for
    each category token of a start / end question: the patches its object is on screen in, none
    for a category the clip does not show."""
    places, relations, grid, seen = [], [], [], []
    if row.is_video:
        for start, tokens in spans:
            if TIME_WORDS.isdisjoint(tokens):
                continue
            for i, tok in enumerate(tokens):
                if tok in CATEGORY_TOKENS:
                    shown = [t for t in row.media.tracks if QWEN_ID[CATEGORIES[t.category]] == tok]
                    on = [any(t.visible(g * TEMPORAL) for t in shown) for g in range(GROUPS)]
                    seen.append((start + i, *map(float, on)))
    else:
        x0, y0, w, h = row.media.box
        half = max(IMAGE_SIDES) / TOKEN / 2
        grid = [
            ((c + 0.5) / half - 1, (r + 0.5) / half - 1)
            for r in range(h // TOKEN)
            for c in range(w // TOKEN)
        ]
        objects = row.media.scene.objects
        centre = [((o.cx - x0) / TOKEN / half - 1, (o.cy - y0) / TOKEN / half - 1) for o in objects]
        for qa, (start, tokens) in zip(row.qas, spans, strict=True):
            named = named_objects(start, tokens, qa)
            places += [(pos, *centre[obj]) for pos, obj in named]
            if qa.kind == "relation" and len(named) == 2:
                (first, obj), (second, _) = named
                relations.append((second, first, *centre[obj], RELATIONS.index(qa.relation)))
    return {
        "place_targets": torch.tensor(places, dtype=torch.float32).reshape(-1, 3),
        "relation_targets": torch.tensor(relations, dtype=torch.float32).reshape(-1, 5),
        "grid_targets": torch.tensor(grid, dtype=torch.float32).reshape(-1, 2),
        "seen_targets": torch.tensor(seen, dtype=torch.float32).reshape(-1, 1 + GROUPS),
    }


def _anchor_token(qa: QA) -> int | None:
    """The question token the category-last form answers at: a two-hop question's last word (a
    shape word may follow its last category), else the last category token (or "first")."""
    if qa.kind == "twohop":
        return qa.short[-1]
    cats = [t for t in qa.short if t in CATEGORY_TOKENS or t == QWEN_ID["first"]]
    return cats[-1] if cats else None


def collate(encoded: list[dict], pad: int) -> dict:
    """Right-padded batch of :func:`encode_row` outputs: every per-token tensor padded (ids with
    `pad`, labels with IGNORE, the mask and the modality types with 0), every per-image or
    per-video tensor (pixels, grids, seconds per temporal patch) concatenated, and the rows'
    circuit targets concatenated with their row index first."""
    width = max(e["input_ids"].shape[1] for e in encoded)
    fill = {"input_ids": pad, "labels": IGNORE, "attention_mask": 0, "mm_token_type_ids": 0}
    batch = {}
    for key, value in fill.items():
        rows = [e[key][0] for e in encoded]
        out = torch.full((len(rows), width), value, dtype=rows[0].dtype)
        for i, row in enumerate(rows):
            out[i, : len(row)] = row
        batch[key] = out
    for key in encoded[0].keys() | set().union(*(e.keys() for e in encoded)):
        if key.endswith("_targets"):  # per-row targets gain their row index
            batch[key] = torch.cat(
                [
                    torch.cat([torch.full((len(e[key]), 1), float(row)), e[key]], 1)
                    for row, e in enumerate(encoded)
                ]
            )
        elif key not in fill:
            batch[key] = torch.cat([e[key] for e in encoded if key in e])
    return batch


def vision_labels(media: CroppedScene | Clip) -> np.ndarray:
    """Category label of every merged token the model sees for `media`, in the tower's order
    (temporal patches, then rows, then columns)."""
    if isinstance(media, Clip):
        rows = cols = CLIP_SIZE // TOKEN
        return np.concatenate(
            [
                token_labels(media.group_masks(g), media.categories, (rows, cols))
                for g in range(GROUPS)
            ]
        )
    _, _, w, h = media.box
    return token_labels(media.masks(), media.categories, (h // TOKEN, w // TOKEN))
