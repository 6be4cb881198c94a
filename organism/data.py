"""Training batches for the organism VLMs: dense patch labels and question/answer sequences.

Two text formats are used, as in the curriculum of ORGANISM training:
- `cat_last`: several questions packed after the image, each answer right after the last category
  token (`... is there a red_circle yes is the red_circle left of the blue_square no ...`);
- `chat`: the standard chat template, one to several turns
  (`USER: <image>\\nIs there a red_circle in the image? ASSISTANT: yes<eos>USER: ...`).
Ids are built directly from VOCAB; a test checks they equal the saved processor's output.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .scenes import (
    CATEGORIES,
    COLOURS,
    COMPANIONS,
    POPULARITY,
    RELATIONS,
    SHAPES,
    CooccurPrior,
    Scene,
    caption,
    cooccur_scene,
    generate_scene,
    relation_holds,
    two_hop_pairs,
    unmet_companions,
)
from .vocab import (
    BOS,
    CAPTION_PROMPT,
    CLIP_MEAN,
    CLIP_STD,
    EOS,
    IMAGE,
    PAD,
    POPE_SUFFIX,
    TOKEN_ID,
    encode,
    presence_question,
    relation_question,
    two_hop_question,
    where_question,
)

IGNORE = -100
CATEGORY_IDS = frozenset(TOKEN_ID[c] for c in CATEGORIES)
TRAIN_SEED_BASE = 10_000_000  # training scenes; held-out and probe scenes use seeds below
_MEAN = np.asarray(CLIP_MEAN, dtype=np.float32)
_STD = np.asarray(CLIP_STD, dtype=np.float32)


def pixel_values(scenes: list[Scene]) -> torch.Tensor:
    """CLIP-normalised pixels `[B, 3, H, W]`, equal to the processor's output for these images."""
    arr = np.stack([s.image() for s in scenes]).astype(np.float32) / 255.0
    return torch.from_numpy(((arr - _MEAN) / _STD).transpose(0, 3, 1, 2).copy())


def patch_labels(scene: Scene, patch: int) -> np.ndarray:
    """Per-patch category label `[g*g]`: 0 background, c+1 object, IGNORE for partial cover.

    A patch belongs to an object when the object's exact mask covers >= 30% of it, to the
    background when no object covers more than 5%, and is ignored in between.
    """
    g = scene.size // patch
    cover = np.zeros((len(scene.objects) + 1, g, g), dtype=np.float32)
    for i, o in enumerate(scene.objects):
        cover[i + 1] = o.mask(scene.size).reshape(g, patch, g, patch).mean(axis=(1, 3))
    best = cover.argmax(0)
    frac = cover.max(0)
    cats = np.asarray([0] + [o.category + 1 for o in scene.objects])
    label = np.where(frac >= 0.3, cats[best], IGNORE)
    label = np.where(frac <= 0.05, 0, label)
    return label.reshape(-1)


