"""Held-out measurements of an organism model (greedy decoding, standard chat template).

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
from PIL import Image

from vlm_focus.config import FocusConfig
from vlm_focus.eval.generation import Generator
from vlm_focus.eval.pope import PopeResult
from vlm_focus.eval.pope import evaluate as evaluate_pope
from vlm_focus.loading import build_inputs, load_model
from vlm_focus.setting import RunSetting

from .pope import SPLITS, pope_eligible, pope_questions
from .scenes import CATEGORIES, POSITIONS, Scene, heldout_scenes
from .vocab import CAPTION_PROMPT, IMAGE, NO, TOKEN_ID, YES

QUESTION_SEED = 777
#: New tokens per short answer (the yes/no rule and the two-hop forms read the first word).
ANSWER_TOKENS = 2
BATCH = 32


def _picture(scene: Scene) -> Image.Image:
    return Image.fromarray(scene.image())


def _inputs(processor, scenes: list[Scene], questions: list[str]) -> dict:
    """Model inputs of (scene, question) rows in the chat template, for forward passes."""
    return build_inputs(processor, [_picture(s) for s in scenes], list(questions))


def answer(
    model,
    processor,
    scenes,
    questions,
    max_new_tokens: int = ANSWER_TOKENS,
    batch: int = BATCH,
    setting: RunSetting | None = None,
    guide=None,
    guide_processor=None,
) -> list[str]:
    """Greedy answers to (scene, question) pairs through the evaluations' Generator, decoded
    without special tokens; under ``setting`` (default: unpruned, ``max_new_tokens``), with
    ``guide``/``guide_processor`` the guide model of a pruner that needs one."""
    setting = setting or RunSetting(max_new_tokens=max_new_tokens)
    generator = Generator(model, processor, setting, guide=guide, guide_processor=guide_processor)
    out: list[str] = []
    for i in range(0, len(questions), batch):
        pictures = [_picture(s) for s in scenes[i : i + batch]]
        out += generator(pictures, list(questions[i : i + batch]))[0]
    return out


def _rows(scenes: list[Scene], questions: list[str], labels: list[str], split: str | None = None):
    """POPE rows of (scene, question, yes/no label) triples, the image named as the held-out
    set's files are."""
    rows = []
    for i, (s, q, a) in enumerate(zip(scenes, questions, labels, strict=True)):
        row = {"question_id": i, "image_id": s.seed, "image": f"scene_{s.seed}.png"}
        rows.append({**row, "text": q, "label": a, **({"split": split} if split else {})})
    return rows


def _yes_no(
    model, processor, rows: list[dict], scenes: list[Scene], focus: FocusConfig | None = None
) -> PopeResult:
    """:func:`vlm_focus.eval.pope.evaluate` of POPE rows on their scenes (no prompt suffix,
    short greedy answers), pruned by ``focus`` if given."""
    by_seed = {s.seed: s for s in scenes}
    return evaluate_pope(
        model,
        processor,
        rows,
        RunSetting(focus=focus, max_new_tokens=ANSWER_TOKENS),
        images=lambda row: _picture(by_seed[row["image_id"]]),
        suffix="",
        batch_size=BATCH,
    )


def relation_set(n: int) -> tuple[list[Scene], list[str], list[str]]:
    """Fixed held-out relation questions: one per multi-object scene, balanced by construction."""
    from .data import relation_qa

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
    result = _yes_no(model, processor, rows, scenes)
    out: dict = {split: result.scores(split) for split in SPLITS}
    out["prompt"] = "USER: <image>\\n{question} ASSISTANT: (no suffix)"
    return out


