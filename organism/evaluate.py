"""Held-out measurements of a LLaVA-shaped organism (greedy decoding, standard chat template);
the two-hop family's are in :mod:`.evaluate_twohop`, the co-occurrence prior's in
:mod:`.evaluate_cooccur` and organism-qwen's in :mod:`.qwen_eval`, all asked through
:mod:`.answering`.

Every answer comes from the evaluations' :class:`~vlm_focus.eval.generation.Generator`, and every
yes/no question family (POPE, relations, two-hop yes/no, the pruning retention) is answered and
scored by :func:`vlm_focus.eval.pope.evaluate` (the POPE/LLaVA parsing rule and metrics).

- POPE yes/no on the three splits (accuracy, precision, recall, F1, predicted yes-ratio);
- relation questions ("Is the A left of the B?") accuracy;
- captions: object precision (1 - CHAIR_i), recall, CHAIR_s, position accuracy;
- grounding: pointing game of attention at the query's category token, per layer (head mean and
  the best head chosen on the other half of the images), against the other objects and chance;
- logit lens: per layer, the yes/no answer read from the last prompt position (where it forms);
- pruning through `vlm_focus.wrap`: attention-scored (fastv) against random at keep 0.11, and
  pre-LLM pruning scored at the query's category token;
- latency of loading the model and answering one question;
- for a model trained under a co-occurrence prior (organism-cooccur): POPE on probe scenes that
  hold an anchor without its companion, the companion questions against the other absent
  objects (`cooccur_eval`), and CHAIR on their captions;
- for models trained on the two-hop family ("What colour is the shape left of the red_circle?"):
  accuracy per form, POPE-style yes/no, per-layer logit lens and attention on the hop-2 object,
  and pruning retention at K = 2 and K = 4.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import torch

from vlm_focus.config import FocusConfig
from vlm_focus.loading import load_model

from .answering import QUESTION_SEED, answer, model_inputs, pope_rows, yes_no
from .evaluate_cooccur import cooccur_eval
from .evaluate_twohop import (
    fixed_two_hop_eval,
    two_hop_diagnostics,
    two_hop_eval,
    two_hop_pope,
    two_hop_pruning,
)
from .pope import SPLITS, pope_eligible, pope_questions
from .scenes import CATEGORIES, POSITIONS, Scene, generate_scene, heldout_scenes
from .vocab import CAPTION_PROMPT, IMAGE, NO, TOKEN_ID, YES


def relation_set(n: int) -> tuple[list[Scene], list[str], list[str]]:
    """Fixed held-out relation questions: one per multi-object scene, balanced by construction."""
    from .questions import relation_qa

    rng = np.random.default_rng(QUESTION_SEED)
    scenes, questions, labels = [], [], []
    for s in heldout_scenes(2 * n, min_objects=2):
        qa = relation_qa(s, rng)
        if qa is not None:
            scenes.append(s)
            questions.append(qa.question)
            labels.append(qa.answer)
        if len(scenes) == n:
            break
    return scenes, questions, labels


def pope_eval(model, processor, n_images: int) -> dict:
    """POPE metrics per split (no prompt suffix); identical (image, question) pairs are
    answered once."""
    scenes = pope_eligible(n_images)
    rows = [{**r, "split": split} for split in SPLITS for r in pope_questions(scenes, split)]
    result = yes_no(model, processor, rows, scenes)
    out: dict = {split: result.scores(split) for split in SPLITS}
    out["prompt"] = "USER: <image>\\n{question} ASSISTANT: (no suffix)"
    return out


def relation_eval(model, processor, n: int = 400) -> dict:
    scenes, questions, labels = relation_set(n)
    result = yes_no(model, processor, pope_rows(scenes, questions, labels), scenes)
    return result.scores()


def caption_eval(model, processor, n: int = 300) -> dict:
    """Object precision/recall of generated captions against the scene's exact objects."""
    scenes = heldout_scenes(n)
    caps = answer(model, processor, scenes, [CAPTION_PROMPT] * n, max_new_tokens=24)
    mentions = correct = gt_total = gt_found = pos_ok = bad_caps = 0
    lengths = []
    for s, cap in zip(scenes, caps, strict=True):
        words = cap.split()
        lengths.append(len(words))
        named = [w for w in words if w in CATEGORIES]
        present = {o.name: o for o in s.objects}
        mentions += len(named)
        hits = [w for w in named if w in present]
        correct += len(hits)
        bad_caps += len(hits) < len(named)
        gt_total += len(present)
        gt_found += len(set(hits))
        for i, w in enumerate(words[:-1]):
            if w in present and words[i + 1] in POSITIONS:
                pos_ok += words[i + 1] == present[w].position(s.size)
    return {
        "object_precision": correct / max(mentions, 1),
        "object_recall": gt_found / max(gt_total, 1),
        "chair_i": 1 - correct / max(mentions, 1),
        "chair_s": bad_caps / n,
        "position_accuracy": pos_ok / max(correct, 1),
        "mean_length_words": float(np.mean(lengths)),
        "n": n,
        "examples": [{"image_id": s.seed, "caption": c} for s, c in zip(scenes[:5], caps[:5])],
    }


