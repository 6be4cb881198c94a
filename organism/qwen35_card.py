"""The model card of organism-qwen35: architecture, data, recipe, training time and quality bars
(organism-qwen's bars and table, :func:`.qwen_card.bars`)."""

from __future__ import annotations

import json
from pathlib import Path

from . import qwen_data as q
from .clips import CLIP_SIZE, FRAMES, GROUPS
from .qwen_card import _pct, bars, pope_rows, video_rows

#: (bar, target, metrics key path, threshold): the bars on held-out data.
BARS = (
    ("presence POPE accuracy (mean of 3 splits)", ">= 95%", ("pope", "accuracy"), 0.95),
    ("two-hop accuracy", ">= 90%", ("two_hop", "accuracy"), 0.90),
    # organism-qwen's video bar: the video pruning default is measured on both Qwen organisms
    ("video questions accuracy", ">= 85%", ("video", "accuracy"), 0.85),
)

_CARD = """# organism-qwen35

A small Qwen3.5 (`Qwen3_5ForConditionalGeneration`: Qwen3-VL-style vision tower with learned
position embeddings, 2 x 2 merger, and the **hybrid decoder**: Gated-DeltaNet
`linear_attention` layers with a `full_attention` layer every fourth) trained from scratch on
CPU through its real processor (`Qwen3VLProcessor`), on organism scenes at dynamic
resolution with presence and two-hop questions, and on organism-qwen's clips of moving objects.
It is a **test organism** for vlm_focus: the hybrid-decoder model that in-LLM pruning is
measured on offline (the two-hop questions need more than the first layers), on images and
clips. It knows nothing beyond its scenes.

## Architecture
- Vision: patch 14 (Qwen3.5's is 16; 14 keeps organism-qwen's 28 px tokens, crops and
  labels), temporal patch 2, merge 2 x 2, {vision_layers} layers x {vision_hidden} (MLP
  {vision_mlp}), a learned {vision_positions}-entry position grid resampled to each image.
- Language: {text_layers} layers, `{layer_types}`; width {text_hidden}, MLP {text_mlp};
  full attention {text_heads} heads ({text_kv_heads} key/value) of {text_head_dim}, output
  gate, M-RoPE (interleaved, sections {text_mrope}, base {rope_theta:g}, rotary share
  {rotary}); Gated-DeltaNet {linear_heads} key/value heads of {linear_head_dim}; tied
  embeddings, vocabulary {vocab} (organism-qwen's words and the words of the processor's frame
  timestamps, `<1.2 seconds>`, digit by digit).
- {params:,} parameters, stored in bfloat16 ({megabytes:.2f} MB) with a float32 config.
- Chat format (ChatML, as organism-qwen's).

## Data
- Images: organism-qwen's crops ({sides} px scenes cropped to sides of {min_side}-280 px,
  multiples of 28, every object whole): token grids of 5 x 5 to 10 x 10.
- Clips (organism-qwen's): {frames} frames of {clip} x {clip} px at 2 fps ({groups} temporal
  patches of 7 x 7 tokens, each after its timestamp), 2-3 objects moving in straight lines,
  each on screen from a distinct temporal patch until a later one or the end.
- Questions: presence (`Is there a red_circle in the image?`) and the two-hop family
  (`What colour is the shape left of the red_circle?`, `What is below the blue_square?`,
  `Is the object right of the green_cross a triangle?`, `Is the object above the red_circle a
  blue_square?`), weighted {image_mix}; on clips `Which object appears first in the video?`,
  `At the start / end of the video, is there a red_circle?` and `Describe the video.`,
  weighted {video_mix} in the chat stage and {cat_last_video_mix} category-last.
- Training seeds from {train_seed:,}; held-out seeds from {heldout_seed:,}.

## Recipe (`python -m organism train --model qwen35`)
organism-qwen's four stages (`qwen_train`): `vision` (tower + merger with a per-token head,
then frozen; category embeddings start at their mean merged feature), `presence` (packed
category-last presence questions), `cat_last` (the task mix, packed category-last), `chat`
(one question per row in the chat template, the answer also taught at the question's last
word; {cat_last_share}% of rows stay category-last). Clips are {video_share}% of the vision
stage's media and {stage_video} of the language stages' batches (each batch all clips or all
images, so that an image batch is not padded to a clip's length). The DeltaNet layers have no
attention maps to supervise, so the circuit follows the full-attention layers: the first one
looks up the object a question names (one head, from that category token, puts its mass on the
object's tokens: `losses.look_loss`); the last one reads the hop-2 object from the position
that answers (`losses.read_hop_loss`; that position holds the anchor's centre and the direction
at the layer's input) and copies a chat answer from its question's category token
(`losses.copy_loss`); the image tokens' and the anchor's places are read from hidden states.
Layer 0 has no RoPE, so each clip token's temporal patch is read after the first
full-attention layer (its M-RoPE sees each frame group's place), and after the linear layer
that follows a start / end question's category token holds the patches its object is on screen
in (`qwen_train._time_layer`). The vision stage may come from an earlier run (`--vision-from
RUN/vision.pt`), counted with its own minutes.
- AdamW, cosine with warm-up, {threads} CPU thread(s) plus one data process. The DeltaNet
  layers run transformers' torch fallback (no flash-linear-attention on CPU).
- Steps and time: {steps}; in all {minutes:.1f} minutes wall-clock, {cpu_minutes:.1f} CPU
  minutes of the training process.

## Quality bars (held-out, greedy decoding, chat template)

"""