def relation_eval(model, processor, n: int = 400) -> dict:
    scenes, questions, labels = relation_set(n)
    result = _yes_no(model, processor, _rows(scenes, questions, labels), scenes)
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

        inputs = _inputs(processor, [s], [presence_question(target.name)])
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
    from .data import presence_qa

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
            inputs = _inputs(processor, scenes[i : i + 32], questions[i : i + 32])
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
    from .data import presence_qa

    rng = np.random.default_rng(QUESTION_SEED + 3)
    pres_scenes = heldout_scenes(n)
    qas = [presence_qa(s, rng, positive=i % 2 == 0) for i, s in enumerate(pres_scenes)]
    tasks = {
        "presence": (pres_scenes, [q.question for q in qas], [q.answer for q in qas]),
        "relation": relation_set(n),
    }
    out: dict = {"keep": keep, "query": "text", "reduce": "mean"}  # the cards' setting
    for task, (scenes, questions, labels) in tasks.items():
        rows = _rows(scenes, questions, labels)
        base = _yes_no(model, processor, rows, scenes).scores()["accuracy"]
        out[task] = {"full_accuracy": base}
        for layer in [k for k in (0, 2) if k < model.config.text_config.num_hidden_layers]:
            for pruner in ("fastv", "random"):
                focus = FocusConfig(
                    pruner=pruner, keep=keep, layer=layer, query_rows="text", reduce="mean"
                )
                acc = _yes_no(model, processor, rows, scenes, focus).scores()["accuracy"]
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
    scenes = [_scene(r["image_id"]) for r in rows]
    result = _yes_no(
        model,
        processor,
        _rows(scenes, [r["text"] for r in rows], [r["label"] for r in rows]),
        scenes,
    )
    return {
        "reported_accuracy": result.scores()["accuracy"],
        "pope_random_accuracy": reported,
        "questions": rows,
        "answers": [r["answer"] for r in result.records],
    }


def _scene(seed: int) -> Scene:
    from .scenes import generate_scene

    return generate_scene(seed)


def where_eval(model, processor, n: int = 400) -> dict:
    """`Where is the X?` on held-out scenes: the answer must be the object's 3 x 3 position
    token. The majority baseline always answers the most common position."""
    from .data import where_qa

    rng = np.random.default_rng(QUESTION_SEED)
    scenes = heldout_scenes(n)
    qas = [where_qa(s, rng) for s in scenes]
    answers = answer(model, processor, scenes, [q.question for q in qas])
    hits = [a.split()[:1] == [q.answer] for a, q in zip(answers, qas, strict=True)]
    truth = [q.answer for q in qas]
    majority = max(truth.count(t) for t in set(truth)) / n
    return {"accuracy": float(np.mean(hits)), "majority_baseline": majority, "n": n}


TWO_HOP_SEED = QUESTION_SEED + 20
OPEN_FORMS = ("colour", "category", "shape")  # the family's three forms in the words


