"""The questions both organism architectures learn and are measured on, with their answers:
presence, relations, where, captions, the two-hop family and the co-occurrence prior's turns.

A :class:`QA` carries the question in words (the chat form) and in vocabulary ids (`short`, the
packed category-last form), and the scene objects its answer rests on; each architecture's data
module turns it into that model's inputs (:mod:`.data` for LLaVA, :mod:`.qwen_data` for
organism-qwen).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

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
    relation_holds,
    two_hop_pairs,
    unmet_companions,
)
from .vocab import (
    CAPTION_PROMPT,
    POPE_SUFFIX,
    TOKEN_ID,
    encode,
    presence_question,
    relation_question,
    two_hop_question,
    where_question,
)

IGNORE = -100  # the label of every token that is not an answer
CATEGORY_IDS = frozenset(TOKEN_ID[c] for c in CATEGORIES)


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


def named_objects(start: int, question: list[int], qa: QA) -> list[tuple[int, int]]:
    """(position, object index) of each category token in a question that names scene objects:
    a question's category tokens name `qa.objects` in order (a negative names none)."""
    cats = [start + i for i, tok in enumerate(question) if tok in CATEGORY_IDS]
    if qa.kind == "twohop":  # only the anchor is named; the target is found from it
        return [(cats[0], qa.objects[0])]
    return list(zip(cats, qa.objects, strict=True)) if len(cats) == len(qa.objects) else []


def colour_of(category: int) -> str:
    return list(COLOURS)[category // len(SHAPES)]


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
    - ``other``: as many absent categories in no pair of the prior (neither an anchor nor a
      companion of any anchor), drawn uniformly, ``no``: the control set, which no
      co-occurrence can bias (a companion whose anchor is absent would still carry the
      prior's bias through its pairing, so it is no control).

    So the precision on ``present + cooccur`` and on ``present + other`` have the same true
    positives and the same number of negatives; they differ only in which absent objects are
    asked about. Images are named ``scene_<seed>.png`` (``image_id``: the seed)."""
    rng = np.random.default_rng(seed)
    paired = {c for pair in prior.pairs for c in pair}
    rows: list[dict] = []
    for scene in scenes:
        present = list(dict.fromkeys(scene.categories))
        unmet = sorted({c for _, c in unmet_companions(scene, prior)})
        if not unmet:
            raise ValueError(f"scene {scene.seed} holds no anchor without its companion")
        pos = [int(c) for c in rng.permutation(present)[:per_image]]
        others = [c for c in range(len(CATEGORIES)) if c not in present and c not in paired]
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