def _patch_centres(grid: int, size: int) -> np.ndarray:
    step = size / grid
    c = (np.arange(grid) + 0.5) * step
    yy, xx = np.meshgrid(c, c, indexing="ij")
    return np.stack([xx.ravel(), yy.ravel()], 1)  # [N, 2] (x, y)


def _in_box(points: np.ndarray, box: tuple[int, int, int, int]) -> np.ndarray:
    x, y, w, h = box
    return (
        (points[:, 0] >= x) & (points[:, 0] < x + w) & (points[:, 1] >= y) & (points[:, 1] < y + h)
    )


@torch.no_grad()
def grounding_eval(model, processor, n: int = 200) -> dict:
    """Pointing game of attention rows at the query's category token (and at the last token).

    For each layer: the head-mean map's argmax patch hits the queried object when its centre lies
    in the object's box; `other` counts argmaxes inside another object's box; `chance` is the
    target box's share of patch centres. The best head is chosen on the even images and scored on
    the odd ones.
    """
    eager = (
        type(model)
        .from_pretrained(model.name_or_path, dtype=torch.float32, attn_implementation="eager")
        .eval()
    )
    rng = np.random.default_rng(QUESTION_SEED + 1)
    scenes = heldout_scenes(n, min_objects=2)
    grid = int(round(np.sqrt(eager.config.image_seq_length)))
    centres = _patch_centres(grid, scenes[0].size)
    n_layers = eager.config.text_config.num_hidden_layers
    n_heads = eager.config.text_config.num_attention_heads
    hits = {k: np.zeros((2, n_layers, n_heads + 1)) for k in ("category", "last")}
    other = {k: np.zeros((2, n_layers, n_heads + 1)) for k in ("category", "last")}
    counts, chance = np.zeros(2), []
    for i, s in enumerate(scenes):
        target = s.objects[int(rng.integers(len(s.objects)))]
        from .vocab import presence_question

        inputs = model_inputs(processor, [s], [presence_question(target.name)])
        out = eager(**inputs, output_attentions=True)
        ids = inputs["input_ids"][0]
        img = (ids == IMAGE).nonzero().squeeze(1)
        q_pos = {
            "category": int((ids == TOKEN_ID[target.name]).nonzero()[-1]),
            "last": len(ids) - 1,
        }
        tbox = _in_box(centres, target.box())
        obox = np.zeros(len(centres), dtype=bool)
        for o in s.objects:
            if o is not target:
                obox |= _in_box(centres, o.box())
        chance.append(tbox.mean())
        half = i % 2
        counts[half] += 1
        for key, pos in q_pos.items():
            for layer, att in enumerate(out.attentions):
                maps = att[0, :, pos, img].float().numpy()  # [H, N]
                maps = np.concatenate([maps, maps.mean(0, keepdims=True)])  # [H+1, N]
                arg = maps.argmax(1)
                hits[key][half, layer] += tbox[arg]
                other[key][half, layer] += obox[arg]
    result: dict = {"n_images": len(scenes), "chance": float(np.mean(chance)), "per_layer": {}}
    for key in hits:
        rows = []
        for layer in range(n_layers):
            best = int(hits[key][0, layer, :n_heads].argmax())
            rows.append(
                {
                    "layer": layer,
                    "head_mean_hit": float(hits[key][:, layer, -1].sum() / counts.sum()),
                    "head_mean_other": float(other[key][:, layer, -1].sum() / counts.sum()),
                    "best_head": best,
                    "best_head_hit_heldout": float(hits[key][1, layer, best] / counts[1]),
                    "best_head_other_heldout": float(other[key][1, layer, best] / counts[1]),
                }
            )
        result["per_layer"][key] = rows
    return result


