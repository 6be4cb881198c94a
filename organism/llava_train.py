"""Training of the LLaVA-shaped organisms (``LlavaForConditionalGeneration``: CLIP tower,
projector, Llama LM), the stages of a :class:`.recipe.Recipe` run through :func:`.loop.run_stage`.

`train` runs a recipe from scratch: `train_vision` for the `vision` stage, then `train_lm` for
the language stages, with the auxiliary losses of :mod:`.losses` that the stage weights switch
on. Finished stages are checkpointed and skipped on a rerun.
"""

from __future__ import annotations

import functools
import json
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch

from .data import Batcher, cat_last_ids, chat_ids, pad, pixel_values
from .loop import Clock, autocast, jsonl_logger, prefetch, run_stage, training_dtype
from .losses import (
    HopProbe,
    PatchHead,
    RelationProbe,
    copy_loss,
    hop_loss,
    patch_loss,
    patch_weights,
    pointer_loss,
    relation_loss,
)
from .questions import IGNORE, presence_qa, relation_qa, two_hop_qa
from .recipe import Recipe, StageConfig
from .scenes import CATEGORIES, generate_scene
from .vocab import IMAGE, NO, PAD, SPECS, TOKEN_ID, YES, OrganismSpec, build_config, build_processor


def tower_features(model, pixels: torch.Tensor) -> torch.Tensor:
    """The features LLaVA projects: last hidden state of the tower without CLS, `[B, N, D]`."""
    out = model.model.vision_tower(pixels, output_hidden_states=True)
    return out.hidden_states[-1][:, 1:]


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
        with autocast():
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
    weight = patch_weights(stage.balance)
    clock = Clock()
    tower.train()
    stream = prefetch(functools.partial(batcher.dense, stage.batch))

    def step(batch) -> tuple[torch.Tensor, dict]:
        pixels, labels = batch
        with autocast():
            cat, row, col = head(tower_features(model, pixels))
        cat, row, col = cat.float(), row.float(), col.float()
        loss = patch_loss(cat, row, col, labels, weight)
        mask = labels > 0
        acc = float((cat.argmax(-1)[mask] == labels[mask]).float().mean()) if mask.any() else 0.0
        return loss, {"loss": loss.item(), "object_patch_acc": acc}

    # an empty probe: the record is logged every `log_every` steps and at the end
    run_stage(stage, params, stream, step, log, probe=dict, every=log_every, clock=clock)
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
        with autocast():
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
    clock = Clock()
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
    stream = prefetch(make)
    if stage.copy_weight or stage.relation_weight or stage.pointer_weight or stage.hop_weight:
        model.set_attn_implementation("eager")  # the auxiliary losses read attention probabilities

    def step(batch: dict) -> tuple[torch.Tensor, dict]:
        targets = batch.pop("copy_targets")
        places, relations = batch.pop("position_targets"), batch.pop("relation_targets")
        pointers, pointer_masks = batch.pop("pointer_targets"), batch.pop("pointer_masks")
        hops, hop_masks = batch.pop("hop_targets"), batch.pop("hop_masks")
        copy = stage.copy_weight and len(targets) > 0
        relate = relation_probe is not None and len(places) + len(relations) > 0
        point = stage.pointer_weight and len(pointers) > 0
        hop = hop_probe is not None and len(hops) > 0
        with autocast():
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
        return loss, record

    def probed() -> dict:
        record = {f"probe_{k}": v for k, v in probe(model, form).items()}
        if stage.cat_last_share > 0:
            record |= {f"probe_cat_last_{k}": v for k, v in probe(model, "cat_last").items()}
        return record

    run_stage(
        stage,
        params,
        stream,
        step,
        log,
        probe=None if probe is None else probed,
        every=every,
        log_every=log_every,
        clock=clock,
    )
    model.set_attn_implementation("sdpa")


def _tower_checkpoint(model, source: str, ckpt: Path) -> None:
    """The vision stage's checkpoint taken from the shipped organism-``source`` (same tower
    size): its frozen tower, and its vision stage's time, which counts towards this run's."""
    from transformers import LlavaForConditionalGeneration

    from vlm_focus.asset_paths import ASSETS

    folder = ASSETS / f"organism-{source}"
    shipped = LlavaForConditionalGeneration.from_pretrained(folder, dtype=torch.float32)
    weights = {k: v for k, v in shipped.state_dict().items() if "vision_tower" in k}
    own = {k: v.shape for k, v in model.state_dict().items() if "vision_tower" in k}
    if {k: v.shape for k, v in weights.items()} != own:
        raise ValueError(f"organism-{source}'s tower does not fit this model's")
    summary = json.loads((folder / "train_summary.json").read_text())
    seconds = summary["seconds"]["vision"]
    cpu = summary.get("cpu_seconds", {}).get("vision")
    state = {"model": weights, "seconds": seconds, "from": f"organism-{source}"}
    torch.save(state if cpu is None else {**state, "cpu": cpu}, ckpt)


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

    base_summary = None
    if recipe.base:  # fine-tune a shipped organism: its tower stays frozen
        from vlm_focus.asset_paths import ASSETS

        base = ASSETS / f"organism-{recipe.base}"
        model = LlavaForConditionalGeneration.from_pretrained(base, dtype=torch.float32)
        model.model.vision_tower.requires_grad_(False)
        model.model.vision_tower.eval()
        base_summary = json.loads((base / "train_summary.json").read_text())
    else:
        model = LlavaForConditionalGeneration(build_config(spec))
    model.config.use_cache = False
    batcher = Batcher(spec.n_visual, spec.patch, seed=recipe.seed, prior=recipe.prior)
    two_hop = any("twohop" in st.mix for st in recipe.stages)
    probe = Probe(spec, two_hop=two_hop)
    log_path = out_dir / "train_log.jsonl"
    history: list[dict] = []
    if log_path.exists():
        history = [json.loads(line) for line in log_path.read_text().splitlines() if line]

    log = jsonl_logger(log_path, history, quiet)

    timings: dict[str, float] = {}
    cpu: dict[str, float] = {}  # stages checkpointed without CPU accounting are left out
    for stage in recipe.stages:
        ckpt = out_dir / f"stage_{stage.name}.pt"
        if stage.name == "vision" and recipe.tower_from and not ckpt.exists():
            _tower_checkpoint(model, recipe.tower_from, ckpt)
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
        clock = Clock()
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
        "dtype": str(training_dtype()).removeprefix("torch."),
        "threads": torch.get_num_threads(),
    }
    if base_summary is not None:  # the base model's own training, for the whole run's time
        summary["base"] = {
            "model": f"organism-{recipe.base}",
            "seconds": base_summary["seconds"],
            "minutes_total": base_summary["minutes_total"],
            "cpu_minutes_total": base_summary.get("cpu_minutes_total"),
        }
    (out_dir / "train_summary.json").write_text(json.dumps(summary, indent=1))
    title = f"organism-{recipe.name}" if recipe.name else spec.name
    plot_curves(history, out_dir / "learning_curves.png", title=title)
    return summary
