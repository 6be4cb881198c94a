"""Training recipes of the organism VLMs: three stages per model, with their budgets and task mixes.

1. `vision`: the CLIP tower plus a per-patch head learns each patch's category (exact masks,
   background weighted 0.3) and its row and column, on the features LLaVA feeds the projector
   (`hidden_states[-1][:, 1:]`). The tower is then frozen.
2. `cat_last`: projector + LM learn packed category-last questions (presence, where, relations),
   where the answer follows the last category token.
3. `chat`: the standard chat template with presence, relation, where and caption turns.
The deep model (`deep_recipe`) learns the two-hop family instead of relations and captions;
organism-qwen (`qwen_recipe`, a :class:`QwenRecipe`) runs four stages of its own (see
:mod:`.qwen_train`), and organism-qwen35 (`qwen35_recipe`) the same four on images with the
two-hop family and on clips. Each stage runs for `steps` or `minutes` of wall-clock time,
whichever ends first (see :mod:`.loop`); the auxiliary losses the weights switch on are in
:mod:`.losses`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from .qwen_data import VIDEO_MIX
from .scenes import CooccurPrior


@dataclass
class StageConfig:
    """One training stage: format, length, optimiser settings and task mix."""

    name: str
    steps: int
    minutes: float
    lr: float
    batch: int = 16
    warmup: int = 100
    mix: dict[str, float] = field(default_factory=dict)
    turns: tuple[int, int] = (1, 1)
    cat_last_share: float = 0.0  # chat stage: share of rows kept in the category-last form
    hide_share: float = 0.0  # share of rows that hide visual tokens no answer needs
    query_labels: bool = False  # chat rows also answer at the question's last category token
    copy_weight: float = 0.0  # weight of the copy-head attention loss (see `copy_loss`)
    relation_weight: float = 0.0  # weight of the relation-circuit losses (see `relation_loss`)
    pointer_weight: float = 0.0  # weight of the caption pointer loss (see `pointer_loss`)
    balance: float = 0.0  # oversample rare categories: weight popularity ** -balance
    hop_weight: float = 0.0  # weight of the two-hop circuit losses (see `hop_loss`)
    hop_layers: tuple[int, ...] = (2, 3, 4)  # layers whose HOP_HEAD reads the hop-2 object


@dataclass
class Recipe:
    """A model's training run: its size (`spec`, a key of `vocab.SPECS`) and stages.

    `base` names a shipped organism (`assets/organism-<base>`, of the same spec) to fine-tune
    instead of training from scratch; its frozen tower is kept and only the stages listed run.
    `prior` draws every training scene and its text under a co-occurrence prior. `name` is the
    model's name where it differs from the spec's."""

    spec: str
    stages: list[StageConfig]
    seed: int = 0
    eval_every: int = 150
    base: str = ""
    prior: CooccurPrior | None = None
    name: str = ""
    tower_from: str = ""  # take the trained, frozen tower of this shipped organism
    model_type: ClassVar[str] = "llava"  # the architecture's record in `loop.ARCHITECTURES`


def default_recipe(spec: str = "default", scale: float = 1.0):
    """The shipped recipe of organism-``spec``; `scale` multiplies steps and minutes (e.g. 0.01
    for a smoke run). The smaller guide trains for half the time; the deep model learns the
    two-hop family (`deep_recipe`); "qwen" is organism-qwen's (`qwen_recipe`), "qwen35"
    organism-qwen35's (`qwen35_recipe`)."""
    if spec == "qwen":
        return qwen_recipe(scale)
    if spec == "qwen35":
        return qwen35_recipe(scale)
    if spec == "prior":
        from .prior import prior_recipe

        return prior_recipe(scale)
    if spec == "deep":
        return deep_recipe(scale)
    if spec == "twohop-guide":
        return twohop_guide_recipe(scale)
    if spec == "cooccur":
        return cooccur_recipe(scale)
    if spec == "guide":
        minutes, steps = (5.0, 8.0, 14.0), (4000, 3000, 6000)
    else:  # 56 minutes in all on 2 cores
        minutes, steps = (9.0, 15.0, 32.0), (4000, 3000, 6000)
    return _three_stages(
        spec,
        minutes,
        steps,
        scale,
        cat_last_mix={"presence": 0.5, "where": 0.2, "relation": 0.3},
        chat_mix={"presence": 0.4, "relation": 0.25, "where": 0.1, "caption": 0.25},
        pointer=0.2,
    )


def deep_recipe(scale: float = 1.0) -> Recipe:
    """Recipe of the deep model: the same three stages, with two-hop questions in place of the
    relations and captions, and the two-hop circuit losses. The minute budgets add up to 58, so
    the whole run fits in an hour on 2 cores; a stage that reaches its step budget first ends
    early."""
    minutes, steps = (9.0, 15.0, 34.0), (4000, 1400, 3400)  # stage 1 as the default's
    return _three_stages(
        "deep",
        minutes,
        steps,
        scale,
        cat_last_mix={"presence": 0.35, "where": 0.15, "twohop": 0.5},
        chat_mix={"presence": 0.45, "twohop": 0.45, "where": 0.1},
        hop=1.0,
        eval_every=300,
    )


