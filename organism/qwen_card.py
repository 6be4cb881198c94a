"""The model card of organism-qwen: architecture, data, recipe, training time and quality bars."""

from __future__ import annotations

import json
from pathlib import Path

from . import qwen_data as q
from .clips import CLIP_SIZE, FRAMES, GROUPS
from .vocab import QWEN_VOCAB

#: (bar, target, metrics key path, threshold): the issue's quality bars on held-out data.
BARS = (
    ("presence POPE accuracy (mean of 3 splits)", ">= 95%", ("pope", "accuracy"), 0.95),
    ("relations accuracy", ">= 90%", ("relations", "accuracy"), 0.90),
    ("video questions accuracy", ">= 85%", ("video", "accuracy"), 0.85),
)
MAX_MB, MAX_MINUTES = 25.0, 60.0


def _get(m: dict, path: tuple[str, ...]):
    for key in path:
        m = m.get(key, {}) if isinstance(m, dict) else {}
    return m if isinstance(m, (int, float)) else None


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def bars(
    metrics: dict, summary: dict, megabytes: float, table: tuple = BARS
) -> list[tuple[str, str, str, str]]:
    """(bar, target, measured, verdict) rows: the quality bars of `table` (as :data:`BARS`),
    then the size and the training time."""
    rows = []
    for name, target, path, threshold in table:
        value = _get(metrics, path)
        met = value is not None and value >= threshold
        rows.append((name, target, _pct(value), "met" if met else "**not met**"))
    minutes = summary["seconds"] / 60
    rows.append(
        (
            "size (model.safetensors)",
            f"<= {MAX_MB:.0f} MB",
            f"{megabytes:.2f} MB",
            "met" if megabytes <= MAX_MB else "**not met**",
        )
    )
    rows.append(
        (
            "training on 2 cores",
            f"<= {MAX_MINUTES:.0f} min",
            f"{minutes:.1f} min",
            "met" if minutes <= MAX_MINUTES else "**not met**",
        )
    )
    return rows


_CARD = """# organism-qwen

A small Qwen2.5-VL (`Qwen2_5_VLForConditionalGeneration`: window-attention vision tower, 2 x 2
merger, M-RoPE language model) trained from scratch on CPU through its real processor
(`Qwen2_5_VLProcessor`), on organism scenes at dynamic resolution and on short clips of moving
objects. It is a **test organism** for vlm_focus: the Qwen-class model that pruning, video
budgets and grounding are measured on offline. It knows nothing beyond its scenes.

## Architecture
- Vision: patch 14, temporal patch 2, merge 2 x 2 (one token per 28 x 28 px),
  {vision_layers} layers x {vision_hidden} (MLP {vision_mlp}), 112 px windows, the last layer
  global.
- Language: Qwen2, {text_layers} layers x {text_hidden}, {text_heads} heads ({text_kv_heads}
  key/value), MLP {text_mlp}, M-RoPE sections {text_mrope} of base {rope_theta:g} (at 10000
  the column section turns too little across an image to tell left from right), tied
  embeddings, vocabulary {vocab} (word level; every category is one token).
- {params:,} parameters, stored in bfloat16 ({megabytes:.2f} MB) with a float32 config, so
  `from_pretrained` computes in float32.
- Chat format (ChatML): `<|im_start|>user\\n<|vision_start|><|image_pad|><|vision_end|>{{question}}
  <|im_end|>\\n<|im_start|>assistant\\n{{answer}}<|im_end|>`.

## Data
- Images: organism scenes drawn at {sides} px, cropped to a rectangle of sides {min_side}-280
  px (multiples of 28) that keeps every object whole: token grids of 5 x 5 to 10 x 10, of many
  aspect ratios.
- Clips: {frames} frames of {clip} x {clip} px ({groups} temporal patches of 7 x 7 tokens),
  2-3 objects moving in straight lines (at most 3 px per frame), each on screen from a distinct
  temporal patch until a later one or the end.
- Questions: presence (`Is there a red_circle in the image?`, half with the POPE suffix),
  relations (`Is the red_circle left of the blue_square?`); on clips `Which object appears first
  in the video?`, `At the start of the video, is there a red_circle?`, `At the end of the
  video, ...` and `Describe the video.` (the objects in the order they appear:
  `red_circle , blue_square`).
- Training seeds from {train_seed:,}; held-out seeds from {heldout_seed:,}.

## Recipe (`vlm-focus organism train --model qwen`)
1. `vision`: tower + merger with a per-token head (category or background, background weighted
   0.3; the object's shape on its own; the token's place), on images and clips. Then tower and
   merger are frozen and each category token's embedding starts at the mean merged feature of
   its category.
2. `presence`: the LM on 6-8 packed category-last presence questions per image (no clips), the
   lookup a from-scratch LM learns first.
3. `cat_last`: the LM on 8-10 packed category-last questions per row, each answer right after
   its question (clip questions weighted {cat_last_video_mix}).
4. `chat`: one question per row in the chat template; the answer is also the target right
   after the question's last category token; {cat_last_share}% of the rows stay category-last.
- In the language stages, auxiliary losses spell out the circuits that relations and "at the
  start / end" need (`qwen_train.CircuitProbe`; linear read-outs, not shipped). The tower knows
  only relative places, so after layer 0 each image token holds its own row and column and
  each clip token its temporal patch, found through M-RoPE; the relation hops of the LLaVA
  organisms (`losses.relation_loss`) follow one layer later: after layer 1 each category token
  that names an object holds its centre, in layer 2 head 1 attends from a relation's second
  category token to its first, which then holds the first object's centre and the relation
  asked. After layer 1 a start / end question's category token also holds the temporal
  patches its object is on screen in. In the chat stage head 0 of layers 2-3 attends from the
  position that answers to the question's last category token (`losses.copy_loss`), which
  carries the answer that the category-last form computes there.
- Rows: {video_share}% clips; image questions {image_mix}; clip questions in the chat stage
  {video_mix}. AdamW, cosine with warm-up,
  {threads} CPU thread(s) for the model plus one data process.
- Steps and time: {steps}; in all {minutes:.1f} minutes wall-clock, {cpu_minutes:.1f} CPU
  minutes of the training process.{vision_note}

## Quality bars (held-out, greedy decoding, chat template)

"""


