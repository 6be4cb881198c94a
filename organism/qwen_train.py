"""Training of organism-qwen: a ``Qwen2_5_VLForConditionalGeneration`` (window-attention tower,
merger, M-RoPE LM) trained on CPU through its real processor, in the organisms' stages:

1. ``vision``: the tower and merger, with a per-token head that learns each merged token's
   category (exact masks, background weighted 0.3) and its place, on images and clips.
   The tower and merger are then frozen, and each category token's embedding starts at the
   mean merged feature of that category.
2. ``presence``: the LM learns packed category-last presence questions on images alone, the
   lookup a from-scratch LM finds first.
3. ``cat_last``: the LM learns the whole task mix in the packed category-last form.
4. ``chat``: one question per row in the chat template, the answer also taught at the question's
   last category token (`qwen_data.encode_row`), a share of rows kept category-last.

Each stage runs through the organisms' one loop (:func:`.loop.run_stage`) for its steps or
minutes, whichever ends first; the recipe is :class:`.recipe.QwenRecipe`.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from . import qwen_data as q
from .clips import CLIP_SIZE, GROUPS, Clip, make_clip
from .loop import Clock, autocast, prefetch, run_stage
from .losses import (
    COPY_HEAD,
    HOP_ANCHOR_HEAD,
    HOP_HEAD,
    POINTER_HEAD,
    RELATION_HEAD,
    HopProbe,
    RelationProbe,
    copy_loss,
    look_loss,
    patch_weights,
    read_hop_loss,
    relation_loss,
)
from .questions import IGNORE
from .recipe import QwenRecipe, StageConfig
from .scenes import CATEGORIES, SHAPES
from .vocab import (
    IMAGE_PAD,
    QWEN_ID,
    TOKEN,
    VIDEO_PAD,
    Qwen35Spec,
    QwenSpec,
    build_qwen35_config,
    build_qwen35_processor,
    build_qwen_config,
    build_qwen_processor,
)

NAME = "organism-qwen"


@dataclass(frozen=True)
class QwenBuild:
    """What differs between the Qwen-family organisms: the model class (a transformers name),
    its config and processor builders, its size, and whether every LM layer has attention maps
    for the circuit losses to read (Qwen3.5's Gated-DeltaNet layers have none: there only the
    hidden-state probes run)."""

    name: str
    model_class: str
    config: Callable
    processor: Callable
    spec: object
    attention_circuits: bool = True

    def model(self):
        import transformers

        return getattr(transformers, self.model_class)(self.config(self.spec))


BUILDS = {
    "qwen2_5_vl": QwenBuild(
        NAME,
        "Qwen2_5_VLForConditionalGeneration",
        build_qwen_config,
        build_qwen_processor,
        QwenSpec(),
    ),
    "qwen3_5": QwenBuild(
        "organism-qwen35",
        "Qwen3_5ForConditionalGeneration",
        build_qwen35_config,
        build_qwen35_processor,
        Qwen35Spec(),
        attention_circuits=False,
    ),
}


# ---- batches --------------------------------------------------------------------------------


class QwenBatcher:
    """Training batches drawn from fresh seeds, encoded by the real processor."""

    def __init__(self, recipe: QwenRecipe, processor) -> None:
        self.recipe, self.processor = recipe, processor
        self.rng = np.random.default_rng(recipe.seed)
        self.next_seed = q.TRAIN_SEED_BASE

    def _seed(self) -> int:
        self.next_seed += 1
        return self.next_seed

    def media(self, video: float | None = None) -> q.CroppedScene | Clip:
        if self.rng.random() < (self.recipe.video if video is None else video):
            return make_clip(self._seed())
        return q.cropped_scene(self._seed())

    def row(self, stage: StageConfig, form: str, video: float | None = None) -> q.Row:
        """One row of `stage`; its `mix` may set the clip share ("video", unless `video` is
        given) and the image questions' weights ("presence", "relation", "twohop")."""
        media = self.media(stage.mix.get("video") if video is None else video)
        image_mix = {k: v for k, v in stage.mix.items() if k != "video"} or self.recipe.image_mix
        n = int(self.rng.integers(stage.turns[0], stage.turns[1] + 1)) if form == "cat_last" else 1
        if isinstance(media, Clip):
            mix = self.recipe.cat_last_video_mix if form == "cat_last" else self.recipe.video_mix
            qas = [q.video_qa(media, self.rng, mix=mix) for _ in range(n)]
        else:
            qas = [q.image_qa(media, self.rng, image_mix) for _ in range(n)]
        return q.Row(media, qas)

    def vision_batch(self, n: int) -> dict:
        """Pixels, grids and per-token labels (with normalised places) of `n` media."""
        media = [self.media() for _ in range(n)]
        images = [m for m in media if isinstance(m, q.CroppedScene)]
        clips = [m for m in media if isinstance(m, Clip)]
        batch: dict = {}
        if images:
            out = self.processor.image_processor(**q.media_inputs(*images), return_tensors="pt")
            batch["images"] = (out["pixel_values"], out["image_grid_thw"])
        if clips:
            out = self.processor.video_processor(**q.media_inputs(*clips), return_tensors="pt")
            batch["videos"] = (out["pixel_values_videos"], out["video_grid_thw"])
        batch["labels"] = torch.from_numpy(
            np.concatenate([q.vision_labels(m) for m in images + clips])
        )
        return batch

    def lm_batch(self, stage: StageConfig) -> dict:
        """`stage.batch` rows; with the recipe's `video_batches`, all clips or all images."""
        rows, targets = [], stage.relation_weight > 0
        video = None
        if self.recipe.video_batches:  # an image batch is then never padded to a clip's length
            video = float(self.rng.random() < stage.mix.get("video", self.recipe.video))
        for _ in range(stage.batch):
            form = "chat" if stage.name == "chat" else "cat_last"
            if form == "chat" and self.rng.random() < self.recipe.cat_last_share:
                form = "cat_last"
            row = self.row(stage, form, video)
            rows.append(q.encode_row(self.processor, row, form, query_labels=True, targets=targets))
        return q.collate(rows, QWEN_ID["<pad>"])


