"""organism-prior: an organism whose object hallucination comes from a co-occurrence prior that
lives in its language model, the way an LVLM's does, with labels that never lie.

Its parent is organism-deep (8 language layers, which read the image in middle layers). Two
stages fine-tune it:

1. `text`: the language model alone learns long captions without any image (no image tokens),
   written about scenes under :data:`PRIOR`: each anchor's companion is in 93% of its scenes and
   a caption names it right after its anchor, so the next object after an anchor is predictable
   from the text alone.
2. `align`: images come back, at a low learning rate for a short budget (a weak image pathway):
   captions of the scenes and presence questions, every word true of the image, plus a share of
   text-only caption rows, so that a branch without an image stays in distribution.

A caption is one sentence per object, ``there is a red_circle in the top_left of the image .``
(11 tokens), in reading order (top band first, left to right) with each companion moved right
after its anchor; caption scenes hold 3-5 objects, so most captions run 40+ tokens.
"""

from __future__ import annotations

import functools
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import ClassVar

import numpy as np
import torch

from .data import TRAIN_SEED_BASE, chat_ids, pad, pixel_values
from .loop import Clock, autocast, jsonl_logger, prefetch, run_stage, training_dtype
from .questions import IGNORE, presence_qa
from .recipe import StageConfig
from .scenes import CooccurPrior, Scene, cooccur_scene
from .vocab import BOS, CAPTION_PROMPT, EOS, IMAGE, PAD, SPECS, build_processor, encode

#: The scene prior of every training scene: companions in 93% of their anchors' scenes. Labels
#: are truthful (``named_rate=0``): no text ever names an absent object.
PRIOR = CooccurPrior(rate=0.93, named_rate=0.0, ask_rate=0.0)
PARENT = "deep"  # the shipped organism fine-tuned (its tower stays frozen)
CAPTION_OBJECTS = (3, 5)  # objects drawn per caption scene (companions may add one)


