"""organism-prior's measurements: its bars and the premise checks that a mitigation's premise
holds on it (and not on its parent), on held-out probe scenes that hold an anchor without its
companion (`scenes.cooccur_probe_scenes`, seeds from 9,700,000).

- **Anchor paint-out:** the share of yes to "Is there a {companion}?" with the anchor in the
  image and with the anchor painted out (the same scene rendered without it); and the share of
  captions naming the absent companion, both ways. If the prior acts through what the model
  sees, painting out the anchor lowers both.
- **Text-only branch:** with no image, after a caption prefix that names an anchor (``there is a
  {anchor} in the {position} of the image . there is a``), the probability that the next token
  is its companion, against the mean of the categories in no pair; and the same prefix with the
  probe image, which holds no companion.
- **Attention along the caption:** the share of each caption token's attention (mean over
  layers and heads) that lands on image tokens, by position in the caption.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import torch

from .answering import answer, pope_rows, yes_no
from .prior import PRIOR
from .scenes import (
    CATEGORIES,
    COOCCUR_HELDOUT_SEED_BASE,
    Scene,
    cooccur_probe_scenes,
    heldout_scenes,
    unmet_companions,
)
from .vocab import BOS, CAPTION_PROMPT, IMAGE, TOKEN_ID, encode, presence_question

CAPTION_TOKENS = 64
PROBE_IMAGES = 150


def probe_scenes(n: int = PROBE_IMAGES) -> list[Scene]:
    return cooccur_probe_scenes(COOCCUR_HELDOUT_SEED_BASE, n, PRIOR)


def painted_out(scene: Scene) -> Scene:
    """The scene without the anchors whose companion is absent (same seed, background and the
    other objects where they were)."""
    anchors = {i for i, _ in unmet_companions(scene, PRIOR)}
    objects = [o for i, o in enumerate(scene.objects) if i not in anchors]
    return dataclasses.replace(scene, objects=objects, _image=None)


def companion_questions(scenes: list[Scene]) -> tuple[list[Scene], list[str]]:
    """One question per (scene, absent companion)."""
    out_s, out_q = [], []
    for s in scenes:
        for c in sorted({c for _, c in unmet_companions(s, PRIOR)}):
            out_s.append(s)
            out_q.append(presence_question(CATEGORIES[c]))
    return out_s, out_q


def control_questions(scenes: list[Scene], seed: int = 5) -> tuple[list[Scene], list[str]]:
    """As many questions about absent categories in no pair (the control)."""
    rng = np.random.default_rng(seed)
    paired = {c for p in PRIOR.pairs for c in p}
    out_s, out_q = [], []
    for s in scenes:
        free = [c for c in range(len(CATEGORIES)) if c not in paired and c not in s.categories]
        for _ in unmet_companions(s, PRIOR)[:1] or []:
            out_s.append(s)
            out_q.append(presence_question(CATEGORIES[int(rng.choice(free))]))
    return out_s, out_q


def yes_rate(model, processor, scenes: list[Scene], questions: list[str]) -> float:
    rows = pope_rows(scenes, questions, ["no"] * len(questions))
    return float(yes_no(model, processor, rows, scenes).scores()["yes_ratio"])


def companion_named(scenes: list[Scene], captions: list[str], anchors: list[Scene]) -> float:
    """Share of captions naming an absent companion of an anchor of the matching scene in
    ``anchors`` (the unpainted scene)."""
    named = 0
    for cap, s in zip(captions, anchors, strict=True):
        words = set(cap.split())
        named += any(CATEGORIES[c] in words for _, c in unmet_companions(s, PRIOR))
    return named / max(len(captions), 1)


def _prefix_ids(scene: Scene, anchor: int, n_visual: int) -> list[int]:
    """Chat prompt (with or without the image) and a caption prefix ending right after the
    anchor's sentence and ``there is a``."""
    ids = [BOS, *encode("USER:"), *([IMAGE] * n_visual), *encode(CAPTION_PROMPT)]
    ids += encode("ASSISTANT:")
    o = scene.objects[anchor]
    ids += encode(f"there is a {o.name} in the {o.position(scene.size)} of the image . there is a")
    return ids


@torch.no_grad()
def next_after_anchor(model, scenes: list[Scene], with_image: bool) -> dict:
    """Mean probability of the companion as the next category after its anchor's sentence,
    against the mean over categories in no pair."""
    from .data import pixel_values

    n_visual = model.config.image_seq_length if with_image else 0
    paired = {c for p in PRIOR.pairs for c in p}
    free_ids = [TOKEN_ID[c] for i, c in enumerate(CATEGORIES) if i not in paired]
    comp, free = [], []
    for s in scenes:
        for anchor, c in unmet_companions(s, PRIOR)[:1]:
            ids = torch.tensor([_prefix_ids(s, anchor, n_visual)])
            kwargs = {"pixel_values": pixel_values([s])} if with_image else {}
            probs = model(input_ids=ids, **kwargs).logits[0, -1].float().softmax(-1)
            comp.append(float(probs[TOKEN_ID[CATEGORIES[c]]]))
            free.append(float(probs[free_ids].mean()))
    return {"companion": float(np.mean(comp)), "unpaired_mean": float(np.mean(free))}


