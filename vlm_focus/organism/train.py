"""Training recipe of the organism VLMs (CPU, bf16 autocast, three stages).

1. `vision`: the CLIP tower plus a per-patch head learns each patch's category (exact masks,
   background weighted 0.3) and its row and column, on the features LLaVA feeds the projector
   (`hidden_states[-1][:, 1:]`). The tower is then frozen.
2. `cat_last`: projector + LM learn packed category-last questions (presence, where, relations),
   where the answer follows the last category token.
3. `chat`: the standard chat template with presence, relation, where and caption turns.
Auxiliary losses spell out the circuits a 4-layer LM trained from scratch does not find alone:
the copy head (`copy_loss`), the relation hops (`relation_loss`) and the caption pointer
(`pointer_loss`). The deep model (`deep_recipe`) learns the two-hop family instead of relations
and captions, with `hop_loss` placing the read of the hop-2 object in layers >= 2.
Each stage runs for `steps` or `minutes` of wall-clock time, whichever ends first; the learning rate
follows a cosine over the larger of these fractions, so a slower machine still ends its schedule
(with fewer steps). CPU seconds are logged beside wall seconds to show how much of the two cores
the run got.
"""

from __future__ import annotations

import functools
import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import nn

from .data import (
    IGNORE,
    Batcher,
    cat_last_ids,
    chat_ids,
    pad,
    pixel_values,
    presence_qa,
    relation_qa,
    two_hop_qa,
)
from .scenes import CATEGORIES, POPULARITY, RELATIONS, generate_scene
from .vocab import IMAGE, NO, PAD, SPECS, TOKEN_ID, YES, OrganismSpec, build_config, build_processor


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
    spec: str
    stages: list[StageConfig]
    seed: int = 0
    eval_every: int = 150


def default_recipe(spec: str = "default", scale: float = 1.0) -> Recipe:
    """The shipped recipe; `scale` multiplies steps and minutes (e.g. 0.01 for a smoke run).
    The smaller guide trains for half the time; the deep model learns the two-hop family
    (`deep_recipe`)."""
    if spec == "deep":
        return deep_recipe(scale)
    if spec == "guide":
        minutes, steps = (5.0, 8.0, 14.0), (4000, 3000, 6000)
    else:  # 56 minutes in all on 2 cores
        minutes, steps = (9.0, 15.0, 32.0), (4000, 3000, 6000)
    relation, pointer, balance = 1.0, 0.2, 0.5
    m = [max(x * scale, 0.05) for x in minutes]
    s = [max(int(x * scale), 2) for x in steps]
    return Recipe(
        spec=spec,
        stages=[
            StageConfig("vision", s[0], m[0], 1e-3, batch=16, balance=balance),
            StageConfig(
                "cat_last",
                s[1],
                m[1],
                1e-3,
                mix={"presence": 0.5, "where": 0.2, "relation": 0.3},
                turns=(6, 8),
                hide_share=0.3,
                relation_weight=relation,
                balance=balance,
            ),
            StageConfig(
                "chat",
                s[2],
                m[2],
                8e-4,
                mix={"presence": 0.4, "relation": 0.25, "where": 0.1, "caption": 0.25},
                turns=(1, 1),  # one turn: the last token copies from the only question
                cat_last_share=0.5,
                hide_share=0.3,
                query_labels=True,
                copy_weight=0.2,
                relation_weight=relation,
                pointer_weight=pointer,
                balance=balance,
            ),
        ],
    )


def deep_recipe(scale: float = 1.0) -> Recipe:
    """Recipe of the deep model: the same three stages, with two-hop questions in place of the
    relations and captions, and the two-hop circuit losses. The minute budgets add up to 58, so
    the whole run fits in an hour on 2 cores; a stage that reaches its step budget first ends
    early."""
    minutes, steps = (9.0, 15.0, 34.0), (4000, 1400, 3400)  # stage 1 as the default's
    m = [max(x * scale, 0.05) for x in minutes]
    s = [max(int(x * scale), 2) for x in steps]
    relation, hop, balance = 1.0, 1.0, 0.5
    return Recipe(
        spec="deep",
        eval_every=300,
        stages=[
            StageConfig("vision", s[0], m[0], 1e-3, batch=16, balance=balance),
            StageConfig(
                "cat_last",
                s[1],
                m[1],
                1e-3,
                mix={"presence": 0.35, "where": 0.15, "twohop": 0.5},
                turns=(6, 8),
                hide_share=0.3,
                relation_weight=relation,
                hop_weight=hop,
                balance=balance,
            ),
            StageConfig(
                "chat",
                s[2],
                m[2],
                8e-4,
                mix={"presence": 0.45, "twohop": 0.45, "where": 0.1},
                turns=(1, 1),
                cat_last_share=0.5,
                hide_share=0.3,
                query_labels=True,
                copy_weight=0.2,
                relation_weight=relation,
                hop_weight=hop,
                balance=balance,
            ),
        ],
    )


