"""The two-hop family's measurements (organism-deep and its guide): open answers, the yes/no
form, per-layer diagnostics of the hop, pruning and the fixed questions.
"""

from __future__ import annotations

import numpy as np
import torch

from vlm_focus.config import FocusConfig
from vlm_focus.setting import RunSetting

from .answering import ANSWER_TOKENS, QUESTION_SEED, answer, model_inputs, pope_rows, yes_no
from .pope import SPLITS
from .scenes import CATEGORIES, generate_scene, heldout_scenes
from .vocab import IMAGE, TOKEN_ID

TWO_HOP_SEED = QUESTION_SEED + 20
OPEN_FORMS = ("colour", "category", "shape")  # the family's three forms in the words


def two_hop_set(n: int, forms: tuple[str, ...] = OPEN_FORMS, negative: str = "", offset: int = 0):
    """Fixed held-out two-hop questions: one per multi-object scene that has a unique answer,
    the forms in turn (yes/no forms alternate yes and no). Returns (scenes, QAs)."""
    from .questions import two_hop_qa

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
        rows += pope_rows(split_scenes, questions, labels, split)
        scenes += split_scenes
    result = yes_no(model, processor, rows, scenes)
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
        inputs = model_inputs(processor, scenes[i : i + 16], [q.question for q in qas[i : i + 16]])
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
        model, processor, [generate_scene(r["image_id"]) for r in rows], [r["text"] for r in rows]
    )
    acc = float(np.mean([_first_word(a) == r["label"] for a, r in zip(answers, rows, strict=True)]))
    return {"reported_accuracy": acc, "kind": "twohop", "questions": rows, "answers": answers}