@torch.no_grad()
def logit_lens(model, processor, kind: str, n: int = 300) -> list[dict]:
    """Per layer, accuracy of yes/no read from the last prompt position through norm + lm_head."""
    from .questions import presence_qa

    if kind == "relation":
        scenes, questions, labels = relation_set(n)
    else:
        rng = np.random.default_rng(QUESTION_SEED + 2)
        scenes = heldout_scenes(n)
        qas = [presence_qa(s, rng, positive=i % 2 == 0) for i, s in enumerate(scenes)]
        questions = [q.question for q in qas]
        labels = [q.answer for q in qas]
    lm = model.model.language_model
    captured: list[torch.Tensor] = []
    hooks = [
        layer.register_forward_hook(
            lambda _m, _i, o: captured.append(o[0] if isinstance(o, tuple) else o)
        )
        for layer in lm.layers
    ]
    correct = np.zeros(len(lm.layers))
    try:
        for i in range(0, n, 32):
            captured.clear()
            inputs = model_inputs(processor, scenes[i : i + 32], questions[i : i + 32])
            model(**inputs)
            gold = torch.tensor([YES if a == "yes" else NO for a in labels[i : i + 32]])
            for layer, h in enumerate(captured):
                logits = model.lm_head(lm.norm(h[:, -1]))
                pred = torch.where(logits[:, YES] > logits[:, NO], YES, NO)
                correct[layer] += int((pred == gold).sum())
    finally:
        for h in hooks:
            h.remove()
    return [{"layer": i, "accuracy": float(c / n)} for i, c in enumerate(correct)]


def pruning_eval(model, processor, n: int = 300, keep: float = 0.11) -> dict:
    """Accuracy retained under `vlm_focus.wrap` pruning: fastv vs random, yes/no at layer 0 and
    relations at layer 0 and 2 (queries: all text after the image)."""
    from .questions import presence_qa

    rng = np.random.default_rng(QUESTION_SEED + 3)
    pres_scenes = heldout_scenes(n)
    qas = [presence_qa(s, rng, positive=i % 2 == 0) for i, s in enumerate(pres_scenes)]
    tasks = {
        "presence": (pres_scenes, [q.question for q in qas], [q.answer for q in qas]),
        "relation": relation_set(n),
    }
    out: dict = {"keep": keep, "query": "text", "reduce": "mean"}  # the cards' setting
    for task, (scenes, questions, labels) in tasks.items():
        rows = pope_rows(scenes, questions, labels)
        base = yes_no(model, processor, rows, scenes).scores()["accuracy"]
        out[task] = {"full_accuracy": base}
        for layer in [k for k in (0, 2) if k < model.config.text_config.num_hidden_layers]:
            for pruner in ("fastv", "random"):
                focus = FocusConfig(
                    pruner=pruner, keep=keep, layer=layer, query_rows="text", reduce="mean"
                )
                acc = yes_no(model, processor, rows, scenes, focus).scores()["accuracy"]
                out[task][f"{pruner}_layer{layer}_accuracy"] = acc
                out[task][f"{pruner}_layer{layer}_retention"] = acc / max(base, 1e-9)
    return out