def model_card(name: str, metrics: dict, folder: Path) -> str:
    """organism-qwen's card (README.md) from its metrics and the run saved in ``folder``;
    ``name`` is the shipped name, "qwen"."""
    summary = json.loads((folder / "train_summary.json").read_text())
    megabytes = (folder / "model.safetensors").stat().st_size / 1e6
    steps = ", ".join(
        f"{n} {s['steps_run']} steps in {s['seconds'] / 60:.1f} min"
        for n, s in summary["stages"].items()
    )
    config = json.loads((folder / "config.json").read_text())
    head = _CARD.format(
        rope_theta=config["text_config"]["rope_parameters"]["rope_theta"],
        **summary["spec"],
        vocab=len(QWEN_VOCAB),
        params=summary["params"],
        megabytes=megabytes,
        sides=", ".join(map(str, q.IMAGE_SIDES)),
        min_side=q.MIN_SIDE,
        frames=FRAMES,
        clip=CLIP_SIZE,
        groups=GROUPS,
        train_seed=q.TRAIN_SEED_BASE,
        heldout_seed=q.HELDOUT_SEED_BASE,
        cat_last_share=round(100 * summary["cat_last_share"]),
        video_share=round(100 * summary["video_share"]),
        image_mix=summary["image_mix"],
        video_mix=summary["video_mix"],
        cat_last_video_mix=summary["cat_last_video_mix"],
        threads=summary["threads"],
        steps=steps,
        minutes=summary["seconds"] / 60,
        cpu_minutes=summary["cpu_seconds"] / 60,
        vision_note=(
            " The language stages ran in a second process from the vision stage's saved state"
            " (`QwenRecipe.vision_from`); the vision stage's time is its own run's."
            if summary.get("vision_from_earlier_run")
            else ""
        ),
    )
    table = ["| bar | target | measured | verdict |", "|---|---|---|---|"]
    table += [f"| {a} | {b} | {c} | {d} |" for a, b, c, d in bars(metrics, summary, megabytes)]
    return head + "\n".join([*table, "", *_details(metrics)])


def pope_rows(pope: dict) -> list[str]:
    """The card's POPE section: a heading and one row per split of the ``pope`` metrics."""
    rows = [
        "### POPE (held-out crops with >= 3 objects, no prompt suffix)",
        "",
        "| split | accuracy | precision | recall | F1 | yes-ratio |",
        "|---|---|---|---|---|---|",
    ]
    keys = ("accuracy", "precision", "recall", "f1", "yes_ratio")
    for split in ("random", "popular", "adversarial"):
        s = pope.get(split, {})
        rows.append(f"| {split} | " + " | ".join(_pct(s.get(k)) for k in keys) + " |")
    return rows


def video_rows(metrics: dict) -> list[str]:
    """The card's video lines: the clip questions per kind, then the captions."""
    video, captions = metrics.get("video", {}), metrics.get("video_captions", {})
    return [
        f"Video ({video.get('n', 0)} clips, one question each): which first"
        f" {_pct(video.get('first_accuracy'))}, at the start {_pct(video.get('start_accuracy'))},"
        f" at the end {_pct(video.get('end_accuracy'))}.",
        "",
        f"Video captions ({captions.get('n', 0)} clips): object precision"
        f" {_pct(captions.get('precision'))}, recall {_pct(captions.get('recall'))}, the objects"
        f" in the right order {_pct(captions.get('exact_order'))}.",
        "",
    ]


def _details(metrics: dict) -> list[str]:
    rows = pope_rows(metrics.get("pope", {}))
    relations = metrics.get("relations", {})
    return [
        *rows,
        "",
        f"Relations: {_pct(relations.get('accuracy'))} of {relations.get('n', 0)} questions.",
        "",
        *video_rows(metrics),
        "Re-measure: `vlm-focus organism eval --path vlm_focus/assets/organism-qwen`.",
        "",
    ]
