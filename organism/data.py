"""Training batches for the organism VLMs: dense patch labels and question/answer sequences.

Two text formats are used, as in the curriculum of ORGANISM training:
- `cat_last`: several questions packed after the image, each answer right after the last category
  token (`... is there a red_circle yes is the red_circle left of the blue_square no ...`);
- `chat`: the standard chat template, one to several turns
  (`USER: <image>\\nIs there a red_circle in the image? ASSISTANT: yes<eos>USER: ...`).
Ids are built directly from VOCAB; a test checks they equal the saved processor's output.
"""

from __future__ import annotations

import numpy as np
import torch

from .questions import (
    CATEGORY_IDS,
    IGNORE,
    QA,
    named_objects,
    presence_qa,
    prior_qas,
    sample_qas,
)
from .scenes import (
    RELATIONS,
    CooccurPrior,
    Scene,
    cooccur_scene,
    generate_scene,
)
from .vocab import (
    BOS,
    CLIP_MEAN,
    CLIP_STD,
    EOS,
    IMAGE,
    PAD,
    TOKEN_ID,
    encode,
)

TRAIN_SEED_BASE = 10_000_000  # training scenes; held-out and probe scenes use seeds below
_MEAN = np.asarray(CLIP_MEAN, dtype=np.float32)
_STD = np.asarray(CLIP_STD, dtype=np.float32)


def pixel_values(scenes: list[Scene]) -> torch.Tensor:
    """CLIP-normalised pixels `[B, 3, H, W]`, equal to the processor's output for these images."""
    arr = np.stack([s.image() for s in scenes]).astype(np.float32) / 255.0
    return torch.from_numpy(((arr - _MEAN) / _STD).transpose(0, 3, 1, 2).copy())


def patch_labels(scene: Scene, patch: int) -> np.ndarray:
    """Per-patch category label `[g*g]`: 0 background, c+1 object, IGNORE for partial cover.

    A patch belongs to an object when the object's exact mask covers >= 30% of it, to the
    background when no object covers more than 5%, and is ignored in between.
    """
    g = scene.size // patch
    cover = np.zeros((len(scene.objects) + 1, g, g), dtype=np.float32)
    for i, o in enumerate(scene.objects):
        cover[i + 1] = o.mask(scene.size).reshape(g, patch, g, patch).mean(axis=(1, 3))
    best = cover.argmax(0)
    frac = cover.max(0)
    cats = np.asarray([0] + [o.category + 1 for o in scene.objects])
    label = np.where(frac >= 0.3, cats[best], IGNORE)
    label = np.where(frac <= 0.05, 0, label)
    return label.reshape(-1)


def cat_last_ids(
    qas: list[QA], n_visual: int, anchors: list | None = None, answer_at: list | None = None
) -> tuple[list[int], list[int]]:
    """Packed category-last sequence and labels (loss on each answer token only).

    With `anchors` (a list), each question's `(qa index, position, object index)` entries for
    its category tokens are appended to it; with `answer_at` (a list), each question's
    `(qa index, position whose logits predict the answer's first token)`."""
    ids = [BOS, *encode("USER:"), *([IMAGE] * n_visual)]
    labels = [IGNORE] * len(ids)
    for n, qa in enumerate(qas):
        if anchors is not None:
            anchors += [(n, *a) for a in named_objects(len(ids), qa.short, qa)]
        ids += qa.short
        labels += [IGNORE] * len(qa.short)
        if answer_at is not None:
            answer_at.append((n, len(ids) - 1))
        ans = encode(qa.answer)
        ids += ans
        labels += ans
    return ids, labels


def chat_ids(
    qas: list[QA],
    n_visual: int,
    query_labels: bool = False,
    anchors: list | None = None,
    answer_at: list | None = None,
) -> tuple[list[int], list[int]]:
    """Chat-template sequence and labels (loss on answer tokens and their <eos>).

    With `query_labels`, the answer's first token is also the target at the question's last
    category token (where the category-last form answers), which keeps the lookup there while
    the last prompt token learns to copy it. Prompt tokens are never generated, so this label
    changes no generated text (two-hop questions, whose answer needs the words after the anchor,
    get none). `anchors` and `answer_at` as in `cat_last_ids`."""
    ids = [BOS]
    labels = [IGNORE]
    for t, qa in enumerate(qas):
        prompt = encode("USER:") + ([IMAGE] * n_visual if t == 0 else [])
        question = encode(qa.question)
        start = len(ids) + len(prompt)
        if anchors is not None:
            anchors += [(t, *a) for a in named_objects(start, question, qa)]
        prompt += question + encode("ASSISTANT:")
        ans = encode(qa.answer) + [EOS]
        row = [IGNORE] * len(prompt)
        cats = [i for i, tok in enumerate(question) if tok in CATEGORY_IDS]
        if answer_at is not None:
            answer_at.append((t, len(ids) + len(prompt) - 1))
        if query_labels and cats and qa.kind not in ("caption", "twohop"):
            row[start - len(ids) + cats[-1] + 1] = ans[0]
        if anchors is not None and qa.kind == "caption":  # the objects the caption names
            anchors += [(t, *a) for a in named_objects(len(ids) + len(prompt), ans, qa)]
        ids += prompt + ans
        labels += row + ans
    return ids, labels