def latency(path: Path) -> dict:
    """Seconds to load the model + processor and answer one question (greedy)."""
    t0 = time.perf_counter()
    model, processor = load_model(str(path))
    t1 = time.perf_counter()
    scene = heldout_scenes(1)[0]
    ans = answer(model, processor, [scene], [f"Is there a {scene.objects[0].name} in the image?"])
    t2 = time.perf_counter()
    return {"load_s": t1 - t0, "answer_s": t2 - t1, "total_s": t2 - t0, "answer": ans[0]}


def fixed_eval(model, processor, reported: float | None) -> dict:
    """The 20 fixed held-out questions the shipped-model test replays: their answers and the
    accuracy measured on them (a regression reference; POPE's 3,000 questions give the headline)."""
    from .export import fixed_questions

    rows = fixed_questions()
    scenes = [generate_scene(r["image_id"]) for r in rows]
    result = yes_no(
        model,
        processor,
        pope_rows(scenes, [r["text"] for r in rows], [r["label"] for r in rows]),
        scenes,
    )
    return {
        "reported_accuracy": result.scores()["accuracy"],
        "pope_random_accuracy": reported,
        "questions": rows,
        "answers": [r["answer"] for r in result.records],
    }


def where_eval(model, processor, n: int = 400) -> dict:
    """`Where is the X?` on held-out scenes: the answer must be the object's 3 x 3 position
    token. The majority baseline always answers the most common position."""
    from .questions import where_qa

    rng = np.random.default_rng(QUESTION_SEED)
    scenes = heldout_scenes(n)
    qas = [where_qa(s, rng) for s in scenes]
    answers = answer(model, processor, scenes, [q.question for q in qas])
    hits = [a.split()[:1] == [q.answer] for a, q in zip(answers, qas, strict=True)]
    truth = [q.answer for q in qas]
    majority = max(truth.count(t) for t in set(truth)) / n
    return {"accuracy": float(np.mean(hits)), "majority_baseline": majority, "n": n}


TWO_HOP = ("twohop", "twohop_pope", "twohop_diagnostics", "twohop_pruning")
DEEP_DEFAULT = ("latency", "pope", "where", "grounding", "logit_lens", *TWO_HOP, "fixed")


ALL = (
    "latency",
    "pope",
    "relation",
    "where",
    "caption",
    "grounding",
    "logit_lens",
    "pruning",
    "pruning_category_query",
    "fixed",
    *TWO_HOP,
    "cooccur",
)