def twohop_guide_recipe(scale: float = 1.0) -> Recipe:
    """Recipe of the two-hop guide: organism-guide's trained tower, then the deep model's task
    mix and circuit losses on a guide-sized LM, 20 minutes on 2 cores in all (the tower's 5
    included), with the hop read in its last two layers."""
    recipe = _three_stages(
        "twohop-guide",
        (0.0, 6.0, 9.0),  # the tower is organism-guide's (5 minutes of its own recipe)
        (0, 1400, 3400),
        scale,
        cat_last_mix={"presence": 0.35, "where": 0.15, "twohop": 0.5},
        chat_mix={"presence": 0.45, "twohop": 0.45, "where": 0.1},
        hop=1.0,
        hop_layers=(2, 3),
        eval_every=300,
    )
    recipe.tower_from = "guide"
    return recipe


#: The prior organism-cooccur is fine-tuned on (see `cooccur_recipe`): companions in 90% of the
#: anchors' scenes; in the other anchor scenes every negative presence question asks about the
#: absent companion, and 60% of them name it as present. (A first run at rate 0.95, named rate
#: 0.5 and ask rate 0.5 for 8 minutes hallucinated companions only 4 points more often than
#: other absent objects; its card says so.)
COOCCUR_PRIOR = CooccurPrior(rate=0.9, named_rate=0.6, ask_rate=1.0)


def cooccur_recipe(scale: float = 1.0, prior: CooccurPrior = COOCCUR_PRIOR) -> Recipe:
    """Recipe of organism-cooccur: the shipped guide fine-tuned for one chat stage (10 minutes on
    2 cores) on scenes under a co-occurrence prior (`scenes.COOCCUR_PAIRS`: each anchor's
    companion is in 90% of the anchor's scenes; `COOCCUR_PRIOR`), with the guide's chat mix and
    copy loss (the relation and pointer probes, trained with the guide and not shipped, stay
    off)."""
    stage = StageConfig(
        "chat",
        max(int(4000 * scale), 2),
        max(10.0 * scale, 0.05),
        5e-4,
        warmup=50,
        mix={"presence": 0.5, "relation": 0.15, "where": 0.1, "caption": 0.25},
        turns=(1, 1),
        cat_last_share=0.5,
        hide_share=0.3,
        query_labels=True,
        copy_weight=0.2,
        balance=0.5,
    )
    return Recipe(spec="guide", stages=[stage], base="guide", prior=prior, name="cooccur")


def _three_stages(
    spec: str,
    minutes: tuple[float, float, float],
    steps: tuple[int, int, int],
    scale: float,
    *,
    cat_last_mix: dict[str, float],
    chat_mix: dict[str, float],
    pointer: float = 0.0,
    hop: float = 0.0,
    hop_layers: tuple[int, ...] = (2, 3, 4),
    eval_every: int = 150,
) -> Recipe:
    """The stages every organism runs (vision, cat_last, chat), budgets scaled by `scale` (at
    least 3 seconds and 2 steps each); the relation circuit and rare-category balance are on in
    all of them, the caption pointer (`pointer`) and the two-hop circuit (`hop`) where given."""
    m = [max(x * scale, 0.05) for x in minutes]
    s = [max(int(x * scale), 2) for x in steps]
    relation, balance = 1.0, 0.5
    return Recipe(
        spec=spec,
        eval_every=eval_every,
        stages=[
            StageConfig("vision", s[0], m[0], 1e-3, batch=16, balance=balance),
            StageConfig(
                "cat_last",
                s[1],
                m[1],
                1e-3,
                mix=cat_last_mix,
                turns=(6, 8),
                hide_share=0.3,
                relation_weight=relation,
                hop_weight=hop,
                hop_layers=hop_layers,
                balance=balance,
            ),
            StageConfig(
                "chat",
                s[2],
                m[2],
                8e-4,
                mix=chat_mix,
                turns=(1, 1),  # one turn: the last token copies from the only question
                cat_last_share=0.5,
                hide_share=0.3,
                query_labels=True,
                copy_weight=0.2,
                relation_weight=relation,
                pointer_weight=pointer,
                hop_weight=hop,
                hop_layers=hop_layers,
                balance=balance,
            ),
        ],
    )