@torch.no_grad()
def attention_along_caption(model, processor, scenes: list[Scene], captions: list[str]) -> dict:
    """Share of each caption token's attention on the image tokens (mean over layers, heads
    and scenes), by caption token index; and its mean in the first and second half."""
    from .data import pixel_values

    n_visual = model.config.image_seq_length
    prompt = [BOS, *encode("USER:"), *([IMAGE] * n_visual), *encode(CAPTION_PROMPT)]
    prompt += encode("ASSISTANT:")
    implementation = model.config._attn_implementation
    model.set_attn_implementation("eager")
    sums = np.zeros(CAPTION_TOKENS)
    counts = np.zeros(CAPTION_TOKENS)
    try:
        for s, cap in zip(scenes, captions, strict=True):
            words = encode(cap)[:CAPTION_TOKENS]
            if not words:
                continue
            ids = torch.tensor([prompt + words])
            out = model(input_ids=ids, pixel_values=pixel_values([s]), output_attentions=True)
            att = torch.stack([a[0].float() for a in out.attentions])  # [L, H, T, T]
            start = ids[0].tolist().index(IMAGE)
            rows = att[:, :, len(prompt) - 1 : len(prompt) - 1 + len(words)]  # predict word i
            share = rows[..., start : start + n_visual].sum(-1).mean((0, 1)).numpy()
            sums[: len(share)] += share
            counts[: len(share)] += 1
    finally:
        model.set_attn_implementation(implementation)
    curve = sums / np.maximum(counts, 1)
    valid = counts > 0
    half = int(valid.sum()) // 2
    return {
        "by_position": [round(float(x), 4) for x in curve[valid]],
        "first_half": float(curve[:half].mean()),
        "second_half": float(curve[half : int(valid.sum())].mean()),
    }


def premise(model, processor, n: int = PROBE_IMAGES, captions: bool = True) -> dict:
    """Every premise check on ``n`` held-out probe scenes (captions: 64 greedy tokens)."""
    scenes = probe_scenes(n)
    painted = [painted_out(s) for s in scenes]
    qs, qq = companion_questions(scenes)
    ps = [painted_out(s) for s in qs]
    cs, cq = control_questions(scenes)
    out = {
        "images": n,
        "yes_companion_with_anchor": yes_rate(model, processor, qs, qq),
        "yes_companion_anchor_painted_out": yes_rate(model, processor, ps, qq),
        "yes_control": yes_rate(model, processor, cs, cq),
        "text_only_next": next_after_anchor(model, scenes, with_image=False),
        "with_image_next": next_after_anchor(model, scenes, with_image=True),
    }
    if captions:
        caps = answer(model, processor, scenes, [CAPTION_PROMPT] * n, CAPTION_TOKENS)
        caps_painted = answer(model, processor, painted, [CAPTION_PROMPT] * n, CAPTION_TOKENS)
        out["caption_companion_with_anchor"] = companion_named(scenes, caps, scenes)
        out["caption_companion_anchor_painted_out"] = companion_named(painted, caps_painted, scenes)
        out["attention_along_caption"] = attention_along_caption(model, processor, scenes, caps)
        out["examples"] = [{"image_id": s.seed, "caption": c} for s, c in zip(scenes[:3], caps)]
    return out


def caption_quality(model, processor, n: int = 200) -> dict:
    """Object recall and precision of 64-token captions on held-out scenes (not probe
    scenes) and their mean length in tokens."""
    scenes = heldout_scenes(n)
    caps = answer(model, processor, scenes, [CAPTION_PROMPT] * n, CAPTION_TOKENS)
    found = total = named = correct = 0
    lengths = []
    for s, cap in zip(scenes, caps, strict=True):
        words = cap.split()
        lengths.append(len(encode(cap)))
        said = [w for w in words if w in CATEGORIES]
        present = {o.name for o in s.objects}
        named += len(said)
        correct += sum(w in present for w in said)
        found += len(present & set(said))
        total += len(present)
    return {
        "object_recall": found / max(total, 1),
        "object_precision": correct / max(named, 1),
        "mean_tokens": float(np.mean(lengths)),
        "n": n,
        "examples": [{"image_id": s.seed, "caption": c} for s, c in zip(scenes[:3], caps)],
    }


def evaluate(path: Path, n_images: int = 500, only: list[str] | None = None) -> dict:
    """POPE on the shipped held-out set, caption quality and the premise checks of the model
    at ``path``, and of its parent (organism-deep) for the checks that apply to it."""
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    from vlm_focus.asset_paths import deep_model_path

    from .evaluate import pope_eval

    def load(folder):
        model = LlavaForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
        return model, AutoProcessor.from_pretrained(folder)

    model, processor = load(path)
    todo = only or ["pope", "captions", "premise", "parent"]
    out: dict = {"model": str(path)}
    if "pope" in todo:
        out["pope"] = pope_eval(model, processor, n_images)
    if "captions" in todo:
        out["captions"] = caption_quality(model, processor)
    if "premise" in todo:
        out["premise"] = premise(model, processor)
    if "parent" in todo:  # the parent never learned captions: its yes/no and text-only checks
        parent, parent_processor = load(deep_model_path())
        out["parent_premise"] = premise(parent, parent_processor, captions=False)
    summary = Path(path) / "train_summary.json"
    if summary.is_file():
        out["train_summary"] = json.loads(summary.read_text())
    return out