def two_hop_set(n: int, forms: tuple[str, ...] = OPEN_FORMS, negative: str = "", offset: int = 0):
    """Fixed held-out two-hop questions: one per multi-object scene that has a unique answer,
    the forms in turn (yes/no forms alternate yes and no). Returns (scenes, QAs)."""
    from .data import two_hop_qa

    rng = np.random.default_rng([TWO_HOP_SEED, offset])
    scenes, qas = [], []
    for s in heldout_scenes(4 * n + 100, min_objects=2):
        k = len(qas)
        qa = two_hop_qa(
            s, rng, form=forms[k % len(forms)], positive=(k // len(forms)) % 2 == 0,
            negative=negative,
        )  # fmt: skip
        if qa is not None:
            scenes.append(s)
            qas.append(qa)
        if len(qas) == n:
            break
    return scenes, qas


def _first_word(text: str) -> str:
    return (text.split() or [""])[0]


def two_hop_eval(model, processor, n: int = 300) -> dict:
    """Two-hop accuracy (greedy; the first generated word must equal the answer), overall and
    per form, with each form's chance level (always the commonest answer)."""
    scenes, qas = two_hop_set(n)
    answers = answer(model, processor, scenes, [q.question for q in qas])
    hits = [_first_word(a) == q.answer for a, q in zip(answers, qas, strict=True)]
    out: dict = {"accuracy": float(np.mean(hits)), "n": n, "per_form": {}}
    for form in OPEN_FORMS:
        idx = [i for i, q in enumerate(qas) if q.form == form]
        truth = [qas[i].answer for i in idx]
        out["per_form"][form] = {
            "accuracy": float(np.mean([hits[i] for i in idx])),
            "n": len(idx),
            "majority_baseline": max(truth.count(t) for t in set(truth)) / len(idx),
        }
    out["examples"] = [
        {"image_id": s.seed, "question": q.question, "answer": q.answer, "model": a}
        for s, q, a in list(zip(scenes, qas, answers, strict=True))[:6]
    ]
    return out


def two_hop_pope(model, processor, n: int = 300) -> dict:
    """POPE-style yes/no on the two-hop family ("Is the object above the red_circle a
    blue_square?"), half true; false ones name another object of the scene (adversarial), a
    frequent absent category (popular) or any absent one (random)."""
    rows, scenes = [], []
    for k, split in enumerate(SPLITS):
        split_scenes, qas = two_hop_set(n, forms=("is_category",), negative=split, offset=k + 1)
        questions, labels = [q.question for q in qas], [q.answer for q in qas]
        rows += _rows(split_scenes, questions, labels, split)
        scenes += split_scenes
    result = _yes_no(model, processor, rows, scenes)
    return {split: result.scores(split) for split in SPLITS}


def _candidates(form: str) -> torch.Tensor:
    from .scenes import COLOURS

    words = {"colour": list(COLOURS), "category": list(CATEGORIES)}.get(form, ["yes", "no"])
    return torch.tensor([TOKEN_ID[w] for w in words])


@torch.no_grad()
def two_hop_diagnostics(model, processor, n: int = 200) -> dict:
    """Per layer, at the answer position (the last prompt token) of held-out two-hop questions:

    - logit lens: accuracy of the answer read through the final norm and lm_head after the
      layer, the argmax over the form's candidate answers (colours, categories or yes/no);
    - attention: the mass that position puts on the hop-2 object's patches and on the anchor's,
      head mean and the best head, and the hop-2 object's share of the mass on image tokens
      against its share of the patches (what uniform attention gives).
    """
    from .data import object_patches

    eager = (
        type(model)
        .from_pretrained(model.name_or_path, dtype=torch.float32, attn_implementation="eager")
        .eval()
    )
    scenes, qas = two_hop_set(n)
    lm = eager.model.language_model
    n_layers = len(lm.layers)
    patch = eager.config.vision_config.patch_size
    lens = np.zeros(n_layers)
    target_mass = np.zeros((n_layers, eager.config.text_config.num_attention_heads))
    anchor_mass = np.zeros_like(target_mass)
    share, chance = np.zeros(n_layers), []
    for i in range(0, n, 16):
        inputs = _inputs(processor, scenes[i : i + 16], [q.question for q in qas[i : i + 16]])
        out = eager(**inputs, output_attentions=True, output_hidden_states=True)
        for b, (s, qa) in enumerate(zip(scenes[i : i + 16], qas[i : i + 16], strict=True)):
            ids = inputs["input_ids"][b]
            img = (ids == IMAGE).nonzero().squeeze(1)
            cand = _candidates(qa.form)
            gold = TOKEN_ID[qa.answer]
            tmask = torch.from_numpy(object_patches(s, qa.objects[1], patch))
            amask = torch.from_numpy(object_patches(s, qa.objects[0], patch))
            chance.append(float(tmask.float().mean()))
            for layer in range(n_layers):
                h = out.hidden_states[layer + 1][b, -1]
                logits = eager.lm_head(lm.norm(h))
                lens[layer] += int(cand[logits[cand].argmax()]) == gold
                att = out.attentions[layer][b, :, -1, img]  # [H, N]
                target_mass[layer] += att[:, tmask].sum(1).numpy()
                anchor_mass[layer] += att[:, amask].sum(1).numpy()
                mean = att.mean(0)
                share[layer] += float(mean[tmask].sum() / mean.sum().clamp(min=1e-12))
    rows = []
    for layer in range(n_layers):
        best = int(target_mass[layer].argmax())
        rows.append(
            {
                "layer": layer,
                "logit_lens_accuracy": float(lens[layer] / n),
                "target_mass_head_mean": float(target_mass[layer].mean() / n),
                "anchor_mass_head_mean": float(anchor_mass[layer].mean() / n),
                "best_head": best,
                "target_mass_best_head": float(target_mass[layer, best] / n),
                "target_share_of_image_mass": float(share[layer] / n),
            }
        )
    return {"n": n, "target_patch_share": float(np.mean(chance)), "per_layer": rows}


def two_hop_pruning(model, processor, n: int = 300, keep: float = 0.11) -> dict:
    """Two-hop accuracy retained under `vlm_focus.wrap` pruning at K = 2 and K = 4 (those the
    model has): fastv against random (queries: all text after the image)."""
    scenes, qas = two_hop_set(n)
    questions = [q.question for q in qas]

    def accuracy(focus: FocusConfig | None = None) -> float:
        setting = RunSetting(focus=focus, max_new_tokens=ANSWER_TOKENS)
        answers = answer(model, processor, scenes, questions, setting=setting)
        return float(
            np.mean([_first_word(a) == q.answer for a, q in zip(answers, qas, strict=True)])
        )

    full = accuracy()
    out: dict = {"keep": keep, "query": "text", "reduce": "mean", "n": n, "full_accuracy": full}
    depth = model.config.text_config.num_hidden_layers
    for layer in (k for k in (2, 4) if k < depth):
        for pruner in ("fastv", "random"):
            acc = accuracy(
                FocusConfig(pruner=pruner, keep=keep, layer=layer, query_rows="text", reduce="mean")
            )
            out[f"{pruner}_layer{layer}_accuracy"] = acc
            out[f"{pruner}_layer{layer}_retention"] = acc / max(full, 1e-9)
    return out


def fixed_two_hop_questions() -> list[dict]:
    """20 fixed held-out two-hop questions (the shipped deep model's test set)."""
    scenes, qas = two_hop_set(20, offset=99)
    return [
        {"image_id": s.seed, "text": q.question, "label": q.answer, "form": q.form}
        for s, q in zip(scenes, qas, strict=True)
    ]


def fixed_two_hop_eval(model, processor) -> dict:
    """The deep model's 20 fixed two-hop questions, its answers and accuracy on them."""
    rows = fixed_two_hop_questions()
    answers = answer(
        model, processor, [_scene(r["image_id"]) for r in rows], [r["text"] for r in rows]
    )
    acc = float(np.mean([_first_word(a) == r["label"] for a, r in zip(answers, rows, strict=True)]))
    return {"reported_accuracy": acc, "kind": "twohop", "questions": rows, "answers": answers}


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
    from .data import presence_qa

    model, processor = load_model(str(path), attn_implementation="eager")
    rng = np.random.default_rng(QUESTION_SEED + 4)
    pick = np.random.default_rng(QUESTION_SEED + 5)
    scenes = heldout_scenes(n)
    qas = [presence_qa(s, rng, positive=i % 2 == 0) for i, s in enumerate(scenes)]
    correct = {"full": 0, "attention": 0, "random": 0}
    for s, qa in zip(scenes, qas, strict=True):
        inputs = _inputs(processor, [s], [qa.question])
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

#: Probe scenes per set: calibration scenes choose settings, held-out scenes are reported.
COOCCUR_IMAGES = 200


def cooccur_set(n: int = COOCCUR_IMAGES, calibration: bool = False, prior=None):
    """(scenes, POPE rows) of the co-occurrence probe: ``n`` scenes holding an anchor without its
    companion (`scenes.cooccur_probe_scenes`, from the held-out or calibration seeds) and their
    present / cooccur / other questions (`data.cooccur_pope_rows`)."""
    from .data import cooccur_pope_rows
    from .scenes import (
        COOCCUR_CALIBRATION_SEED_BASE,
        COOCCUR_HELDOUT_SEED_BASE,
        CooccurPrior,
        cooccur_probe_scenes,
    )

    prior = prior or CooccurPrior()
    first = COOCCUR_CALIBRATION_SEED_BASE if calibration else COOCCUR_HELDOUT_SEED_BASE
    scenes = cooccur_probe_scenes(first, n, prior)
    return scenes, cooccur_pope_rows(scenes, prior, seed=QUESTION_SEED)


def cooccur_scores(records: list[dict]) -> dict:
    """Scores of answered co-occurrence rows (each with ``split`` and ``pred``/``label``):

    - ``precision_cooccur`` = TP / (TP + FP on the cooccur questions) and ``precision_other`` =
      TP / (TP + FP on the other questions): the same present-object questions (TP), and as
      many absent-object questions each, so they differ only in which absent objects are asked;
    - ``gap`` = precision_other - precision_cooccur;
    - ``fpr_cooccur`` / ``fpr_other``: the share of yes on each set of absent-object questions;
    - ``recall`` (present questions), ``f1`` and ``accuracy`` over every row, and the
      ``yes_ratio`` = share of predicted yes over every row."""
    from vlm_focus.eval.metrics import pope_metrics

    by = {k: [r for r in records if r["split"] == k] for k in ("present", "cooccur", "other")}

    def scores(rows: list[dict]) -> dict:
        return pope_metrics([r["label"] for r in rows], [r["pred"] for r in rows])

    out = {k: v for k, v in scores(records).items() if k != "n"}
    for k in ("cooccur", "other"):
        out[f"precision_{k}"] = scores(by["present"] + by[k])["precision"]
        out[f"fpr_{k}"] = scores(by[k])["yes_ratio"]  # every one of them is a "no"
    out["unparseable"] = sum(not r.get("parseable", True) for r in records)
    out["n"] = {k: len(v) for k, v in by.items()}
    out["gap"] = out["precision_other"] - out["precision_cooccur"]
    return out


def cooccur_captions(scenes: list[Scene], captions: list[str], prior=None) -> dict:
    """CHAIR (`vlm_focus.eval.chair`) of captions of the probe scenes against their exact
    objects, and ``companion_rate``: the share of captions that name an absent companion of an
    anchor in the scene."""
    from vlm_focus.eval.chair import ObjectWords, chair_metrics, extract_objects

    from .scenes import CooccurPrior, unmet_companions

    prior = prior or CooccurPrior()
    table = ObjectWords.for_categories(CATEGORIES)
    caps = {s.seed: c for s, c in zip(scenes, captions, strict=True)}
    truth = {s.seed: {o.name for o in s.objects} for s in scenes}
    out = chair_metrics(caps, truth, table)
    named = 0
    for s, c in zip(scenes, captions, strict=True):
        said = set(extract_objects(c, table))
        named += any(CATEGORIES[b] in said for _, b in unmet_companions(s, prior))
    out["companion_rate"] = named / max(len(scenes), 1)
    return out


def cooccur_eval(
    model,
    processor,
    n: int = COOCCUR_IMAGES,
    setting: RunSetting | None = None,
    calibration: bool = False,
    captions: bool = True,
    progress: bool | str = False,
) -> dict:
    """The co-occurrence probe under ``setting`` (default: unpruned, unmitigated): POPE scores
    (`cooccur_scores`, no prompt suffix, greedy) and, with ``captions``, CHAIR of the captions
    (`cooccur_captions`, 24 new tokens) under the same pruning and mitigation."""
    import dataclasses

    setting = setting or RunSetting()
    scenes, rows = cooccur_set(n, calibration)
    by_seed = {s.seed: s for s in scenes}
    result = evaluate_pope(
        model,
        processor,
        rows,
        dataclasses.replace(setting, max_new_tokens=ANSWER_TOKENS),
        images=lambda row: _picture(by_seed[row["image_id"]]),
        suffix="",
        batch_size=BATCH,
        progress=progress,
    )
    for row, record in zip(rows, result.records, strict=True):
        record["split"] = row["split"]
    out = {"pope": cooccur_scores(result.records), "setting": setting.describe(), "images": n}
    if captions:
        caps = answer(
            model,
            processor,
            scenes,
            [CAPTION_PROMPT] * len(scenes),
            setting=dataclasses.replace(setting, max_new_tokens=24),
        )
        out["chair"] = cooccur_captions(scenes, caps)
        out["examples"] = [{"image_id": s.seed, "caption": c} for s, c in zip(scenes[:3], caps)]
    return out