# ---- the vision stage -----------------------------------------------------------------------


class TokenHead(nn.Module):
    """Per-token read-outs of merged features: category (C + 1 with background), the object's
    shape alone (a token sees only part of its object, so shape gets its own loss) and place."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.category = nn.Linear(hidden, len(CATEGORIES) + 1)
        self.shape = nn.Linear(hidden, len(SHAPES))
        self.place = nn.Linear(hidden, 2)

    def forward(self, feats: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        h = self.norm(feats)
        return self.category(h), self.shape(h), self.place(h)


def token_loss(
    head: TokenHead,
    feats: torch.Tensor,
    labels: torch.Tensor,
    places: torch.Tensor,
    weight: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Weighted category cross-entropy + shape cross-entropy on object tokens + place error;
    also returns the category logits."""
    logits, shape, place = head(feats.float())
    loss = nn.functional.cross_entropy(logits.float(), labels, weight=weight)
    obj = labels > 0
    if obj.any():
        loss = loss + nn.functional.cross_entropy(
            shape[obj].float(), (labels[obj] - 1) % len(SHAPES)
        )
    return loss + nn.functional.mse_loss(place.float(), places), logits


def token_places(grid_thw: torch.Tensor) -> torch.Tensor:
    """Normalised (column, row) centre of each merged token `[N, 2]`, tower order."""
    out = []
    for t, h, w in (grid_thw // torch.tensor([1, 2, 2])).tolist():
        rows, cols = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
        place = torch.stack([(cols + 0.5) / w, (rows + 0.5) / h], -1).reshape(-1, 2)
        out.append(place.repeat(t, 1))
    return torch.cat(out)


def merged_features(model, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Merged tower outputs `[N, D]` of a vision batch (images first, then clips), and places."""
    feats, places = [], []
    for key in ("images", "videos"):
        if key in batch:
            pixels, grid = batch[key]
            feats.append(model.model.visual(pixels, grid_thw=grid).pooler_output)
            places.append(token_places(grid))
    return torch.cat(feats), torch.cat(places)


def train_vision(model, stage: StageConfig, batches, log) -> TokenHead:
    """The vision stage: tower and merger learn each merged token's category, shape and place
    through :class:`TokenHead`."""
    visual = model.model.visual
    head = TokenHead(model.config.text_config.hidden_size)  # the merger's output width
    params = [*visual.parameters(), *head.parameters()]
    weight = patch_weights(0.5)
    visual.train()

    def step(batch: dict) -> tuple[torch.Tensor, dict]:
        labels = batch["labels"]
        with autocast():
            feats, places = merged_features(model, batch)
        loss, logits = token_loss(head, feats, labels, places, weight)
        obj = labels > 0
        acc = float((logits.argmax(-1)[obj] == labels[obj]).float().mean()) if obj.any() else 0.0
        return loss, {"loss": loss.item(), "object_token_acc": acc}

    run_stage(stage, params, batches, step, log, probe=dict)  # logged every 25 steps and at the end
    return head


@torch.no_grad()
def init_category_embeddings(model, batches, n: int = 8) -> None:
    """Start each category token's embedding at the mean merged feature of that category, scaled
    to the embeddings' mean norm, so that a question's words and the image tokens begin aligned."""
    feats, labels = [], []
    for _ in range(n):
        batch = next(batches)
        feats.append(merged_features(model, batch)[0].float())
        labels.append(batch["labels"])
    feats, labels = torch.cat(feats), torch.cat(labels)
    emb = model.get_input_embeddings().weight
    scale = emb.norm(dim=-1).mean()
    for c, name in enumerate(CATEGORIES):
        hit = labels == c + 1
        if hit.any():
            mean = feats[hit].mean(0)
            emb[QWEN_ID[name]] = mean / mean.norm() * scale


# ---- the language stages --------------------------------------------------------------------


class CircuitProbe(RelationProbe):
    """The relation circuit's read-outs, each clip token's own temporal patch (`time`), the
    patches a start / end question's object is on screen in (`seen`; where both are read:
    :func:`_time_layer`), and a hybrid decoder's two-hop (`hop`) and start / end (`gather`)
    read-outs."""

    def __init__(self, hidden: int) -> None:
        super().__init__(hidden)
        self.time = nn.Linear(hidden, 1)
        self.seen = nn.Linear(hidden, GROUPS)
        self.hop = HopProbe(hidden)  # two-hop questions on a hybrid decoder (`read_hop_loss`)
        self.gather = GatherProbe(hidden)  # start / end questions on a hybrid decoder


class GatherProbe(nn.Module):
    """A hybrid decoder's start / end read-outs (`gather_terms`): each clip token's temporal
    patch as one yes / no per patch (`patch`, so that an average over the patches an object is
    on screen in still tells them apart), and, at the position that answers, the object named
    and the word asked before the gather (`category`, `word`) and the patches gathered after it
    (`seen`)."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.patch = nn.Linear(hidden, GROUPS)
        self.category = nn.Linear(hidden, len(CATEGORIES))
        self.word = nn.Linear(hidden, 2)
        self.seen = nn.Linear(hidden, GROUPS)


def time_loss(probe: CircuitProbe, hidden: torch.Tensor, video: torch.Tensor) -> torch.Tensor:
    """Each clip token holds its temporal patch in `hidden` (the hidden states at
    :func:`_time_layer`; `video`: `[B, S]` bool, each clip's tokens patch by patch). Clips have
    no time in their pixels, and the tower none in its positions: the LM must find it through
    M-RoPE's temporal section, which it otherwise learns too slowly for "at the start / end"
    questions."""
    per_patch = (CLIP_SIZE // TOKEN) ** 2
    patch = torch.arange(GROUPS).repeat_interleave(per_patch).float() * (2 / (GROUPS - 1)) - 1
    target = patch.repeat(int(video.sum()) // len(patch))
    return nn.functional.mse_loss(probe.time(hidden[video].float()).squeeze(-1), target)


def seen_loss(probe: CircuitProbe, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """A start / end question's category token holds, after the layer that gathers it
    (`hidden`: the hidden states one layer after :func:`_time_layer`), the temporal patches its
    object is on screen in (`targets`: row, position, 1 or
    0 per patch). The answer then needs only the first or last of them; without this term the
    chat form answered "at the start" at chance."""
    rows, pos = targets[:, 0].long(), targets[:, 1].long()
    logits = probe.seen(hidden[rows, pos].float())
    return nn.functional.binary_cross_entropy_with_logits(logits, targets[:, 2:])


def _loss(
    model, batch: dict, relation_probe: CircuitProbe | None, attention: bool = True
) -> dict[str, torch.Tensor]:
    """The answers' cross-entropy (`answer`) and, with `relation_probe`, the circuits' terms:
    the relation hops (`losses.relation_loss`, read from eager attention), the clip tokens'
    `time`, the start / end questions' `seen` (where: :func:`_time_layer`) and the chat rows'
    `copy` (`losses.copy_loss`).
    Without `attention` (a decoder whose layers are not all attention) the terms that read
    every layer's attention are off: the image tokens' `grid` and the named objects' `place`
    run, and two-hop questions get `losses.read_hop_loss` at the last full-attention layer."""
    labels = batch.pop("labels")
    places, relations = batch.pop("place_targets", None), batch.pop("relation_targets", None)
    grid, seen = batch.pop("grid_targets", None), batch.pop("seen_targets", None)
    copies = batch.pop("copy_targets", None)
    gathers, gather_masks = batch.pop("gather_targets", None), batch.pop("gather_masks", None)
    hops, hop_masks = batch.pop("hop_targets", None), batch.pop("hop_masks", None)
    looks, look_masks = batch.pop("look_targets", None), batch.pop("look_masks", None)
    if not attention and relations is not None:
        relations = relations[:0]  # it reads every layer's attention
    video = batch["input_ids"] == VIDEO_PAD
    relate = relation_probe is not None and (len(grid) > 0 or bool(video.any()))
    with autocast():
        out = model(**batch, output_attentions=relate, output_hidden_states=relate)
    logits = out.logits.float()
    terms = {
        "answer": nn.functional.cross_entropy(
            logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=IGNORE
        )
    }
    if relate:
        # the tower knows only relative places: its tokens learn theirs in layer 0 (M-RoPE,
        # against the vision-start token), and the hops start at layer 1
        image = batch["input_ids"] == IMAGE_PAD
        terms |= relation_loss(
            relation_probe,
            out.hidden_states,
            out.attentions,
            places,
            relations,
            image,
            image_places=grid[:, 1:],
            layer=1,
        )
        at = _time_layer(model, attention)
        if video.any():
            terms["time"] = time_loss(relation_probe, out.hidden_states[at], video)
        if attention and len(seen):  # a hybrid gathers later: `gather_terms`
            terms["seen"] = seen_loss(relation_probe, out.hidden_states[at + 1], seen)
        # a hybrid decoder's attentions are its full-attention layers' alone; the copy reads the
        # later half of them, so it needs two
        if len(copies) and (attention or len(out.attentions) > 1):
            terms["copy"] = copy_loss(out.attentions, copies.long())
        if not attention:
            terms |= _hybrid_terms(model, relation_probe, out, hops, hop_masks, looks, look_masks)
            terms |= gather_terms(
                model, relation_probe.gather, out, batch["input_ids"], gathers, gather_masks, at
            )
    return terms


def _hybrid_terms(model, probe, out, hops, hop_masks, looks, look_masks) -> dict:
    """A hybrid decoder's circuit: its first full-attention layer looks up the object a question
    names (`losses.look_loss`), its last reads a two-hop question's hop-2 object
    (`losses.read_hop_loss`), on a head other than the copy's where they share the layer."""
    terms = {}
    heads = out.attentions[0].shape[1]
    if looks is not None and len(looks):
        terms["look"] = look_loss(out.attentions[0], looks, look_masks, HOP_ANCHOR_HEAD % heads)
    if len(hops):
        read = HOP_HEAD % heads
        if read == COPY_HEAD:
            read = RELATION_HEAD
        terms |= read_hop_loss(
            probe.hop,
            out.hidden_states,
            out.attentions[-1],
            hops,
            hop_masks,
            _last_full_attention(model),
            read,
        )
    return terms


GATHER_HEAD = POINTER_HEAD  # a head the last full-attention layer's copy and hop read leave free
FETCH_HEAD = COPY_HEAD  # a head the first full-attention layer's lookup leaves free


def gather_terms(model, probe, out, ids, targets, masks, time_layer: int) -> dict:
    """A hybrid decoder's start / end circuit ("At the start of the video, is there a
    red_circle?"). The patches an object is on screen in cannot be gathered by the linear layers
    (a delta rule keeps a key's latest value, so the object's last patch alone), so the last
    full-attention layer gathers them, as it reads a two-hop question's object:
    - each clip token holds its temporal patch, one yes / no per patch, where `time` is read
      (`patch`; `time_layer` as in :func:`_time_layer`);
    - at that layer's input the position that answers holds the object named and the word asked
      (`gather_word`: both as classes); a chat row's answer, six tokens after the question's
      category token, fetches them in the first full-attention layer (`fetch`: FETCH_HEAD's
      -log mass on that token), since the linear layers did not learn to carry them there;
    - there GATHER_HEAD puts its mass, from that position, on the object's tokens in every patch
      (`gather`: mean -log mass) and after the layer the position holds those patches (`seen`).
    `targets` and `masks` as in `qwen_data.gather_targets`, with the row first."""
    terms = {}
    video = ids == VIDEO_PAD
    if video.any():
        per_patch = (CLIP_SIZE // TOKEN) ** 2
        patch = torch.arange(GROUPS).repeat_interleave(per_patch)
        target = (
            nn.functional.one_hot(patch, GROUPS).float().repeat(int(video.sum()) // len(patch), 1)
        )
        logits = probe.patch(out.hidden_states[time_layer][video].float())
        terms["patch"] = nn.functional.binary_cross_entropy_with_logits(logits, target)
    if targets is None or not len(targets):
        return terms
    layer = _last_full_attention(model)
    rows, q, named = targets[:, 0].long(), targets[:, 1].long(), targets[:, 2].long()
    chat = q != named
    if chat.any():
        first = out.attentions[0][rows[chat], FETCH_HEAD % out.attentions[0].shape[1], q[chat]]
        mass = first.gather(1, named[chat, None]).squeeze(1).float()
        terms["fetch"] = -mass.clamp(min=1e-12).log().mean()
    before = out.hidden_states[layer][rows, q].float()
    terms["gather_word"] = nn.functional.cross_entropy(
        probe.category(before), targets[:, 3].long()
    ) + nn.functional.cross_entropy(probe.word(before), targets[:, 4].long())
    # a clip's tokens are interleaved with its timestamps: the row's own clip token positions
    cols = torch.stack([video[r].nonzero().squeeze(1)[: masks.shape[1]] for r in rows.tolist()])
    attention = out.attentions[-1][rows, GATHER_HEAD % out.attentions[-1].shape[1], q]
    mass = (attention.gather(1, cols).float() * masks).sum(1)
    terms["gather"] = -mass.clamp(min=1e-12).log().mean()
    after = out.hidden_states[layer + 1][rows, q].float()
    terms["seen"] = nn.functional.binary_cross_entropy_with_logits(
        probe.seen(after), targets[:, 5:]
    )
    return terms


def _full_attention_layers(model) -> list[int]:
    types = getattr(model.config.text_config, "layer_types", None)
    if not types or "full_attention" not in types:
        raise ValueError("a hybrid circuit needs a decoder with a full-attention layer")
    return [i for i, t in enumerate(types) if t == "full_attention"]


def _last_full_attention(model) -> int:
    return _full_attention_layers(model)[-1]


def _time_layer(model, attention: bool = True) -> int:
    """The layer whose input holds each clip token's temporal patch (`time_loss`). organism-qwen
    finds time in layer 0 through M-RoPE, and that layer gathers a start / end question's
    patches (`seen_loss`). A hybrid's layer 0 is linear attention, without RoPE, and its linear
    layers did not learn to carry the frame timestamps (`<1.2 seconds>`) forward: on clip
    batches alone the time term stayed at chance for 75 steps at the first full-attention
    layer's input, and fell to 0.002 in 50 at its output. So that layer finds time through
    M-RoPE, as organism-qwen's layer 0 does, and the last full-attention layer gathers
    (`gather_terms`)."""
    return 1 if attention else _full_attention_layers(model)[0] + 1


def train_lm(
    model,
    stage: StageConfig,
    batches,
    probe,
    log,
    eval_every: int,
    attention: bool = True,
    circuit: CircuitProbe | None = None,
) -> None:
    """A language stage: the LM alone learns the stage's rows, with the relation circuit's
    losses (weight `stage.relation_weight`) where set, read by `circuit` (a fresh probe where
    None); `attention` as in :func:`_loss`."""
    visual = model.model.visual
    for p in model.parameters():
        p.requires_grad_(False)
    # the merger stays as the vision stage left it: the category embeddings start aligned with
    # its features, and an LM that moves them learns the lookup more slowly
    params = list(model.model.language_model.parameters())
    for p in params:
        p.requires_grad_(True)
    relation_probe = None
    if stage.relation_weight:
        relation_probe = circuit or CircuitProbe(model.config.text_config.hidden_size)
        params += list(relation_probe.parameters())
        # the circuit's losses read the LM's attention probabilities; the tower keeps SDPA
        model.set_attn_implementation({"text_config": "eager", "vision_config": "sdpa"})
    model.train()
    visual.eval()

    def step(batch: dict) -> tuple[torch.Tensor, dict]:
        terms = _loss(model, batch, relation_probe, attention)
        circuit = {k: v for k, v in terms.items() if k != "answer"}
        loss = terms["answer"] + stage.relation_weight * sum(circuit.values())
        record = {"loss": terms["answer"].item()}
        return loss, record | {f"{k}_loss": v.item() for k, v in circuit.items()}

    def probed() -> dict:
        record = probe(model)
        model.train()
        visual.eval()
        return record

    run_stage(stage, params, batches, step, log, probe=probed, every=eval_every)
    model.set_attn_implementation("sdpa")


# ---- the whole run --------------------------------------------------------------------------


def train(recipe: QwenRecipe, out_dir: Path, quiet: bool = False) -> dict:
    """Run `recipe` from scratch (the model of its `model_type`'s :data:`BUILDS` entry); save
    the HF model (weights in bfloat16, config in float32), processor, log and summary to
    `out_dir`."""
    from .qwen_eval import Probe

    build = BUILDS[recipe.model_type]
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(recipe.seed)
    model = build.model()
    processor = build.processor()
    log_path = out_dir / "train_log.jsonl"
    log_path.write_text("")
    total = Clock()

    def log(stage: str, step: int, clock: Clock, values: dict) -> None:
        row = {
            "stage": stage,
            "step": step,
            "wall": round(clock.wall(), 1),
            "cpu": round(clock.cpu(), 1),
            **{k: round(v, 4) for k, v in values.items()},
        }
        with log_path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        if not quiet:
            print(json.dumps(row), flush=True)

    batcher = QwenBatcher(recipe, processor)
    stages: dict[str, dict] = {}
    probe = Probe(processor, kinds=recipe.probe_kinds)
    # a hybrid's read-outs carry over from stage to stage: a fresh start / end probe's loss
    # (about 10 against 0.01 at the stage before's end) pulls the circuit it reads apart
    circuit = None
    if not build.attention_circuits:
        circuit = CircuitProbe(model.config.text_config.hidden_size)
    for stage in recipe.stages:
        start, cpu_start = time.time(), time.process_time()
        if stage.name == "vision" and recipe.vision_from:
            saved = torch.load(recipe.vision_from)
            load_tower(model, saved["model"])
            stages[stage.name] = saved["stage"]
            batches = prefetch(lambda s=stage: batcher.vision_batch(s.batch))
            init_category_embeddings(model, batches)
            del batches
            continue
        if stage.name == "vision":
            batches = prefetch(lambda s=stage: batcher.vision_batch(s.batch))
            train_vision(model, stage, batches, log)
            init_category_embeddings(model, batches)
        else:
            batches = prefetch(lambda s=stage: batcher.lm_batch(s))
            train_lm(
                model,
                stage,
                batches,
                probe,
                log,
                recipe.eval_every,
                build.attention_circuits,
                circuit,
            )
        del batches
        steps = [json.loads(line) for line in log_path.read_text().splitlines()]
        stages[stage.name] = {
            **asdict(stage),
            "seconds": round(time.time() - start, 1),
            "cpu_seconds": round(time.process_time() - cpu_start, 1),
            "steps_run": max((r["step"] for r in steps if r["stage"] == stage.name), default=0),
        }
        if stage.name == "vision":  # the tower, kept so that the language stages can be rerun
            torch.save(
                {"model": model.state_dict(), "stage": stages[stage.name]}, out_dir / "vision.pt"
            )
    model.eval()
    save(model, processor, out_dir)
    earlier = stages["vision"] if recipe.vision_from else {}
    summary = {
        "name": build.name,
        "architecture": recipe.model_type,
        "spec": asdict(build.spec),
        "params": sum(p.numel() for p in model.parameters()),
        # a vision stage taken from `vision_from` counts with the time it took in its own run
        "seconds": round(total.wall() + earlier.get("seconds", 0.0), 1),
        "cpu_seconds": round(total.cpu() + earlier.get("cpu_seconds", 0.0), 1),
        "vision_from_earlier_run": bool(recipe.vision_from),
        "threads": torch.get_num_threads(),
        "video_share": recipe.video,
        "image_mix": recipe.image_mix,
        "video_mix": recipe.video_mix,
        "cat_last_video_mix": recipe.cat_last_video_mix,
        "cat_last_share": recipe.cat_last_share,
        "stages": stages,
    }
    (out_dir / "train_summary.json").write_text(json.dumps(summary, indent=1))
    return summary


def load_tower(model, state: dict) -> None:
    """Load the vision tower and merger of an earlier run's `vision.pt` state into `model`; its
    language model may differ in depth, and starts fresh."""
    tower = {k: v for k, v in state.items() if ".visual." in f".{k}"}
    missing, unexpected = model.load_state_dict(tower, strict=False)
    if unexpected or any(".visual." in f".{k}" for k in missing):
        raise ValueError(f"vision.pt does not fit this tower: {unexpected or missing}")


def save(model, processor, out_dir: Path) -> None:
    """Save the model with bfloat16 weights (half the bytes; the asset budget) and a float32
    config, so that ``from_pretrained`` computes in float32 as the other organisms do."""
    model.to(torch.bfloat16).save_pretrained(out_dir)
    model.float()
    config = json.loads((out_dir / "config.json").read_text())
    _set_dtype(config, "float32")
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    processor.save_pretrained(out_dir)
    model.generation_config.save_pretrained(out_dir)


def _set_dtype(config: dict, dtype: str) -> None:
    for key, value in config.items():
        if key in ("dtype", "torch_dtype"):
            config[key] = dtype
        elif isinstance(value, dict):
            _set_dtype(value, dtype)