class PatchHead(nn.Module):
    """Per-patch classifier on tower features: category (C+1 with background), row, column."""

    def __init__(self, hidden: int, grid: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.category = nn.Linear(hidden, len(CATEGORIES) + 1)
        self.row = nn.Linear(hidden, grid)
        self.col = nn.Linear(hidden, grid)

    def forward(self, feats: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        h = self.norm(feats)  # [B, N, D]
        return self.category(h), self.row(h), self.col(h)


class _Stream(torch.utils.data.IterableDataset):
    """Endless batches from `make()`, built in a worker process so that drawing overlaps compute."""

    def __init__(self, make) -> None:
        super().__init__()
        self.make = make

    def __iter__(self):
        while True:
            yield self.make()


def _prefetch(make):
    """Iterator over `make()` results, produced one step ahead by a single worker process."""
    loader = torch.utils.data.DataLoader(
        _Stream(make),
        batch_size=None,
        num_workers=1,
        prefetch_factor=2,
        worker_init_fn=lambda _: torch.set_num_threads(1),
    )
    return iter(loader)


def tower_features(model, pixels: torch.Tensor) -> torch.Tensor:
    """The features LLaVA projects: last hidden state of the tower without CLS, `[B, N, D]`."""
    out = model.model.vision_tower(pixels, output_hidden_states=True)
    return out.hidden_states[-1][:, 1:]


class _Clock:
    """Wall-clock and process CPU seconds since construction."""

    def __init__(self) -> None:
        self.wall0, self.cpu0 = time.time(), time.process_time()

    def wall(self) -> float:
        return time.time() - self.wall0

    def cpu(self) -> float:
        return time.process_time() - self.cpu0


def _frac(stage: StageConfig, step: int, clock: _Clock) -> float:
    return max(step / stage.steps, clock.wall() / (60 * stage.minutes))


def _lr(stage: StageConfig, step: int, clock: _Clock) -> float:
    warm = min(1.0, (step + 1) / stage.warmup)
    return stage.lr * warm * 0.5 * (1 + math.cos(math.pi * min(_frac(stage, step, clock), 1.0)))


def _done(stage: StageConfig, step: int, clock: _Clock) -> bool:
    return _frac(stage, step, clock) >= 1.0


class Probe:
    """A fixed held-out probe (teacher forced) that tracks learning during training."""

    def __init__(self, spec: OrganismSpec, n: int = 96, two_hop: bool = False) -> None:
        rng = np.random.default_rng(12345)
        self.scenes = [generate_scene(8_000_000 + i) for i in range(n)]
        self.presence = [
            presence_qa(s, rng, positive=i % 2 == 0) for i, s in enumerate(self.scenes)
        ]
        rel = [(s, relation_qa(s, rng)) for s in self.scenes]
        self.relation = [(s, q) for s, q in rel if q is not None]
        self.two_hop = []
        if two_hop:  # every form in turn; scored on the answer's first token (teacher forced)
            forms = ("colour", "category", "shape", "is_category")
            for i, s in enumerate(self.scenes):
                qa = two_hop_qa(s, rng, form=forms[i % 4], positive=i % 8 < 4)
                if qa is not None:
                    self.two_hop.append((s, qa))
        self.n_visual = spec.n_visual

    @torch.no_grad()
    def _accuracy(self, model, pairs, form: str) -> float:
        build = cat_last_ids if form == "cat_last" else chat_ids
        ids, labels = zip(*(build([q], self.n_visual) for _, q in pairs), strict=True)
        input_ids, lab = pad(list(ids), PAD), pad(list(labels), IGNORE)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(
                input_ids=input_ids,
                attention_mask=(input_ids != PAD).long(),
                pixel_values=pixel_values([s for s, _ in pairs]),
            ).logits.float()
        # the first supervised token of each row is the yes/no answer
        first = (lab != IGNORE).float().argmax(1)
        rows = torch.arange(len(pairs))
        step_logits = logits[rows, first - 1]
        if any(q.kind == "twohop" for _, q in pairs):  # open answers: the argmax token
            pred = step_logits.argmax(-1)
        else:
            pred = torch.where(step_logits[:, YES] > step_logits[:, NO], YES, NO)
        return float((pred == lab[rows, first]).float().mean())

    def __call__(self, model, form: str) -> dict[str, float]:
        model.eval()
        out = {
            "presence": self._accuracy(
                model, list(zip(self.scenes, self.presence, strict=True)), form
            )
        }
        if self.two_hop:  # a model trained on the two-hop family has no relation questions
            out["twohop"] = self._accuracy(model, self.two_hop, form)
        else:
            out["relation"] = self._accuracy(model, self.relation, form)
        model.train()
        return out


def train_vision(
    model, spec: OrganismSpec, stage: StageConfig, batcher: Batcher, log, log_every: int = 25
) -> None:
    """Stage 1: dense per-patch pretraining of the tower with the exact masks."""
    tower = model.model.vision_tower
    head = PatchHead(spec.vision_hidden, spec.grid)
    params = list(tower.parameters()) + list(head.parameters())
    opt = torch.optim.AdamW(params, lr=stage.lr, weight_decay=0.01)
    # rare categories weigh more (popularity ** -balance, mean 1); the background 0.3
    rare = torch.from_numpy(POPULARITY).float() ** -stage.balance
    weight = torch.cat([torch.tensor([0.3]), rare / rare.mean()])
    g = spec.grid
    rows = torch.arange(g).repeat_interleave(g)
    cols = torch.arange(g).repeat(g)
    t0, step = _Clock(), 0
    tower.train()
    stream = _prefetch(functools.partial(batcher.dense, stage.batch))
    while not _done(stage, step, t0):
        for group in opt.param_groups:
            group["lr"] = _lr(stage, step, t0)
        pixels, labels = next(stream)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            cat, row, col = head(tower_features(model, pixels))
        cat, row, col = cat.float(), row.float(), col.float()
        loss_cat = nn.functional.cross_entropy(
            cat.flatten(0, 1), labels.flatten(), weight=weight, ignore_index=IGNORE
        )
        b = labels.shape[0]
        loss_pos = nn.functional.cross_entropy(
            row.flatten(0, 1), rows.repeat(b)
        ) + nn.functional.cross_entropy(col.flatten(0, 1), cols.repeat(b))
        loss = loss_cat + 0.2 * loss_pos
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        if step % log_every == 0 or _done(stage, step, t0):
            mask = labels > 0
            acc = (
                float((cat.argmax(-1)[mask] == labels[mask]).float().mean()) if mask.any() else 0.0
            )
            log(stage.name, step, t0, {"loss": loss.item(), "object_patch_acc": acc})
    for p in tower.parameters():
        p.requires_grad_(False)
    tower.eval()


@torch.no_grad()
def init_category_embeddings(model, spec: OrganismSpec, batcher: Batcher, batches: int = 6) -> None:
    """Set each category token's embedding to the (centred, rescaled) mean projected feature of
    that category's patches, so query tokens start aligned with the image tokens they look up."""
    n = len(CATEGORIES)
    sums = torch.zeros(n, spec.text_hidden)
    counts = torch.zeros(n)
    for _ in range(batches):
        pixels, labels = batcher.dense(32)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            proj = model.model.multi_modal_projector(tower_features(model, pixels)).float()
        for c in range(n):
            hit = labels == c + 1
            sums[c] += proj[hit].sum(0)
            counts[c] += hit.sum()
    means = sums / counts.clamp(min=1)[:, None]
    means = means - means.mean(0)
    emb = model.get_input_embeddings().weight
    scale = emb.norm(dim=1).mean()
    for c, name in enumerate(CATEGORIES):
        if counts[c] > 0:
            emb[TOKEN_ID[name]] = means[c] / means[c].norm().clamp(min=1e-6) * scale


# the heads the auxiliary losses supervise (copy: in the later half of the layers; the others in
# layer 1; the two-hop anchor head in the layer before the first hop layer, the hop head in the
# hop layers), distinct so that the circuits do not share a head
COPY_HEAD, RELATION_HEAD, POINTER_HEAD, HOP_ANCHOR_HEAD, HOP_HEAD = 0, 1, 2, 3, 4


class RelationProbe(nn.Module):
    """Training-only linear read-outs of positions and of the relation asked from the LM's
    residual stream."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.grid = nn.Linear(hidden, 2)  # an image token's own patch, at the LM's input
        self.place = nn.Linear(hidden, 2)  # a category token's own object, after layer 0
        self.carry = nn.Linear(hidden, 2)  # the first object's, at the second token, after layer 1
        self.word = nn.Linear(hidden, len(RELATIONS))  # the relation asked, there too


def relation_loss(
    probe: RelationProbe,
    hidden_states: tuple[torch.Tensor, ...],
    attentions: tuple[torch.Tensor, ...],
    places: torch.Tensor,
    relations: torch.Tensor,
    image: torch.Tensor,
) -> dict[str, torch.Tensor]:
    """Supervise the two-hop circuit a relation question needs, one hop per layer:
    - the projected image tokens keep their patch's position (`image`: `[B, S]` bool, each
      row's image tokens in raster order); a projector trained for presence alone drops it;
    - after layer 0, each category token that names an object holds that object's centre
      (`places`: row, position, x, y), as the `where` task needs;
    - in layer 1, head 1 attends from a relation's second category token to its first
      (`relations`: row, second, first, first object's x, y, relation index), and
    - after layer 1 the second token holds the first object's centre and the relation asked,
      so the later layers only compare two centres. Without these hops the relation answer
      stayed at chance in every run; with the centres alone the second token did not know
      which relation was asked, and the answer stayed at chance too.

    Returns the terms by name (`grid`, `place`, `relation_attention`, `carry`, `word`); the loss is
    their sum."""
    terms = {}
    n_visual = int(image[0].sum())
    g = math.isqrt(n_visual)
    k = torch.arange(n_visual)
    patch = torch.stack([k % g, k // g], 1).float() * (2 / (g - 1)) - 1
    own = probe.grid(hidden_states[0][image].float())
    terms["grid"] = nn.functional.mse_loss(own, patch.repeat(len(image), 1))
    if len(places):
        rows, pos = places[:, 0].long(), places[:, 1].long()
        h = hidden_states[1][rows, pos].float()
        terms["place"] = nn.functional.mse_loss(probe.place(h), places[:, 2:])
    if len(relations):
        rows, second, first = (relations[:, i].long() for i in range(3))
        att = attentions[1][rows, RELATION_HEAD, second, first].float().clamp(min=1e-12)
        h = hidden_states[2][rows, second].float()
        terms["relation_attention"] = -att.log().mean()
        terms["carry"] = nn.functional.mse_loss(probe.carry(h), relations[:, 3:5])
        terms["word"] = nn.functional.cross_entropy(probe.word(h), relations[:, 5].long())
    return terms


def pointer_loss(
    attentions: tuple[torch.Tensor, ...], targets: torch.Tensor, masks: torch.Tensor
) -> torch.Tensor:
    """Mean -log of the attention mass that head 2 of layer 1 puts, from the token before each
    object a caption names, on that object's patches (`targets`: row, position, first image
    token; `masks`: `[M, n_visual]`). It teaches the caption to find its next object in the
    image rather than to guess it from the words so far."""
    rows, q, start = targets.unbind(1)
    cols = start[:, None] + torch.arange(masks.shape[1])
    att = attentions[1][rows, POINTER_HEAD, q].gather(1, cols).float()
    return -(att * masks).sum(1).clamp(min=1e-12).log().mean()


class HopProbe(nn.Module):
    """Training-only linear read-outs, at a two-hop question's answer position, of the anchor's
    centre and of the direction asked."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.carry = nn.Linear(hidden, 2)
        self.word = nn.Linear(hidden, len(RELATIONS))


def hop_loss(
    probe: HopProbe,
    hidden_states: tuple[torch.Tensor, ...],
    attentions: tuple[torch.Tensor, ...],
    targets: torch.Tensor,
    masks: torch.Tensor,
    layers: tuple[int, ...],
) -> dict[str, torch.Tensor]:
    """Supervise the two-hop circuit ("What colour is the shape left of the red_circle?") so that
    the hop-2 object is read from the image late, at the answer position q:
    - the anchor's category token holds the anchor's centre after layer 0 (the `place` term of
      `relation_loss`, from the position targets);
    - in layer `layers[0] - 1`, HOP_ANCHOR_HEAD attends from q to the anchor token
      (`hop_anchor_attention`), and after that layer q holds the anchor's centre (`hop_carry`)
      and the direction asked (`hop_word`);
    - in each layer of `layers`, HOP_HEAD puts its attention mass, from q, on the hop-2 object's
      patches (`hop_read`: mean -log mass).

    `targets`: row, q, anchor position, anchor x, y (in [-1, 1]), relation index, first image
    token; `masks`: `[M, n_visual]` patches of each question's hop-2 object. Layers beyond the
    model's are skipped. Returns the terms by name; the loss is their sum."""
    rows, q, anchor = (targets[:, i].long() for i in range(3))
    start = targets[:, 6].long()
    n_layers = len(attentions)
    reads = [layer for layer in layers if 0 < layer < n_layers]
    if not reads:
        raise ValueError(f"hop layers={layers}; the model has {n_layers} layers (use 1..L-1)")
    carry_layer = reads[0] - 1
    att = attentions[carry_layer][rows, HOP_ANCHOR_HEAD, q, anchor].float().clamp(min=1e-12)
    h = hidden_states[carry_layer + 1][rows, q].float()
    cols = start[:, None] + torch.arange(masks.shape[1])
    mass = [
        (attentions[layer][rows, HOP_HEAD, q].gather(1, cols).float() * masks).sum(1)
        for layer in reads
    ]
    return {
        "hop_anchor_attention": -att.log().mean(),
        "hop_carry": nn.functional.mse_loss(probe.carry(h), targets[:, 3:5]),
        "hop_word": nn.functional.cross_entropy(probe.word(h), targets[:, 5].long()),
        "hop_read": -torch.stack(mass).clamp(min=1e-12).log().mean(),
    }


def copy_loss(attentions: tuple[torch.Tensor, ...], targets: torch.Tensor) -> torch.Tensor:
    """Mean -log attention of head 0 in the later half of the layers, from each one-turn chat
    row's last prompt position to its question's last category token (`targets`: row, q, k).

    The category token computes the answer (category-last form); this teaches one head to carry
    it to the position that answers, the step a from-scratch LM otherwise finds late."""
    rows, q, k = targets.unbind(1)
    later = attentions[max(1, len(attentions) // 2) :]
    terms = [att[rows, COPY_HEAD, q, k].float().clamp(min=1e-12).log() for att in later]
    return -torch.stack(terms).mean()


def train_lm(
    model,
    stage: StageConfig,
    batcher: Batcher,
    probe: Probe | None,
    log,
    every: int,
    log_every: int = 25,
) -> None:
    """Stages 2 and 3: projector + language model on question/answer sequences."""
    params = [p for p in model.parameters() if p.requires_grad]
    relation_probe = None
    if stage.relation_weight:
        relation_probe = RelationProbe(model.config.text_config.hidden_size)
        params += list(relation_probe.parameters())
    hop_probe = None
    if stage.hop_weight:
        hop_probe = HopProbe(model.config.text_config.hidden_size)
        params += list(hop_probe.parameters())
    opt = torch.optim.AdamW(params, lr=stage.lr, weight_decay=0.01)
    t0, step = _Clock(), 0
    model.train()
    model.model.vision_tower.eval()
    form = stage.name
    make = functools.partial(
        batcher.text,
        stage.batch,
        form,
        stage.mix,
        stage.turns,
        stage.cat_last_share,
        stage.hide_share,
        stage.query_labels,
        stage.balance,
    )
    stream = _prefetch(make)
    if stage.copy_weight or stage.relation_weight or stage.pointer_weight or stage.hop_weight:
        model.set_attn_implementation("eager")  # the auxiliary losses read attention probabilities
    while not _done(stage, step, t0):
        for group in opt.param_groups:
            group["lr"] = _lr(stage, step, t0)
        batch = next(stream)
        targets = batch.pop("copy_targets")
        places, relations = batch.pop("position_targets"), batch.pop("relation_targets")
        pointers, pointer_masks = batch.pop("pointer_targets"), batch.pop("pointer_masks")
        hops, hop_masks = batch.pop("hop_targets"), batch.pop("hop_masks")
        copy = stage.copy_weight and len(targets) > 0
        relate = relation_probe is not None and len(places) + len(relations) > 0
        point = stage.pointer_weight and len(pointers) > 0
        hop = hop_probe is not None and len(hops) > 0
        with torch.autocast("cpu", dtype=torch.bfloat16):
            attend = bool(copy or relate or point or hop)
            out = model(**batch, output_attentions=attend, output_hidden_states=relate or hop)
        loss = out.loss
        record = {"loss": out.loss.item()}
        if copy:
            attn_loss = copy_loss(out.attentions, targets)
            loss = loss + stage.copy_weight * attn_loss
            record["copy_loss"] = attn_loss.item()
        if relate:
            image = batch["input_ids"] == IMAGE
            terms = relation_loss(
                relation_probe, out.hidden_states, out.attentions, places, relations, image
            )
            loss = loss + stage.relation_weight * sum(terms.values())
            record |= {f"{name}_loss": value.item() for name, value in terms.items()}
        if hop:
            terms = hop_loss(
                hop_probe, out.hidden_states, out.attentions, hops, hop_masks, stage.hop_layers
            )
            loss = loss + stage.hop_weight * sum(terms.values())
            record |= {f"{name}_loss": value.item() for name, value in terms.items()}
        if point:
            point_loss = pointer_loss(out.attentions, pointers, pointer_masks)
            loss = loss + stage.pointer_weight * point_loss
            record["pointer_loss"] = point_loss.item()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        if probe is not None and (step % every == 0 or _done(stage, step, t0)):
            record.update({f"probe_{k}": v for k, v in probe(model, form).items()})
            if stage.cat_last_share > 0:
                cat = probe(model, "cat_last")
                record.update({f"probe_cat_last_{k}": v for k, v in cat.items()})
            log(stage.name, step, t0, record)
        elif step % log_every == 0:
            log(stage.name, step, t0, record)
    model.set_attn_implementation("sdpa")


def train(recipe: Recipe, out_dir: Path, quiet: bool = False) -> dict:
    """Run the recipe from scratch; save the HF model, processor, log and curves to `out_dir`.

    Each finished stage is checkpointed (`stage_<name>.pt`) and skipped on a rerun.
    """
    from .curves import plot_curves

    torch.manual_seed(recipe.seed)
    spec = SPECS[recipe.spec]
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    from transformers import LlavaForConditionalGeneration

    model = LlavaForConditionalGeneration(build_config(spec))
    model.config.use_cache = False
    batcher = Batcher(spec.n_visual, spec.patch, seed=recipe.seed)
    two_hop = any("twohop" in st.mix for st in recipe.stages)
    probe = Probe(spec, two_hop=two_hop)
    log_path = out_dir / "train_log.jsonl"
    history: list[dict] = []
    if log_path.exists():
        history = [json.loads(line) for line in log_path.read_text().splitlines() if line]

    def log(stage: str, step: int, clock: _Clock, values: dict) -> None:
        row = {"stage": stage, "step": step, "seconds": round(clock.wall(), 1)}
        row |= {"cpu_seconds": round(clock.cpu(), 1), **values}
        history.append(row)
        with log_path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        if not quiet:
            print(json.dumps(row), flush=True)

    timings: dict[str, float] = {}
    cpu: dict[str, float] = {}  # stages checkpointed without CPU accounting are left out
    for stage in recipe.stages:
        ckpt = out_dir / f"stage_{stage.name}.pt"
        if ckpt.exists():
            state = torch.load(ckpt)
            weights = state["model"]
            if stage.name == "vision":  # the stage trains only the tower: keep just its weights
                weights = {k: v for k, v in weights.items() if "vision_tower" in k}
            model.load_state_dict(weights, strict=stage.name != "vision")
            timings[stage.name] = state["seconds"]
            if "cpu" in state:
                cpu[stage.name] = state["cpu"]
            if stage.name == "vision":
                model.model.vision_tower.requires_grad_(False)
            continue
        history[:] = [h for h in history if h["stage"] != stage.name]
        log_path.write_text("".join(json.dumps(h) + "\n" for h in history))
        clock = _Clock()
        if stage.name == "vision":
            train_vision(model, spec, stage, batcher, log)
        else:
            if stage.name == "cat_last":
                init_category_embeddings(model, spec, batcher)
            train_lm(model, stage, batcher, probe, log, recipe.eval_every)
        timings[stage.name] = clock.wall()
        cpu[stage.name] = clock.cpu()
        torch.save({"model": model.state_dict(), "seconds": clock.wall(), "cpu": clock.cpu()}, ckpt)
    model.config.use_cache = True
    model.save_pretrained(out_dir)
    build_processor(spec).save_pretrained(out_dir)
    summary = {
        "recipe": asdict(recipe),
        "seconds": timings,
        "cpu_seconds": cpu,
        "minutes_total": sum(timings.values()) / 60,
        "cpu_minutes_total": sum(cpu.values()) / 60,
    }
    (out_dir / "train_summary.json").write_text(json.dumps(summary, indent=1))
    plot_curves(history, out_dir / "learning_curves.png", title=spec.name)
    return summary
