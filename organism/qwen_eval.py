"""Evaluation of organism-qwen on held-out images and clips, greedy.

- **POPE**: the three POPE splits (`vlm_focus.eval.pope`) over held-out cropped scenes with at
  least three objects, answered through the evaluations' ``Generator``.
- **Relations**: one left/right/above/below question per held-out multi-object scene.
- **Video**: held-out clips, one question each, the kinds in turn (first / start / end).
- **Probe**: a small teacher-forced set that tracks training.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import torch

from . import qwen_data as q
from .answering import ANSWER_TOKENS, answer, yes_no
from .clips import Clip, make_clip
from .evaluate_twohop import OPEN_FORMS, TWO_HOP_SEED
from .pope import SPLITS, pope_questions
from .questions import relation_qa, two_hop_qa
from .vocab import QWEN_ID

QUESTION_SEED = 778
VIDEO_KINDS = ("first", "start", "end")


def heldout_images(n: int, min_objects: int = 1) -> list[q.CroppedScene]:
    """The first `n` held-out cropped scenes with at least `min_objects` objects."""
    out, seed = [], q.HELDOUT_SEED_BASE
    while len(out) < n:
        scene = q.cropped_scene(seed)
        if len(scene.scene.objects) >= min_objects:
            out.append(scene)
        seed += 1
    return out


def heldout_clips(n: int) -> list[Clip]:
    return [make_clip(q.HELDOUT_SEED_BASE + 500_000 + i) for i in range(n)]


def video_set(n: int) -> tuple[list[Clip], list]:
    """Held-out clips and one question each, the kinds of :data:`VIDEO_KINDS` in turn."""
    rng = np.random.default_rng(QUESTION_SEED)
    clips = heldout_clips(n)
    return clips, [q.video_qa(c, rng, VIDEO_KINDS[i % 3]) for i, c in enumerate(clips)]


def relation_set(n: int) -> tuple[list[q.CroppedScene], list]:
    rng = np.random.default_rng(QUESTION_SEED)
    scenes, qas = [], []
    for s in heldout_images(2 * n, min_objects=2):
        qa = relation_qa(s.scene, rng)
        if qa is not None and len(qas) < n:
            scenes.append(s)
            qas.append(qa)
    return scenes, qas


def two_hop_set(
    n: int, forms: tuple[str, ...] = OPEN_FORMS, offset: int = 0
) -> tuple[list[q.CroppedScene], list]:
    """Fixed two-hop questions (`evaluate_twohop`'s rules: one per held-out multi-object crop
    that has a unique answer, the forms in turn, yes/no forms alternating yes and no)."""
    rng = np.random.default_rng([TWO_HOP_SEED, offset])
    scenes, qas = [], []
    for s in heldout_images(4 * n + 100, min_objects=2):
        k = len(qas)
        form, positive = forms[k % len(forms)], (k // len(forms)) % 2 == 0
        qa = two_hop_qa(s.scene, rng, form=form, positive=positive)
        if qa is not None:
            scenes.append(s)
            qas.append(qa)
        if len(qas) == n:
            break
    return scenes, qas


def first_word(text: str) -> str:
    """The answer's first word, lower case, without a full stop."""
    words = text.strip().lower().replace(".", " ").split()
    return words[0] if words else ""


def pope_eval(model, processor, n_images: int = 300) -> dict:
    """POPE accuracy / F1 per split over the first `n_images` held-out crops with >= 3 objects."""
    crops = heldout_images(n_images, min_objects=3)
    out = {}
    for split in SPLITS:
        result = yes_no(model, processor, pope_questions([c.scene for c in crops], split), crops)
        (scores,) = result.metrics.values()  # the rows of one split carry no split of their own
        out[split] = {k: v for k, v in scores.items() if isinstance(v, (int, float))}
    out["accuracy"] = float(np.mean([out[s]["accuracy"] for s in SPLITS]))
    return out


def relation_eval(model, processor, n: int = 400) -> dict:
    scenes, qas = relation_set(n)
    answers = answer(model, processor, scenes, [qa.question for qa in qas])
    hits = [first_word(a) == qa.answer for a, qa in zip(answers, qas, strict=True)]
    return {"accuracy": float(np.mean(hits)), "n": len(hits)}


def video_answers(
    model, processor, clips: list[Clip], questions: list[str], new_tokens: int = ANSWER_TOKENS
) -> list[str]:
    """Greedy answers (`new_tokens` at most, special tokens dropped) to one question per clip."""
    return chat_answers(model, processor, clips, questions, new_tokens)


@torch.no_grad()
def chat_answers(
    model,
    processor,
    media: list[q.CroppedScene | Clip],
    questions: list[str],
    new_tokens: int = ANSWER_TOKENS,
) -> list[str]:
    """Greedy answers (`new_tokens` at most, special tokens dropped) to one question per image
    or clip (all of one kind), straight through the processor and ``generate``."""
    batch = 16
    out: list[str] = []
    for i in range(0, len(media), batch):
        chunk = media[i : i + batch]
        is_video = isinstance(chunk[0], Clip)
        texts = [q.chat_text(processor, is_video, text) for text in questions[i : i + batch]]
        inputs = processor(text=texts, **q.media_inputs(*chunk), padding=True, return_tensors="pt")
        gen = model.generate(**inputs, max_new_tokens=new_tokens, do_sample=False)
        out += processor.batch_decode(
            gen[:, inputs["input_ids"].shape[1] :], skip_special_tokens=True
        )
    return out