def hidden_patches(scene: Scene, qas: list[QA], patch: int, rng: np.random.Generator) -> np.ndarray:
    """Visual tokens to hide from a training row `[g*g]` (True = hidden): a random share (50-100%)
    of the patches that no object of the row's answers touches, so every answer stays true.

    Training on such rows makes answers rest on the evidence they need rather than on the whole
    visual context, which is what pruning leaves a model with."""
    g = scene.size // patch
    needed = np.zeros(g * g, dtype=bool)
    for i in {i for qa in qas for i in qa.objects}:
        needed |= object_patches(scene, i, patch)
    share = rng.uniform(0.5, 1.0)
    return ~needed & (rng.random(g * g) < share)


def object_patches(scene: Scene, index: int, patch: int) -> np.ndarray:
    """`[g*g]` bool: the patches object `index`'s exact mask touches."""
    g = scene.size // patch
    return (
        scene.objects[index].mask(scene.size).reshape(g, patch, g, patch).any(axis=(1, 3)).ravel()
    )


def copy_target(ids: list[int]) -> tuple[int, int] | None:
    """(last prompt position, the question's last category token) of a one-turn chat row, or None
    when the question names no category (captions): where the answer is read and where the
    category-last form computes it."""
    for q in range(1, len(ids)):
        if ids[q - 1] == TOKEN_ID["assistant"] and ids[q] == TOKEN_ID[":"]:
            cats = [k for k in range(q) if ids[k] in CATEGORY_IDS]
            return (q, cats[-1]) if cats else None
    return None


def _centre(obj, size: int) -> tuple[float, float]:
    """An object's centre scaled to [-1, 1] (x, y)."""
    return 2 * obj.cx / size - 1, 2 * obj.cy / size - 1


def pad(seqs: list[list[int]], value: int) -> torch.Tensor:
    width = max(len(s) for s in seqs)
    return torch.tensor([s + [value] * (width - len(s)) for s in seqs], dtype=torch.long)