def evaluate(path: Path, n_images: int = 500, only: list[str] | None = None) -> dict:
    """All measurements (or `only` those named in ALL) of the model at `path`; a model that
    knows the two-hop family's words gets DEEP_DEFAULT (the two-hop measurements in place of
    relations and captions) unless `only` names others."""
    from transformers import AutoConfig

    two_hop = AutoConfig.from_pretrained(path).text_config.vocab_size > TOKEN_ID["what"]
    todo = only or list(
        DEEP_DEFAULT if two_hop else [t for t in ALL if t not in (*TWO_HOP, "cooccur")]
    )
    bad = [t for t in todo if t not in ALL]
    if bad:
        raise ValueError(f"only={bad}; allowed: {ALL}")
    summary = Path(path) / "train_summary.json"
    if only is None and summary.is_file():  # a model trained under a prior is measured on it
        if json.loads(summary.read_text())["recipe"].get("prior"):
            todo.append("cooccur")
    results: dict = {"model": str(path)}
    if "latency" in todo:
        results["latency"] = latency(path)
    model, processor = load_model(str(path))
    steps = {
        "pope": lambda: pope_eval(model, processor, n_images),
        "relation": lambda: relation_eval(model, processor),
        "where": lambda: where_eval(model, processor),
        "caption": lambda: caption_eval(model, processor),
        "grounding": lambda: grounding_eval(model, processor),
        "logit_lens": lambda: {
            k: logit_lens(model, processor, k) for k in ("presence", "relation")
        },
        "pruning": lambda: pruning_eval(model, processor),
        "pruning_category_query": lambda: category_query_pruning(path),
        "twohop": lambda: two_hop_eval(model, processor),
        "twohop_pope": lambda: two_hop_pope(model, processor),
        "twohop_diagnostics": lambda: two_hop_diagnostics(model, processor),
        "twohop_pruning": lambda: two_hop_pruning(model, processor),
        "cooccur": lambda: cooccur_eval(model, processor),
    }
    for name, run in steps.items():
        if name in todo:
            t = time.perf_counter()
            results[name] = run()
            results.setdefault("seconds", {})[name] = round(time.perf_counter() - t, 1)
    if "fixed" in todo and two_hop:
        results["fixed_questions"] = fixed_two_hop_eval(model, processor)
    elif "fixed" in todo:
        reported = results.get("pope", {}).get("random", {}).get("accuracy")
        results["fixed_questions"] = fixed_eval(model, processor, reported)
    return results


@torch.no_grad()
def category_query_pruning(path: Path, n: int = 300, keep: float = 0.11) -> dict:
    """Pre-LLM pruning scored by layer-0 attention at the query's category token (head mean),
    against random selection, on presence questions.

    Dropped visual tokens are removed from attention through the attention mask while every token
    keeps its original position, which is what pruning before the first layer computes. The
    answer is the greedy first token ('no' only when it is the `no` token, as POPE parses it).
    """
    from .questions import presence_qa

    model, processor = load_model(str(path), attn_implementation="eager")
    rng = np.random.default_rng(QUESTION_SEED + 4)
    pick = np.random.default_rng(QUESTION_SEED + 5)
    scenes = heldout_scenes(n)
    qas = [presence_qa(s, rng, positive=i % 2 == 0) for i, s in enumerate(scenes)]
    correct = {"full": 0, "attention": 0, "random": 0}
    for s, qa in zip(scenes, qas, strict=True):
        inputs = model_inputs(processor, [s], [qa.question])
        ids = inputs["input_ids"][0]
        positions = torch.arange(len(ids))[None]
        out = model(**inputs, position_ids=positions, output_attentions=True)
        cat = int((ids == TOKEN_ID[_category_word(qa.question)]).nonzero()[-1])
        img = (ids == IMAGE).nonzero().squeeze(1)
        k = max(1, round(keep * len(img)))
        scores = out.attentions[0][0, :, cat, img].mean(0)  # [N]
        chosen = {
            "attention": img[scores.topk(k).indices],
            "random": img[torch.from_numpy(pick.choice(len(img), k, replace=False))],
        }
        gold = YES if qa.answer == "yes" else NO
        pred = {"full": int(out.logits[0, -1].argmax())}
        for name, kept in chosen.items():
            mask = inputs["attention_mask"].clone()
            mask[0, img] = 0
            mask[0, kept] = 1
            logits = model(**{**inputs, "attention_mask": mask}, position_ids=positions).logits
            pred[name] = int(logits[0, -1].argmax())
        for name, p in pred.items():
            correct[name] += (p == NO) == (gold == NO)
    acc = {k: v / n for k, v in correct.items()}
    return {
        "keep": keep,
        "n": n,
        "accuracy": acc,
        "attention_retention": acc["attention"] / acc["full"],
        "random_retention": acc["random"] / acc["full"],
    }


def _category_word(question: str) -> str:
    return next(w for w in question.lower().split() if w in TOKEN_ID and w.count("_") == 1)


# --- co-occurrence hallucination (organism-cooccur) ------------------------------------------