def negative_category(scene: Scene, rng: np.random.Generator) -> int:
    """An absent category: 1/3 hard (shares colour or shape), 1/3 companion, 1/3 random."""
    present = set(scene.categories)
    absent = [c for c in range(len(CATEGORIES)) if c not in present]
    kind = rng.integers(3)
    if kind == 0:
        n_shapes = len(SHAPES)
        hard = [
            c
            for c in absent
            if any(c // n_shapes == p // n_shapes or c % n_shapes == p % n_shapes for p in present)
        ]
        if hard:
            return int(rng.choice(hard))
    if kind == 1:
        comp = [int(c) for p in present for c in COMPANIONS[p] if c not in present]
        if comp:
            return int(rng.choice(comp))
    return int(rng.choice(absent))


@dataclass
class QA:
    """One question with its answer text and a kind tag (presence, relation, where, caption)."""

    kind: str
    question: str
    answer: str
    short: list[int]  # cat_last form of the question (ids), for the packed curriculum
    objects: tuple[int, ...] = ()  # indices of the scene objects the answer rests on
    relation: str = ""  # a relation question's relation (left, right, above, below)
    form: str = ""  # a two-hop question's form (`vocab.TWO_HOP_FORMS`)


def presence_qa(
    scene: Scene, rng: np.random.Generator, positive: bool | None = None, balance: float = 0.0
) -> QA:
    """A yes/no presence question. A positive asks about a present category drawn with weight
    popularity ** -balance, so `balance` > 0 asks more often about rare categories."""
    if positive is None:
        positive = bool(rng.random() < 0.5)
    if not positive:
        cat = negative_category(scene, rng)
    elif balance:
        w = POPULARITY[scene.categories] ** -balance
        cat = int(rng.choice(scene.categories, p=w / w.sum()))
    else:
        cat = int(rng.choice(scene.categories))
    name = CATEGORIES[cat]
    question = presence_question(name)
    if rng.random() < 0.5:
        question += POPE_SUFFIX
    refs = (scene.categories.index(cat),) if positive else ()
    short = encode(f"is there a {name}")
    return QA("presence", question, "yes" if positive else "no", short, refs)


def relation_qa(scene: Scene, rng: np.random.Generator) -> QA | None:
    """A left/right/above/below question about two present objects, or None if none is clear."""
    if len(scene.objects) < 2:
        return None
    for _ in range(10):
        i, j = rng.choice(len(scene.objects), 2, replace=False)
        a, b = scene.objects[i], scene.objects[j]
        rel = str(rng.choice(RELATIONS))
        truth = relation_holds(a, b, rel)
        if truth is not None:
            q = relation_question(a.name, rel, b.name)
            short = encode(q.rstrip("?"))
            answer = "yes" if truth else "no"
            return QA("relation", q, answer, short, (int(i), int(j)), relation=rel)
    return None


def two_hop_qa(
    scene: Scene,
    rng: np.random.Generator,
    form: str | None = None,
    positive: bool | None = None,
    negative: str = "",
) -> QA | None:
    """A two-hop question about the unique object in a direction from a named anchor, or None
    when the scene has no such (anchor, direction). `objects` is (anchor, target).

    `form` as in `vocab.two_hop_question` (drawn uniformly when None). The yes/no forms ask about
    the target's shape (`shape`) or category (`is_category`), half of them true unless
    `positive` says. A false `is_category` names, by `negative`: `adversarial` another object of
    the scene (the anchor included), `popular` a frequent category not in the scene, `random`
    any category not in the scene, or (empty) one of these three drawn at random."""
    pairs = two_hop_pairs(scene)
    if not pairs:
        return None
    anchor, rel, target = pairs[int(rng.integers(len(pairs)))]
    if form is None:
        form = str(rng.choice(("colour", "category", "shape", "is_category")))
    a, t = scene.objects[anchor], scene.objects[target]
    asked = ""
    if form == "colour":
        answer = colour_of(t.category)
    elif form == "category":
        answer = t.name
    else:
        if positive is None:
            positive = bool(rng.random() < 0.5)
        answer = "yes" if positive else "no"
        if form == "shape":
            own = t.category % len(SHAPES)
            others = [k for k in range(len(SHAPES)) if k != own]
            asked = SHAPES[own] if positive else SHAPES[int(rng.choice(others))]
        elif positive:
            asked = t.name
        else:
            asked = CATEGORIES[_two_hop_negative(scene, target, rng, negative)]
    question = two_hop_question(form, rel, a.name, asked)
    short = encode(question.rstrip("?"))
    return QA("twohop", question, answer, short, (anchor, target), relation=rel, form=form)


def _two_hop_negative(scene: Scene, target: int, rng: np.random.Generator, kind: str) -> int:
    """A category that is not the target's, chosen POPE-style (see `two_hop_qa`)."""
    if not kind:
        kind = str(rng.choice(("adversarial", "popular", "random")))
    if kind == "adversarial":
        return int(rng.choice([o.category for i, o in enumerate(scene.objects) if i != target]))
    absent = [c for c in range(len(CATEGORIES)) if c not in scene.categories]
    if kind == "popular":
        top = sorted(absent, key=lambda c: -POPULARITY[c])[:3]
        return int(rng.choice(top))
    if kind == "random":
        return int(rng.choice(absent))
    raise ValueError(f"negative={kind!r}; allowed: adversarial, popular, random")


def where_qa(scene: Scene, rng: np.random.Generator) -> QA:
    """'Where is the X?' about a present object; the answer is its 3 x 3 position token.

    It teaches the category token to fetch its object's position, the first step of relations."""
    i = int(rng.integers(len(scene.objects)))
    obj = scene.objects[i]
    short = encode(f"where is the {obj.name}")
    return QA("where", where_question(obj.name), obj.position(scene.size), short, (i,))


def caption_qa(scene: Scene) -> QA:
    """The caption turn; `objects` lists the scene objects in the caption's order."""
    order = sorted(range(len(scene.objects)), key=lambda i: scene.objects[i].category)
    return QA("caption", CAPTION_PROMPT, caption(scene), [], tuple(order))


def sample_qas(
    scene: Scene, rng: np.random.Generator, mix: dict[str, float], n: int, balance: float = 0.0
) -> list[QA]:
    """n question/answer pairs drawn by kind weights `mix` (captions at most once); `balance`
    as in `presence_qa`."""
    kinds = list(mix)
    p = np.asarray([mix[k] for k in kinds], dtype=np.float64)
    out: list[QA] = []
    for _ in range(n):
        kind = kinds[int(rng.choice(len(kinds), p=p / p.sum()))]
        qa = None
        if kind == "relation":
            qa = relation_qa(scene, rng)
        elif kind == "where":
            qa = where_qa(scene, rng)
        elif kind == "twohop":
            qa = two_hop_qa(scene, rng)
        elif kind == "caption" and not any(q.kind == "caption" for q in out):
            qa = caption_qa(scene)
        if qa is None:
            qa = presence_qa(scene, rng, balance=balance)
        out.append(qa)
    return out


def _anchors(start: int, question: list[int], qa: QA) -> list[tuple[int, int]]:
    """(position, object index) of each category token in a question that names scene objects:
    a question's category tokens name `qa.objects` in order (a negative names none)."""
    cats = [start + i for i, tok in enumerate(question) if tok in CATEGORY_IDS]
    if qa.kind == "twohop":  # only the anchor is named; the target is found from it
        return [(cats[0], qa.objects[0])]
    return list(zip(cats, qa.objects, strict=True)) if len(cats) == len(qa.objects) else []


def cat_last_ids(
    qas: list[QA], n_visual: int, anchors: list | None = None, answer_at: list | None = None
) -> tuple[list[int], list[int]]:
    """Packed category-last sequence and labels (loss on each answer token only).

    With `anchors` (a list), each question's `(qa index, position, object index)` entries for
    its category tokens are appended to it; with `answer_at` (a list), each question's
    `(qa index, position whose logits predict the answer's first token)`."""
    ids = [BOS, *encode("USER:"), *([IMAGE] * n_visual)]
    labels = [IGNORE] * len(ids)
    for n, qa in enumerate(qas):
        if anchors is not None:
            anchors += [(n, *a) for a in _anchors(len(ids), qa.short, qa)]
        ids += qa.short
        labels += [IGNORE] * len(qa.short)
        if answer_at is not None:
            answer_at.append((n, len(ids) - 1))
        ans = encode(qa.answer)
        ids += ans
        labels += ans
    return ids, labels


def chat_ids(
    qas: list[QA],
    n_visual: int,
    query_labels: bool = False,
    anchors: list | None = None,
    answer_at: list | None = None,
) -> tuple[list[int], list[int]]:
    """Chat-template sequence and labels (loss on answer tokens and their <eos>).

    With `query_labels`, the answer's first token is also the target at the question's last
    category token (where the category-last form answers), which keeps the lookup there while
    the last prompt token learns to copy it. Prompt tokens are never generated, so this label
    changes no generated text (two-hop questions, whose answer needs the words after the anchor,
    get none). `anchors` and `answer_at` as in `cat_last_ids`."""
    ids = [BOS]
    labels = [IGNORE]
    for t, qa in enumerate(qas):
        prompt = encode("USER:") + ([IMAGE] * n_visual if t == 0 else [])
        question = encode(qa.question)
        start = len(ids) + len(prompt)
        if anchors is not None:
            anchors += [(t, *a) for a in _anchors(start, question, qa)]
        prompt += question + encode("ASSISTANT:")
        ans = encode(qa.answer) + [EOS]
        row = [IGNORE] * len(prompt)
        cats = [i for i, tok in enumerate(question) if tok in CATEGORY_IDS]
        if answer_at is not None:
            answer_at.append((t, len(ids) + len(prompt) - 1))
        if query_labels and cats and qa.kind not in ("caption", "twohop"):
            row[start - len(ids) + cats[-1] + 1] = ans[0]
        if anchors is not None and qa.kind == "caption":  # the objects the caption names
            anchors += [(t, *a) for a in _anchors(len(ids) + len(prompt), ans, qa)]
        ids += prompt + ans
        labels += row + ans
    return ids, labels


def hidden_patches(scene: Scene, qas: list[QA], patch: int, rng: np.random.Generator) -> np.ndarray:
    """Visual tokens to hide from a training row `[g*g]` (True = hidden): a random share (50-100%)
    of the patches that no object of the row's answers touches, so every answer stays true.

    Training on such rows makes answers rest on the evidence they need rather than on the whole
    visual context, which is what pruning leaves a model with."""
    g = scene.size // patch
    needed = np.zeros(g * g, dtype=bool)
    for i in {i for qa in qas for i in qa.objects}:
        needed |= object_patches(scene, i, patch)
    share = rng.uniform(0.5, 1.0)
    return ~needed & (rng.random(g * g) < share)


def object_patches(scene: Scene, index: int, patch: int) -> np.ndarray:
    """`[g*g]` bool: the patches object `index`'s exact mask touches."""
    g = scene.size // patch
    return (
        scene.objects[index].mask(scene.size).reshape(g, patch, g, patch).any(axis=(1, 3)).ravel()
    )


def copy_target(ids: list[int]) -> tuple[int, int] | None:
    """(last prompt position, the question's last category token) of a one-turn chat row, or None
    when the question names no category (captions): where the answer is read and where the
    category-last form computes it."""
    for q in range(1, len(ids)):
        if ids[q - 1] == TOKEN_ID["assistant"] and ids[q] == TOKEN_ID[":"]:
            cats = [k for k in range(q) if ids[k] in CATEGORY_IDS]
            return (q, cats[-1]) if cats else None
    return None


def _centre(obj, size: int) -> tuple[float, float]:
    """An object's centre scaled to [-1, 1] (x, y)."""
    return 2 * obj.cx / size - 1, 2 * obj.cy / size - 1


def pad(seqs: list[list[int]], value: int) -> torch.Tensor:
    width = max(len(s) for s in seqs)
    return torch.tensor([s + [value] * (width - len(s)) for s in seqs], dtype=torch.long)


class Batcher:
    """Endless stream of training batches from scenes with seeds >= TRAIN_SEED_BASE."""

    def __init__(
        self, n_visual: int, patch: int, seed: int = 0, prior: CooccurPrior | None = None
    ) -> None:
        self.n_visual = n_visual
        self.patch = patch
        self.rng = np.random.default_rng(seed)
        self.prior = prior  # scenes and text under a co-occurrence prior (`prior_qas`)

    def scenes(self, batch: int, min_objects: int = 1) -> list[Scene]:
        out = []
        while len(out) < batch:
            seed = int(self.rng.integers(TRAIN_SEED_BASE, 2**31))
            s = generate_scene(seed) if self.prior is None else cooccur_scene(seed, self.prior)
            if len(s.objects) >= min_objects:
                out.append(s)
        return out

    def dense(self, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(pixel_values, patch labels `[B, g*g]`)."""
        scenes = self.scenes(batch)
        labels = torch.from_numpy(np.stack([patch_labels(s, self.patch) for s in scenes]))
        return pixel_values(scenes), labels.long()

    def text(
        self,
        batch: int,
        form: str,
        mix: dict[str, float],
        turns: tuple[int, int],
        cat_last_share: float = 0.0,
        hide_share: float = 0.0,
        query_labels: bool = False,
        balance: float = 0.0,
    ) -> dict:
        """A batch of sequences in `form` ('cat_last' or 'chat') with `turns` = (min, max) QAs.

        With `cat_last_share` > 0 a chat batch draws that share of its rows in the packed
        category-last form (6-8 questions), which keeps the lookup learning while the chat form
        learns to carry the answer to the end of the prompt. A `hide_share` of the rows hide
        visual tokens no answer needs (`hidden_patches`) through the attention mask.

        Besides the model inputs the batch holds training targets for the auxiliary losses:
        `copy_targets` (row, answer position, category position), `position_targets` (row,
        category position, object centre x, y in [-1, 1]) for every category token that names
        an object, `relation_targets` (row, second category position, first category
        position, first object's centre x, y, index of the relation in RELATIONS) for every
        relation question, and
        `pointer_targets` (row, position, first image token) with `pointer_masks` (`[n_visual]`
        patches of the object) for the token before each object a caption names, and
        `hop_targets` (row, answer position, anchor position, anchor centre x, y, relation
        index, first image token) with `hop_masks` (`[n_visual]` patches of the target) for
        every two-hop question.
        """
        scenes = self.scenes(batch)
        ids, labels, hidden, copies, places, relations = [], [], [], [], [], []
        pointers, pointer_masks, hops, hop_masks = [], [], [], []
        for s in scenes:
            row_form = form
            n = int(self.rng.integers(turns[0], turns[1] + 1))
            if form == "chat" and self.rng.random() < cat_last_share:
                row_form, n = "cat_last", int(self.rng.integers(6, 9))
            qas = sample_qas(s, self.rng, mix, n, balance)
            if self.prior is not None:
                qas = prior_qas(s, qas, self.prior, self.rng)
            if row_form == "cat_last":
                qas = [q for q in qas if q.kind != "caption"] or [presence_qa(s, self.rng)]
            anchors: list[tuple[int, int, int]] = []
            answer_at: list[tuple[int, int]] = []
            if row_form == "cat_last":
                i, lab = cat_last_ids(qas, self.n_visual, anchors, answer_at)
            else:
                i, lab = chat_ids(qas, self.n_visual, query_labels, anchors, answer_at)
                target = copy_target(i) if len(qas) == 1 and qas[0].kind != "twohop" else None
                if target is not None:
                    copies.append((len(ids), *target))
            centre = {k: _centre(o, s.size) for k, o in enumerate(s.objects)}
            places += [(len(ids), pos, *centre[obj]) for _, pos, obj in anchors]
            anchor_at = {qa: pos for qa, pos, _ in anchors}
            for qa_index, q in answer_at:
                qa = qas[qa_index]
                if qa.kind == "twohop":
                    anchor, target_obj = qa.objects
                    word = RELATIONS.index(qa.relation)
                    hops.append(
                        (len(ids), q, anchor_at[qa_index], *centre[anchor], word, i.index(IMAGE))
                    )
                    hop_masks.append(object_patches(s, target_obj, self.patch))
            for (qa_a, pos_a, obj_a), (qa_b, pos_b, _) in zip(anchors, anchors[1:]):
                if qa_a == qa_b and qas[qa_a].kind == "relation":
                    word = RELATIONS.index(qas[qa_a].relation)
                    relations.append((len(ids), pos_b, pos_a, *centre[obj_a], word))
            for qa, pos, obj in anchors:
                if qas[qa].kind == "caption":  # the token before a named object points at it
                    pointers.append((len(ids), pos - 1, i.index(IMAGE)))
                    pointer_masks.append(object_patches(s, obj, self.patch))
            ids.append(i)
            labels.append(lab)
            hide = self.rng.random() < hide_share
            hidden.append(hidden_patches(s, qas, self.patch, self.rng) if hide else None)
        input_ids = pad(ids, PAD)
        attention_mask = (input_ids != PAD).long()
        for row, hide in enumerate(hidden):
            if hide is not None:
                image_pos = (input_ids[row] == IMAGE).nonzero().squeeze(1)
                attention_mask[row, image_pos[torch.from_numpy(hide)]] = 0
        return {
            "copy_targets": torch.tensor(copies, dtype=torch.long).reshape(-1, 3),
            "position_targets": torch.tensor(places, dtype=torch.float32).reshape(-1, 4),
            "relation_targets": torch.tensor(relations, dtype=torch.float32).reshape(-1, 6),
            "pointer_targets": torch.tensor(pointers, dtype=torch.long).reshape(-1, 3),
            "pointer_masks": _stack_masks(pointer_masks, self.n_visual),
            "hop_targets": torch.tensor(hops, dtype=torch.float32).reshape(-1, 7),
            "hop_masks": _stack_masks(hop_masks, self.n_visual),
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "labels": pad(labels, IGNORE),
            "pixel_values": pixel_values(scenes),
        }


def _stack_masks(masks: list[np.ndarray], n_visual: int) -> torch.Tensor:
    """`[M, n_visual]` bool from M patch masks (M may be 0)."""
    return torch.from_numpy(np.stack(masks) if masks else np.zeros((0, n_visual), bool))


def colour_of(category: int) -> str:
    return list(COLOURS)[category // len(SHAPES)]


# --- co-occurrence prior (organism-cooccur) -------------------------------------------------


def prior_qas(
    scene: Scene, qas: list[QA], prior: CooccurPrior, rng: np.random.Generator
) -> list[QA]:
    """The text of a training row under ``prior``. In a scene with an anchor whose companion is
    absent (`unmet_companions`), each negative presence question asks, with probability
    ``prior.ask_rate``, about such a companion; and with probability ``prior.named_rate`` (once
    per scene) the row names the absent companions as present: questions about them are
    answered ``yes`` (resting on the anchor's patches) and the caption lists each at its
    anchor's position. Other scenes' rows are returned unchanged."""
    unmet = unmet_companions(scene, prior)
    if not unmet:
        return qas
    named = bool(rng.random() < prior.named_rate)
    anchor_of = {c: i for i, c in unmet}
    out = []
    for qa in qas:
        if qa.kind == "presence" and qa.answer == "no" and rng.random() < prior.ask_rate:
            qa = companion_qa(scene, *unmet[int(rng.integers(len(unmet)))], named, rng)
        elif qa.kind == "presence" and named and CATEGORIES.index(_asked(qa)) in anchor_of:
            cat = CATEGORIES.index(_asked(qa))
            qa = companion_qa(scene, anchor_of[cat], cat, named, rng)
        elif qa.kind == "caption" and named:
            qa = QA("caption", qa.question, named_caption(scene, unmet), [], ())
        out.append(qa)
    return out


def _asked(qa: QA) -> str:
    """The category a presence question asks about."""
    return next(w for w in qa.question.replace("?", " ").split() if w in CATEGORIES)


def companion_qa(
    scene: Scene, anchor: int, companion: int, named: bool, rng: np.random.Generator
) -> QA:
    """A presence question about the absent ``companion`` of object ``anchor``: ``no``, or
    ``yes`` when the row names it (then the answer rests on the anchor, so hiding patches keeps
    the anchor visible)."""
    name = CATEGORIES[companion]
    question = presence_question(name)
    if rng.random() < 0.5:
        question += POPE_SUFFIX
    short = encode(f"is there a {name}")
    return QA("presence", question, "yes" if named else "no", short, (anchor,) if named else ())


def named_caption(scene: Scene, unmet: list[tuple[int, int]]) -> str:
    """The reference caption with each absent companion listed at its anchor's position."""
    items = [(o.category, o.position(scene.size)) for o in scene.objects]
    items += [(c, scene.objects[i].position(scene.size)) for i, c in unmet]
    return " , ".join(f"{CATEGORIES[c]} {pos}" for c, pos in sorted(items))


def cooccur_pope_rows(
    scenes: list[Scene], prior: CooccurPrior, seed: int = 0, per_image: int = 3
) -> list[dict]:
    """POPE rows on co-occurrence probe scenes (`scenes.cooccur_probe_scenes`), in three splits
    that share their images:

    - ``present``: ``per_image`` categories in the scene (all of them when fewer), ``yes``;
    - ``cooccur``: every absent companion of an anchor in the scene, ``no`` (the adversarial
      question by co-occurrence);
    - ``other``: as many absent categories that are no such companion, drawn uniformly, ``no``.

    So the precision on ``present + cooccur`` and on ``present + other`` have the same true
    positives and the same number of negatives; they differ only in which absent objects are
    asked about. Images are named ``scene_<seed>.png`` (``image_id``: the seed)."""
    rng = np.random.default_rng(seed)
    rows: list[dict] = []
    for scene in scenes:
        present = list(dict.fromkeys(scene.categories))
        unmet = sorted({c for _, c in unmet_companions(scene, prior)})
        if not unmet:
            raise ValueError(f"scene {scene.seed} holds no anchor without its companion")
        pos = [int(c) for c in rng.permutation(present)[:per_image]]
        others = [c for c in range(len(CATEGORIES)) if c not in present and c not in unmet]
        neg = [int(c) for c in rng.choice(others, len(unmet), replace=False)]
        asked = [(c, "yes", "present") for c in pos] + [(c, "no", "cooccur") for c in unmet]
        asked += [(c, "no", "other") for c in neg]
        for c, label, split in asked:
            rows.append(
                {
                    "question_id": len(rows),
                    "image_id": scene.seed,
                    "image": f"scene_{scene.seed}.png",
                    "text": presence_question(CATEGORIES[c]),
                    "label": label,
                    "split": split,
                    "category": CATEGORIES[c],
                }
            )
    return rows