class Batcher:
    """Endless stream of training batches from scenes with seeds >= TRAIN_SEED_BASE."""

    def __init__(
        self, n_visual: int, patch: int, seed: int = 0, prior: CooccurPrior | None = None
    ) -> None:
        self.n_visual = n_visual
        self.patch = patch
        self.rng = np.random.default_rng(seed)
        self.prior = prior  # scenes and text under a co-occurrence prior (`prior_qas`)

    def scenes(self, batch: int, min_objects: int = 1) -> list[Scene]:
        out = []
        while len(out) < batch:
            seed = int(self.rng.integers(TRAIN_SEED_BASE, 2**31))
            s = generate_scene(seed) if self.prior is None else cooccur_scene(seed, self.prior)
            if len(s.objects) >= min_objects:
                out.append(s)
        return out

    def dense(self, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(pixel_values, patch labels `[B, g*g]`)."""
        scenes = self.scenes(batch)
        labels = torch.from_numpy(np.stack([patch_labels(s, self.patch) for s in scenes]))
        return pixel_values(scenes), labels.long()

    def text(
        self,
        batch: int,
        form: str,
        mix: dict[str, float],
        turns: tuple[int, int],
        cat_last_share: float = 0.0,
        hide_share: float = 0.0,
        query_labels: bool = False,
        balance: float = 0.0,
    ) -> dict:
        """A batch of sequences in `form` ('cat_last' or 'chat') with `turns` = (min, max) QAs.

        With `cat_last_share` > 0 a chat batch draws that share of its rows in the packed
        category-last form (6-8 questions), which keeps the lookup learning while the chat form
        learns to carry the answer to the end of the prompt. A `hide_share` of the rows hide
        visual tokens no answer needs (`hidden_patches`) through the attention mask.

        Besides the model inputs the batch holds training targets for the auxiliary losses:
        `copy_targets` (row, answer position, category position), `position_targets` (row,
        category position, object centre x, y in [-1, 1]) for every category token that names
        an object, `relation_targets` (row, second category position, first category
        position, first object's centre x, y, index of the relation in RELATIONS) for every
        relation question, and
        `pointer_targets` (row, position, first image token) with `pointer_masks` (`[n_visual]`
        patches of the object) for the token before each object a caption names, and
        `hop_targets` (row, answer position, anchor position, anchor centre x, y, relation
        index, first image token) with `hop_masks` (`[n_visual]` patches of the target) for
        every two-hop question.
        """
        scenes = self.scenes(batch)
        ids, labels, hidden, copies, places, relations = [], [], [], [], [], []
        pointers, pointer_masks, hops, hop_masks = [], [], [], []
        for s in scenes:
            row_form = form
            n = int(self.rng.integers(turns[0], turns[1] + 1))
            if form == "chat" and self.rng.random() < cat_last_share:
                row_form, n = "cat_last", int(self.rng.integers(6, 9))
            qas = sample_qas(s, self.rng, mix, n, balance)
            if self.prior is not None:
                qas = prior_qas(s, qas, self.prior, self.rng)
            if row_form == "cat_last":
                qas = [q for q in qas if q.kind != "caption"] or [presence_qa(s, self.rng)]
            anchors: list[tuple[int, int, int]] = []
            answer_at: list[tuple[int, int]] = []
            if row_form == "cat_last":
                i, lab = cat_last_ids(qas, self.n_visual, anchors, answer_at)
            else:
                i, lab = chat_ids(qas, self.n_visual, query_labels, anchors, answer_at)
                target = copy_target(i) if len(qas) == 1 and qas[0].kind != "twohop" else None
                if target is not None:
                    copies.append((len(ids), *target))
            centre = {k: _centre(o, s.size) for k, o in enumerate(s.objects)}
            places += [(len(ids), pos, *centre[obj]) for _, pos, obj in anchors]
            anchor_at = {qa: pos for qa, pos, _ in anchors}
            for qa_index, q in answer_at:
                qa = qas[qa_index]
                if qa.kind == "twohop":
                    anchor, target_obj = qa.objects
                    word = RELATIONS.index(qa.relation)
                    hops.append(
                        (len(ids), q, anchor_at[qa_index], *centre[anchor], word, i.index(IMAGE))
                    )
                    hop_masks.append(object_patches(s, target_obj, self.patch))
            for (qa_a, pos_a, obj_a), (qa_b, pos_b, _) in zip(anchors, anchors[1:]):
                if qa_a == qa_b and qas[qa_a].kind == "relation":
                    word = RELATIONS.index(qas[qa_a].relation)
                    relations.append((len(ids), pos_b, pos_a, *centre[obj_a], word))
            for qa, pos, obj in anchors:
                if qas[qa].kind == "caption":  # the token before a named object points at it
                    pointers.append((len(ids), pos - 1, i.index(IMAGE)))
                    pointer_masks.append(object_patches(s, obj, self.patch))
            ids.append(i)
            labels.append(lab)
            hide = self.rng.random() < hide_share
            hidden.append(hidden_patches(s, qas, self.patch, self.rng) if hide else None)
        input_ids = pad(ids, PAD)
        attention_mask = (input_ids != PAD).long()
        for row, hide in enumerate(hidden):
            if hide is not None:
                image_pos = (input_ids[row] == IMAGE).nonzero().squeeze(1)
                attention_mask[row, image_pos[torch.from_numpy(hide)]] = 0
        return {
            "copy_targets": torch.tensor(copies, dtype=torch.long).reshape(-1, 3),
            "position_targets": torch.tensor(places, dtype=torch.float32).reshape(-1, 4),
            "relation_targets": torch.tensor(relations, dtype=torch.float32).reshape(-1, 6),
            "pointer_targets": torch.tensor(pointers, dtype=torch.long).reshape(-1, 3),
            "pointer_masks": _stack_masks(pointer_masks, self.n_visual),
            "hop_targets": torch.tensor(hops, dtype=torch.float32).reshape(-1, 7),
            "hop_masks": _stack_masks(hop_masks, self.n_visual),
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "labels": pad(labels, IGNORE),
            "pixel_values": pixel_values(scenes),
        }


def _stack_masks(masks: list[np.ndarray], n_visual: int) -> torch.Tensor:
    """`[M, n_visual]` bool from M patch masks (M may be 0)."""
    return torch.from_numpy(np.stack(masks) if masks else np.zeros((0, n_visual), bool))


# --- co-occurrence prior (organism-cooccur) -------------------------------------------------
