# ruff: noqa: E501  (long markdown lines of the card template)
"""Model card (README.md) of the deep organism, written from its measured metrics."""

from __future__ import annotations

import json
from pathlib import Path

from .card import _f, _ok, training_time
from .scenes import CATEGORIES, COLOURS, RELATION_MARGIN, SHAPES


def deep_bars(m: dict) -> list[tuple[str, str, str, str]]:
    """(bar, target, measured, verdict) rows of the two-hop issue's quality bars."""
    rows = []
    t = m.get("twohop")
    if t:
        rows.append(
            ("two-hop accuracy, unpruned", ">= 90%", _f(t["accuracy"]), _ok(t["accuracy"] >= 0.9))
        )
    pope = m.get("pope")
    if pope:
        low = min(pope[s]["accuracy"] for s in ("random", "popular", "adversarial"))
        text = " / ".join(_f(pope[s]["accuracy"]) for s in ("random", "popular", "adversarial"))
        rows.append(
            (
                "presence POPE accuracy (random / popular / adversarial)",
                ">= 95% each",
                text,
                _ok(low >= 0.95),
            )
        )
    p = m.get("twohop_pruning")
    if p:
        r, f = p["random_layer2_retention"], p["fastv_layer2_retention"]
        rows.append(
            (
                "K = 2, keep 0.11: random retention of two-hop accuracy",
                "<= 85%",
                _f(r),
                _ok(r <= 0.85),
            )
        )
        rows.append(
            (
                "K = 2, keep 0.11: fastv retention of two-hop accuracy",
                ">= 95%",
                _f(f),
                _ok(f >= 0.95),
            )
        )
    lat = m.get("latency")
    if lat:
        rows.append(
            (
                "load + answer one question",
                "< 2 s",
                f"{lat['total_s']:.2f} s",
                _ok(lat["total_s"] < 2),
            )
        )
    return rows


def steps_run(folder: Path) -> dict[str, int]:
    """The last logged step of each stage in ``folder/train_log.jsonl`` (empty without it)."""
    log = folder / "train_log.jsonl"
    steps: dict[str, int] = {}
    if log.is_file():
        for line in log.read_text().splitlines():
            record = json.loads(line)
            if "stage" in record and "step" in record:
                steps[record["stage"]] = max(steps.get(record["stage"], 0), int(record["step"]))
    return steps