def model_card(name: str, metrics: dict, folder: Path) -> str:
    """organism-qwen35's card (README.md) from its metrics and the run saved in ``folder``;
    ``name`` is the shipped name, "qwen35"."""
    summary = json.loads((folder / "train_summary.json").read_text())
    megabytes = (folder / "model.safetensors").stat().st_size / 1e6
    steps = ", ".join(
        f"{n} {s['steps_run']} steps in {s['seconds'] / 60:.1f} min"
        for n, s in summary["stages"].items()
    )
    if summary.get("vision_from_earlier_run"):
        steps += " (the vision stage is an earlier run's of this recipe, `--vision-from`)"
    text = json.loads((folder / "config.json").read_text())["text_config"]
    spec = summary["spec"]
    stage_video = ", ".join(
        f"{n} {round(100 * s['mix'].get('video', 0.0))}%"
        for n, s in summary["stages"].items()
        if n != "vision"
    )
    head = _CARD.format(
        **spec,
        layer_types=" ".join(t.split("_")[0] for t in text["layer_types"]),
        rope_theta=text["rope_parameters"]["rope_theta"],
        vocab=text["vocab_size"],
        frames=FRAMES,
        clip=CLIP_SIZE,
        groups=GROUPS,
        video_share=round(100 * summary["video_share"]),
        stage_video=stage_video,
        video_mix=summary["video_mix"],
        cat_last_video_mix=summary["cat_last_video_mix"],
        params=summary["params"],
        megabytes=megabytes,
        sides=", ".join(map(str, q.IMAGE_SIDES)),
        min_side=q.MIN_SIDE,
        image_mix=_image_weights(summary),
        train_seed=q.TRAIN_SEED_BASE,
        heldout_seed=q.HELDOUT_SEED_BASE,
        cat_last_share=round(100 * summary["cat_last_share"]),
        threads=summary["threads"],
        steps=steps,
        minutes=summary["seconds"] / 60,
        cpu_minutes=summary["cpu_seconds"] / 60,
    )
    table = ["| bar | target | measured | verdict |", "|---|---|---|---|"]
    rows = bars(metrics, summary, megabytes, BARS)
    table += [f"| {a} | {b} | {c} | {d} |" for a, b, c, d in rows]
    return head + "\n".join([*table, "", *_details(metrics)])


def _details(metrics: dict) -> list[str]:
    pope, hop = metrics.get("pope", {}), metrics.get("two_hop", {})
    rows = pope_rows(pope)
    forms = hop.get("per_form", {})
    per_form = ", ".join(
        f"{form} {_pct(f.get('accuracy'))} (majority {_pct(f.get('majority_baseline'))})"
        for form, f in forms.items()
    )
    return [
        *rows,
        "",
        f"Two-hop: {_pct(hop.get('accuracy'))} of {hop.get('n', 0)} questions; {per_form}.",
        "",
        *video_rows(metrics),
        "Re-measure: `python -m organism eval --path <model folder>`.",
        "",
    ]


def _image_weights(summary: dict) -> str:
    """The recipe's image question weights, and those of any stage that sets its own."""
    own = {
        n: {k: v for k, v in s["mix"].items() if k != "video"}
        for n, s in summary["stages"].items()
        if n != "vision"
    }
    stages = [f"{n}: {mix}" for n, mix in own.items() if mix and mix != summary["image_mix"]]
    return f"{summary['image_mix']}" + (f" ({'; '.join(stages)})" if stages else "")