def score_video(answers: list[str], qas: list) -> dict:
    """Accuracy of answers to clip questions (the first word against the question's answer),
    overall and per kind of :data:`VIDEO_KINDS` asked (`<kind>_accuracy`, `<kind>_n`)."""
    hits = np.array([first_word(a) == qa.answer for a, qa in zip(answers, qas, strict=True)])
    kinds = np.array([qa.kind for qa in qas])
    out: dict = {"accuracy": float(hits.mean()), "n": len(hits)}
    for k in VIDEO_KINDS:
        if (kinds == k).any():
            out[f"{k}_accuracy"] = float(hits[kinds == k].mean())
            out[f"{k}_n"] = int((kinds == k).sum())
    return out


def video_eval(model, processor, n: int = 300) -> dict:
    """:func:`score_video` on :func:`video_set`'s `n` held-out clips, greedy."""
    clips, qas = video_set(n)
    return score_video(video_answers(model, processor, clips, [qa.question for qa in qas]), qas)


CAPTION_TOKENS = 8  # a caption names at most 3 objects: 5 words, then <|im_end|>


def caption_metrics(answers: list[str], clips: list[Clip]) -> dict:
    """Object precision and recall of video captions, and the share naming exactly the clip's
    objects in the order they appear."""
    named = correct = truth = found = exact = 0
    for text, clip in zip(answers, clips, strict=True):
        said = [w for w in text.replace(",", " ").split() if w in q.CATEGORIES]
        present = {q.CATEGORIES[c] for c in clip.categories}
        named += len(said)
        correct += sum(w in present for w in said)
        truth += len(present)
        found += len(present & set(said))
        exact += " , ".join(said) == q.video_caption(clip)
    return {
        "precision": correct / max(named, 1),
        "recall": found / max(truth, 1),
        "exact_order": exact / max(len(clips), 1),
        "n": len(clips),
    }


def caption_eval(model, processor, n: int = 200) -> dict:
    clips = heldout_clips(n)
    prompts = [q.VIDEO_CAPTION_PROMPT] * n
    answers = video_answers(model, processor, clips, prompts, new_tokens=CAPTION_TOKENS)
    return caption_metrics(answers, clips)


def evaluate(path: Path, n_images: int = 300, only: list[str] | None = None) -> dict:
    """Every bar of organism-qwen, greedy, on the saved model at `path` (all of them: ``only``
    must be None)."""
    if only is not None:
        raise ValueError(f"only={only!r}: organism-qwen's evaluation measures every bar at once")
    from vlm_focus.loading import load_model

    model, processor = load_model(str(path))
    start = time.time()
    out = {
        "pope": pope_eval(model, processor, n_images),
        "relations": relation_eval(model, processor),
        "video": video_eval(model, processor),
        "video_captions": caption_eval(model, processor),
    }
    out["eval_seconds"] = round(time.time() - start, 1)
    return out


class Probe:
    """A fixed held-out set scored teacher-forced (argmax at the answer) during training."""

    def __init__(
        self, processor, n: int = 48, kinds: tuple[str, ...] = ("presence", "relation", "video")
    ) -> None:
        rng = np.random.default_rng(4321)
        images = heldout_images(n, min_objects=2)
        self.processor = processor
        sets = {
            "presence": lambda: [
                q.Row(s, [q.presence_qa(s.scene, rng, positive=i % 2 == 0)])
                for i, s in enumerate(images)
            ],
            "relation": lambda: [q.Row(s, [qa]) for s, qa in zip(*relation_set(n), strict=True)],
            "twohop": lambda: [q.Row(s, [qa]) for s, qa in zip(*two_hop_set(n), strict=True)],
            "video": lambda: [q.Row(c, [qa]) for c, qa in zip(*video_set(n), strict=True)],
        }
        self.sets = {kind: sets[kind]() for kind in kinds}

    @torch.no_grad()
    def _accuracy(self, model, rows: list[q.Row], form: str = "chat") -> float:
        batch = q.collate([q.encode_row(self.processor, r, form) for r in rows], QWEN_ID["<pad>"])
        labels = batch.pop("labels")
        logits = model(**batch).logits
        first = (labels != -100).float().argmax(1)  # the answer word
        index = torch.arange(len(rows))
        return float((logits[index, first - 1].argmax(-1) == labels[index, first]).float().mean())

    def __call__(self, model) -> dict[str, float]:
        """Accuracy per set in the chat form, and (`cat_last_` keys) in the category-last form
        the language stages learn first."""
        model.eval()
        return {
            f"{prefix}{name}": self._accuracy(model, rows, form)
            for prefix, form in (("", "chat"), ("cat_last_", "cat_last"))
            for name, rows in self.sets.items()
        }