def reading_order(scene: Scene, prior: CooccurPrior = PRIOR) -> list[int]:
    """Object indices in caption order: by band of the image (thirds, top first), then left to
    right, with each companion of an anchor in the scene moved to right after that anchor."""
    band = scene.size / 3
    order = sorted(
        range(len(scene.objects)),
        key=lambda i: (int(scene.objects[i].cy // band), scene.objects[i].cx),
    )
    index_of = {scene.objects[i].category: i for i in order}
    follows = {
        index_of[b]: index_of[a] for a, b in prior.pairs if a in index_of and b in index_of
    }  # companion object -> its anchor object
    out: list[int] = []
    for i in order:
        if i in follows:
            continue
        out.append(i)
        out += [c for c, a in follows.items() if a == i]
    return out


def long_caption(scene: Scene, prior: CooccurPrior = PRIOR) -> str:
    """One sentence per object in :func:`reading_order`: ``there is a {category} in the
    {position} of the image .``"""
    sentences = [
        f"there is a {scene.objects[i].name} in the {scene.objects[i].position(scene.size)} "
        "of the image ."
        for i in reading_order(scene, prior)
    ]
    return " ".join(sentences)


def caption_ids(scene: Scene, n_visual: int, prior: CooccurPrior = PRIOR) -> tuple[list, list]:
    """Chat-template ids and labels of a caption row (loss on the caption and its <eos>);
    ``n_visual`` 0 builds the text-only row (no image in the user turn)."""
    prompt = [BOS, *encode("USER:"), *([IMAGE] * n_visual), *encode(CAPTION_PROMPT)]
    prompt += encode("ASSISTANT:")
    answer = [*encode(long_caption(scene, prior)), EOS]
    return prompt + answer, [IGNORE] * len(prompt) + answer


class PriorBatcher:
    """Endless training batches of the two stages, from scenes under ``prior``."""

    def __init__(self, n_visual: int, seed: int = 0, prior: CooccurPrior = PRIOR) -> None:
        self.n_visual = n_visual
        self.prior = prior
        self.rng = np.random.default_rng([seed, 31])

    def scene(self, n_objects: int | None = None) -> Scene:
        seed = int(self.rng.integers(TRAIN_SEED_BASE, 2**31))
        return cooccur_scene(seed, self.prior, n_objects=n_objects)

    def batch(self, size: int, mix: dict[str, float]) -> dict:
        """``size`` rows drawn by kind weights ``mix``: ``caption`` (image + long caption),
        ``text_caption`` (the same without an image) and ``presence`` (image + one truthful
        yes/no question, half of them negatives)."""
        kinds = list(mix)
        p = np.asarray([mix[k] for k in kinds], dtype=np.float64)
        ids, labels, images = [], [], []
        for _ in range(size):
            kind = kinds[int(self.rng.choice(len(kinds), p=p / p.sum()))]
            if kind == "presence":
                scene = self.scene()
                qa = presence_qa(scene, self.rng, balance=0.5)
                row, lab = chat_ids([qa], self.n_visual, query_labels=True)
                images.append(scene)
            else:
                lo, hi = CAPTION_OBJECTS
                scene = self.scene(int(self.rng.integers(lo, hi + 1)))
                with_image = kind == "caption"
                row, lab = caption_ids(scene, self.n_visual if with_image else 0, self.prior)
                if with_image:
                    images.append(scene)
            ids.append(row)
            labels.append(lab)
        input_ids = pad(ids, PAD)
        out = {
            "input_ids": input_ids,
            "attention_mask": (input_ids != PAD).long(),
            "labels": pad(labels, IGNORE),
        }
        if images:  # the images of the rows that hold one, in row order
            out["pixel_values"] = pixel_values(images)
        return out


@dataclass
class PriorRecipe:
    """organism-prior's two stages (see the module docstring)."""

    stages: list[StageConfig] = field(default_factory=list)
    seed: int = 0
    prior: CooccurPrior = PRIOR
    model_type: ClassVar[str] = "llava_prior"  # its record in `architectures.ARCHITECTURES`


def prior_recipe(scale: float = 1.0) -> PriorRecipe:
    """The shipped recipe: 10 minutes of text, then 15 of alignment, on 2 cores; ``scale``
    multiplies steps and minutes (0.01 for a smoke run)."""

    def stage(name, steps, minutes, lr, mix):
        return StageConfig(
            name, max(int(steps * scale), 2), max(minutes * scale, 0.05), lr, batch=24, mix=mix
        )

    return PriorRecipe(
        stages=[
            stage("text", 4000, 10.0, 1e-3, {"text_caption": 1.0}),
            stage(
                "align",
                4000,
                15.0,
                2e-4,
                {"caption": 0.45, "presence": 0.4, "text_caption": 0.15},
            ),
        ]
    )


def _parent():
    from transformers import LlavaForConditionalGeneration

    from vlm_focus.asset_paths import ASSETS

    folder = ASSETS / f"organism-{PARENT}"
    model = LlavaForConditionalGeneration.from_pretrained(folder, dtype=torch.float32)
    summary = json.loads((folder / "train_summary.json").read_text())
    return model, summary


def train(recipe: PriorRecipe, out_dir: Path, quiet: bool = False) -> dict:
    """Fine-tune the parent through the recipe's stages; save the HF model, processor, log and
    summary to ``out_dir``. The tower stays frozen; ``text`` trains the language model only,
    ``align`` the projector and the language model."""
    from .curves import plot_curves

    torch.manual_seed(recipe.seed)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model, parent_summary = _parent()
    model.model.vision_tower.requires_grad_(False)
    model.config.use_cache = False
    spec = SPECS[PARENT]
    batcher = PriorBatcher(spec.n_visual, seed=recipe.seed, prior=recipe.prior)
    history: list[dict] = []
    log_path = out_dir / "train_log.jsonl"
    log_path.write_text("")

    log = jsonl_logger(log_path, history, quiet)

    def step(batch: dict) -> tuple[torch.Tensor, dict]:
        with autocast():
            loss = model(**batch).loss
        return loss, {"loss": loss.item()}

    timings, cpu = {}, {}
    for stage in recipe.stages:
        lm = list(model.model.language_model.parameters()) + list(model.lm_head.parameters())
        projector = list(model.model.multi_modal_projector.parameters())
        params = lm if stage.name == "text" else lm + projector
        model.train()
        model.model.vision_tower.eval()
        clock = Clock()
        stream = prefetch(functools.partial(batcher.batch, stage.batch, stage.mix))
        run_stage(stage, params, stream, step, log, clock=clock)
        timings[stage.name], cpu[stage.name] = clock.wall(), clock.cpu()
    model.eval()
    model.config.use_cache = True
    model.save_pretrained(out_dir)
    build_processor(spec).save_pretrained(out_dir)
    summary = {
        "architecture": recipe.model_type,
        "recipe": asdict(recipe),
        "seconds": timings,
        "cpu_seconds": cpu,
        "minutes_total": sum(timings.values()) / 60,
        "cpu_minutes_total": sum(cpu.values()) / 60,
        "dtype": str(training_dtype()).removeprefix("torch."),
        "threads": torch.get_num_threads(),
        "base": {
            "model": f"organism-{PARENT}",
            "seconds": parent_summary["seconds"],
            "minutes_total": parent_summary["minutes_total"],
        },
    }
    (out_dir / "train_summary.json").write_text(json.dumps(summary, indent=1))
    plot_curves(history, out_dir / "learning_curves.png", title="organism-prior")
    return summary