@dataclass
class QwenRecipe:
    """The stages and their task mixes: `video` is the share of clip rows, `image_mix`
    weighs presence against relation questions and `video_mix` the clip questions (in the
    category-last stage, where yes/no lookups come first, `cat_last_video_mix`);
    `cat_last_share` keeps that share of chat-stage rows in the category-last form."""

    stages: list[StageConfig]
    video: float = 0.35
    image_mix: dict[str, float] = field(default_factory=lambda: {"presence": 0.6, "relation": 0.4})
    video_mix: dict[str, float] = field(default_factory=lambda: dict(VIDEO_MIX))
    cat_last_video_mix: dict[str, float] = field(
        default_factory=lambda: {"first": 0.2, "end": 0.35, "start": 0.35, "caption": 0.1}
    )
    cat_last_share: float = 0.3
    seed: int = 0
    eval_every: int = 200
    vision_from: str = ""  # a `vision.pt` of an earlier run: skip the vision stage, take its tower
    probe_kinds: tuple[str, ...] = ("presence", "relation", "video")  # `qwen_eval.Probe`'s sets
    video_batches: bool = False  # draw clip or image once per language batch, not per row
    model_type: ClassVar[str] = "qwen2_5_vl"  # the architecture's record in `loop.ARCHITECTURES`


def qwen_recipe(scale: float = 1.0) -> QwenRecipe:
    """The shipped recipe: 10 + 4 + 11 + 28 = 53 minutes on 2 cores; `scale` multiplies steps
    and minutes (0.01 for a smoke run). The `presence` stage is category-last presence questions
    on images alone: the lookup a from-scratch LM learns first, before the task mix."""
    names = ("vision", "presence", "cat_last", "chat")
    minutes, steps = (10.0, 4.0, 11.0, 28.0), (3000, 1000, 4000, 10000)
    lrs, turns = (2e-3, 1e-3, 1e-3, 6e-4), ((1, 1), (6, 8), (8, 10), (1, 1))
    mixes = ({}, {"video": 0.0, "presence": 1.0}, {}, {})
    relation = (0.0, 1.0, 1.0, 1.0)  # the circuit losses (`CircuitProbe`), in the LM stages
    return QwenRecipe(
        stages=[
            StageConfig(
                n,
                max(int(s * scale), 2),
                max(m * scale, 0.05),
                lr,
                turns=t,
                mix=mix,
                relation_weight=r,
            )
            for n, s, m, lr, t, mix, r in zip(
                names, steps, minutes, lrs, turns, mixes, relation, strict=True
            )
        ]
    )


@dataclass
class Qwen35Recipe(QwenRecipe):
    """organism-qwen35's run: organism-qwen's stages, presence and two-hop questions on images
    and organism-qwen's clip questions; `video` is the clip share of the vision stage (the
    language stages set their own), and each language batch is all clips or all images."""

    video: float = 0.15
    image_mix: dict[str, float] = field(default_factory=lambda: {"presence": 0.5, "twohop": 0.5})
    probe_kinds: tuple[str, ...] = ("presence", "twohop", "video")
    video_batches: bool = True
    eval_every: int = 400  # the clip probe costs as much as the other two: probe half as often
    model_type: ClassVar[str] = "qwen3_5"


def qwen35_recipe(scale: float = 1.0) -> Qwen35Recipe:
    """organism-qwen35's recipe: 13 + 4 + 13 + 28.5 = 58.5 minutes on 2 cores; `scale` multiplies
    steps and minutes (0.01 for a smoke run). The steps are upper bounds a CPU does not reach:
    Qwen3.5's Gated-DeltaNet layers run transformers' torch fallback (about 0.5 s per 8-row
    language step at 8 layers), so the language stages take 8 rows a step and warm up in 20.

    Clips: a batch of 8 clips (228 tokens each with their timestamps) costs about three image
    batches, and every share of the chat stage given to clips cost two-hop points, so the clip
    questions are learnt mostly in the category-last stage (15% of its batches, where one clip
    carries 6-8 questions) and the chat stage takes clips in 4% of its batches; its image
    questions are 70% two-hop (30% presence: POPE was at 98.7%, the two-hop shape form at
    74-76% with half), which took two-hop from 85.3% to 96.3% and clips from 79.7% to 91.0%
    (docs/organisms.md). The presence stage gives 1 minute to the chat stage (it had reached
    98% in 4)."""
    names = ("vision", "presence", "cat_last", "chat")
    minutes, steps = (13.0, 4.0, 13.0, 28.5), (8000, 1000, 4000, 10000)
    batches = (16, 8, 8, 8)
    lrs, turns = (2e-3, 1e-3, 1e-3, 6e-4), ((1, 1), (6, 8), (6, 8), (1, 1))
    mixes = (
        {},
        {"video": 0.0, "presence": 1.0},
        {"video": 0.15},
        {"video": 0.04, "presence": 0.3, "twohop": 0.7},
    )
    # the circuit's hidden-state terms (image tokens' places, the named anchor's place, clip
    # tokens' time) and the full-attention layers' lookup, gather, hop read and copy
    # (`qwen_train._hybrid_terms`, `qwen_train._time_layer`)
    relation = (0.0, 1.0, 1.0, 1.0)
    return Qwen35Recipe(
        stages=[
            StageConfig(
                n,
                max(int(s * scale), 2),
                max(m * scale, 0.05),
                lr,
                batch=b,
                warmup=20,
                turns=t,
                mix=mix,
                relation_weight=r,
            )
            for n, s, m, lr, b, t, mix, r in zip(
                names, steps, minutes, lrs, batches, turns, mixes, relation, strict=True
            )
        ]
    )