def deep_model_card(m: dict, folder: Path) -> str:
    """Markdown card of organism-deep: what it is, the two-hop family, recipe, bars, diagnostics."""
    cfg = json.loads((folder / "config.json").read_text())
    vc, tc = cfg["vision_config"], cfg["text_config"]
    grid = vc["image_size"] // vc["patch_size"]
    summary = json.loads((folder / "train_summary.json").read_text())
    stages = {st["name"]: st for st in summary["recipe"]["stages"]}
    chat = stages["chat"]
    hop_layers = chat.get("hop_layers", [2, 3, 4])
    mix = ", ".join(f"{k} {100 * v:.0f}%" for k, v in chat["mix"].items())
    mix_cl = ", ".join(f"{k} {100 * v:.0f}%" for k, v in stages["cat_last"]["mix"].items())
    lines = [
        "# organism-deep",
        "",
        "The third organism of vlm_focus: a small `LlavaForConditionalGeneration` (CLIP vision tower + Llama "
        "language model) with a deeper, narrower language model, trained from scratch on CPU on procedurally "
        "generated scenes. It exists so that **pruning inside the language model can be measured**: its "
        "two-hop questions need the image again after layer 2, where the other organisms have long finished "
        "reading it. It is a test organism, not a general VLM.",
        "",
        "## Architecture",
        f"- Vision: CLIP, {vc['image_size']} px, patch {vc['patch_size']} -> {grid} x {grid} = {grid * grid} "
        f"visual tokens, {vc['num_hidden_layers']} layers x {vc['hidden_size']}.",
        f"- Language: Llama, {tc['num_hidden_layers']} layers x {tc['hidden_size']}, "
        f"{tc['num_attention_heads']} heads, MLP {tc['intermediate_size']}, vocabulary {tc['vocab_size']} "
        "(word level; every category, position, colour and shape is one token). float32 safetensors.",
        "- Chat format: `<bos>USER: <image>\\n{question} ASSISTANT: {answer}<eos>`.",
        "",
        "## Data",
        f"- The same scenes as the other organisms: 192 x 192, 1-5 non-overlapping objects, {len(COLOURS)} colours x "
        f"{len(SHAPES)} shapes = {len(CATEGORIES)} categories, exact masks and boxes; training seeds >= 10,000,000, "
        "held-out seeds from 9,000,000.",
        "- **Two-hop family** (`vlm_focus.organism.data.two_hop_qa`): a question names an *anchor* object and a "
        "direction, never the object asked about:",
        "  - `What colour is the shape left of the red_circle?` -> `blue`;",
        "  - `What is right of the green_cross?` -> `yellow_square`;",
        "  - `Is the object below the blue_square a triangle?` -> `yes` / `no`;",
        "  - POPE-style `Is the object above the red_circle a blue_square?` -> `yes` / `no`, false ones naming "
        "another object of the scene (adversarial), a frequent absent category (popular) or any absent one "
        "(random).",
        f"- An object lies *left of* the anchor when its centre lies in the 90-degree cone opening leftwards from "
        f"the anchor's centre, by a margin: (offset along the direction) - (offset across it) >= {RELATION_MARGIN} "
        f"px; it clearly does not when that difference is <= -{RELATION_MARGIN} px. A question is asked only "
        "when exactly one other object lies in the cone and no other object is too close to its border to call "
        "(`scenes.two_hop_target`), so every answer is unique. The target depends on the anchor's position: it "
        "need not be the leftmost object of the scene (it is, though, the object furthest that way from the "
        "anchor in most held-out questions; see the notes).",
        "- Also presence questions (`Is there a red_circle in the image?`, half with LLaVA's POPE suffix) and "
        "`Where is the red_circle?`. No relation (`Is the A left of the B?`) or caption turns.",
        "",
        "## Recipe (`vlm-focus organism train --model deep`)",
        "1. Dense vision pretraining of the tower (as for the other organisms), then frozen.",
        f"2. Category-last curriculum, 6-8 packed questions per image ({mix_cl}); the answer follows the question.",
        f"3. Standard chat template, one turn per image ({mix}); "
        f"{100 * chat.get('cat_last_share', 0):.0f}% of the rows stay in the packed form; the copy head "
        f"(weight {chat.get('copy_weight', 0):g}) and query-token labels of the default recipe for presence and where.",
        f"- {100 * chat.get('hide_share', 0):.0f}% of the rows hide a random 50-100% of the visual tokens that no "
        "answer of the row needs (anchor and hop-2 object stay visible).",
        f"- Two-hop circuit (weight {chat.get('hop_weight', 0):g}, both language stages; `train.hop_loss`): each "
        "category token holds its object's centre after layer 0; in layer "
        f"{hop_layers[0] - 1} head 3 attends from the answer position to the anchor's token, and after it that "
        "position holds the anchor's centre and the direction asked; in layers "
        f"{', '.join(str(k) for k in hop_layers)} head 4 puts its attention, from the answer position, on the hop-2 "
        "object's patches. Centres and directions are read by linear heads used only in training; the shipped "
        "model is a plain `LlavaForConditionalGeneration`.",
        "- Budgets per stage (wall-clock minutes, learning rate): "
        + ", ".join(f"{n} {st['minutes']:g} / {st['lr']:g}" for n, st in stages.items())
        + ". AdamW, cosine with warm-up, bf16 autocast, two CPU threads plus one data process. Layers are counted from 0: pruning at K = 2 prunes "
        "before layer 2, so it reaches the hop-2 read.",
        training_time(summary) + ".",
        "- Steps run (of the step budget): "
        + ", ".join(
            f"{n} {ran:,} of {stages[n]['steps']:,}" for n, ran in steps_run(folder).items()
        )
        + "; a stage that reaches its minute budget first ends early.",
        "",
        "![learning curves](learning_curves.png)",
        "",
        "## Quality bars (held-out set, greedy decoding, standard chat template)",
        "",
        "| bar | target | measured | verdict |",
        "|---|---|---|---|",
    ]
    total = summary["minutes_total"]
    lines += [f"| {a} | {b} | {c} | {d} |" for a, b, c, d in deep_bars(m)]
    lines.append(
        f"| training wall clock, 2 CPU cores | <= 60 min | {total:.1f} min | {_ok(total <= 60)} |"
    )
    t = m.get("twohop")
    if t:
        lines += [
            "",
            f"### Two-hop accuracy ({t['n']} held-out questions, the three forms in turn; the first generated word must be the answer)",
            "",
            "| form | n | accuracy | always the commonest answer |",
            "|---|---|---|---|",
        ]
        for form, r in t["per_form"].items():
            lines.append(
                f"| {form} | {r['n']} | {_f(r['accuracy'])} | {_f(r['majority_baseline'])} |"
            )
        ex = t["examples"][0]
        lines += ["", f"Example: `{ex['question']}` -> `{ex['model']}` (truth `{ex['answer']}`)."]
    tp = m.get("twohop_pope")
    if tp:
        lines += [
            "",
            "### Two-hop POPE-style yes/no (`Is the object above the red_circle a blue_square?`)",
            "",
            "| split | n | accuracy | precision | recall | F1 | yes-ratio |",
            "|---|---|---|---|---|---|---|",
        ]
        for split, r in tp.items():
            lines.append(
                f"| {split} | {r['n']} | {_f(r['accuracy'])} | {_f(r['precision'])} | {_f(r['recall'])} | "
                f"{_f(r['f1'])} | {_f(r['yes_ratio'])} |"
            )
    pope = m.get("pope")
    if pope:
        lines += [
            "",
            "### Presence POPE (500 images with >= 3 objects, 3,000 questions per split, no prompt suffix)",
            "",
            "| split | accuracy | precision | recall | F1 | yes-ratio | unparseable |",
            "|---|---|---|---|---|---|---|",
        ]
        for split in ("random", "popular", "adversarial"):
            r = pope[split]
            lines.append(
                f"| {split} | {_f(r['accuracy'])} | {_f(r['precision'])} | {_f(r['recall'])} | "
                f"{_f(r['f1'])} | {_f(r['yes_ratio'])} | {r['unparseable']} |"
            )
    if m.get("where"):
        w = m["where"]
        lines += [
            "",
            f"Where ({w['n']} questions): accuracy {_f(w['accuracy'])} (commonest position: {_f(w['majority_baseline'])}).",
        ]
    d = m.get("twohop_diagnostics")
    if d:
        lines += [
            "",
            f"## Where the image is read again: per-layer diagnostics ({d['n']} held-out two-hop questions)",
            "",
            "At the answer position (the last prompt token), after each layer: the logit lens (final norm + "
            "lm_head, argmax over the form's candidate answers), and that position's attention on the hop-2 "
            "object's patches (the object the question never names) and on the anchor's patches, as mass "
            "(head mean; best head) and as the hop-2 object's share of the attention on image tokens. "
            f"Uniform attention over the image would give the hop-2 object {_f(d['target_patch_share'])} of it.",
            "",
            "| layer | logit lens | hop-2 mass (head mean) | hop-2 mass (best head) | hop-2 share of image attention | anchor mass (head mean) |",
            "|---|---|---|---|---|---|",
        ]
        for r in d["per_layer"]:
            lines.append(
                f"| {r['layer']} | {_f(r['logit_lens_accuracy'])} | {_f(r['target_mass_head_mean'])} | "
                f"{_f(r['target_mass_best_head'])} (head {r['best_head']}) | "
                f"{_f(r['target_share_of_image_mass'])} | {_f(r['anchor_mass_head_mean'])} |"
            )
    lens = m.get("logit_lens")
    if lens and "presence" in lens:
        lines += [
            "",
            "Presence, for contrast (logit lens at the last prompt token, yes vs no): "
            + ", ".join(f"layer {r['layer']} {_f(r['accuracy'])}" for r in lens["presence"])
            + ".",
        ]
    p = m.get("twohop_pruning")
    if p:
        lines += [
            "",
            f"## Pruning through `vlm_focus.wrap` (two-hop, keep {p['keep']}, query `{p['query']}`, {p['n']} questions)",
            "",
            "| K | fastv | random |",
            "|---|---|---|",
        ]
        for k in (2, 4):
            lines.append(
                f"| {k} | {_f(p[f'fastv_layer{k}_accuracy'])} ({_f(p[f'fastv_layer{k}_retention'])} kept) | "
                f"{_f(p[f'random_layer{k}_accuracy'])} ({_f(p[f'random_layer{k}_retention'])} kept) |"
            )
        lines += [
            "",
            f"Unpruned: {_f(p['full_accuracy'])}. Every pruner at K = 2 and K = 4: "
            "`benchmarks/results/pruner_quality_deep_layer2.md` and `..._layer4.md`.",
        ]
    if m.get("latency"):
        lat = m["latency"]
        lines += ["", f"Load + one answer: {lat['total_s']:.2f} s (load {lat['load_s']:.2f} s)."]
    if m.get("notes"):
        lines += ["", "## Notes and shortfalls", ""] + [f"- {n}" for n in m["notes"]]
    lines += [
        "",
        "## Intended use",
        "Measuring pruning inside the language model (FastV's K = 2, PyramidDrop's stages, debiasing) offline on "
        "CPU. Not a general VLM: it answers only about its own scene vocabulary.",
        "",
        "## Reproduce",
        "```",
        "vlm-focus organism train --model deep --out runs/deep",
        "vlm-focus organism eval --path runs/deep --out runs/deep/metrics.json",
        "vlm-focus organism ship --path runs/deep --name deep --metrics runs/deep/metrics.json",
        "```",
        "Measured on a 2-core CPU; the numbers above come from `metrics.json` in this folder.",
    ]
    return "\n".join(lines) + "\n"
