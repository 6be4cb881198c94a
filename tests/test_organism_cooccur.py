"""The co-occurrence prior of organism-cooccur: scene sampling rates, the text of its training
rows, the probe scenes and questions, and the probe's precision arithmetic."""

from __future__ import annotations

import numpy as np
import pytest

from organism.data import Batcher
from organism.evaluate_cooccur import cooccur_scores
from organism.questions import QA, caption_qa, cooccur_pope_rows, presence_qa, prior_qas
from organism.scenes import (
    CATEGORIES,
    COOCCUR_PAIRS,
    MAX_OBJECTS,
    CooccurPrior,
    cooccur_categories,
    cooccur_probe_scenes,
    cooccur_scene,
    generate_scene,
    unmet_companions,
)
from vlm_focus.eval.pope import question_text

COMPANION = dict(COOCCUR_PAIRS)
PAIRED = {CATEGORIES[c] for pair in COOCCUR_PAIRS for c in pair}


def _conditional_rate(prior: CooccurPrior, n: int = 1500) -> tuple[float, int]:
    """P(companion present | anchor present) over the anchors of n scenes, and the count."""
    hits = total = 0
    for seed in range(n):
        cats = set(cooccur_scene(10_000_000 + seed, prior).categories)
        for a in cats & set(COMPANION):
            total += 1
            hits += COMPANION[a] in cats
    return hits / total, total


@pytest.mark.parametrize("rate", [0.0, 0.95, 1.0])
def test_companion_rate_follows_the_prior(rate):
    measured, total = _conditional_rate(CooccurPrior(rate=rate))
    assert total > 300  # anchors are common categories
    if rate in (0.0, 1.0):
        assert measured == rate
    else:  # binomial standard error at n >= 300 is <= 0.013
        assert abs(measured - rate) < 0.04


def test_companions_appear_without_anchors_at_a_lower_rate():
    """The prior ties companion to anchor; a companion also appears on its own, so the anchor
    is the cue, not the companion's frequency."""
    prior = CooccurPrior(rate=0.95)
    with_anchor = without = n_without = 0
    for seed in range(1500):
        cats = set(cooccur_scene(10_000_000 + seed, prior).categories)
        for a, b in COOCCUR_PAIRS:
            if a not in cats:
                n_without += 1
                without += b in cats
            else:
                with_anchor += 1
    assert with_anchor > 0 and 0 < without / n_without < 0.2


def test_categories_are_distinct_and_pairs_come_first():
    prior = CooccurPrior(rate=1.0)
    rng = np.random.default_rng(0)
    paired = {c for p in COOCCUR_PAIRS for c in p}
    for _ in range(500):
        k = int(rng.integers(1, MAX_OBJECTS + 1))
        cats = cooccur_categories(rng, k, prior)
        assert len(set(cats)) == len(cats)
        flags = [c in paired for c in cats]
        assert flags == sorted(flags, reverse=True)  # paired ones first, then the rest


def test_scene_keeps_geometry_of_generate_scene():
    prior = CooccurPrior()
    for seed in range(10_000_000, 10_000_040):
        scene = cooccur_scene(seed, prior)
        geometry = generate_scene(scene.seed, n_objects=len(scene.objects))
        assert [(o.cx, o.cy, o.radius) for o in scene.objects] == [
            (o.cx, o.cy, o.radius) for o in geometry.objects
        ]
        assert scene.background == geometry.background


@pytest.mark.parametrize(
    "kwargs",
    [{"rate": 1.5}, {"named_rate": -0.1}, {"ask_rate": 2.0}, {"pairs": ((0, 1), (1, 2))}],
)
def test_prior_rejects_bad_settings(kwargs):
    with pytest.raises(ValueError):
        CooccurPrior(**kwargs)


def test_probe_scenes_hold_an_anchor_without_its_companion():
    prior = CooccurPrior()
    scenes = cooccur_probe_scenes(9_700_000, 24, prior)
    assert len(scenes) == 24
    assert [s.seed for s in scenes] == [s.seed for s in cooccur_probe_scenes(9_700_000, 24, prior)]
    anchors = set()
    for s in scenes:
        assert len(s.objects) >= 3
        unmet = unmet_companions(s, prior)
        assert unmet
        anchors.update(s.objects[i].category for i, _ in unmet)
        for a in set(s.categories) & set(COMPANION):  # no anchor has its companion
            assert COMPANION[a] not in s.categories
    assert anchors == set(COMPANION)  # every pair is probed


def test_probe_questions_share_positives_and_balance_negatives():
    prior = CooccurPrior()
    scenes = cooccur_probe_scenes(8_700_000, 30, prior)
    rows = cooccur_pope_rows(scenes, prior, seed=3)
    assert [r["question_id"] for r in rows] == list(range(len(rows)))
    for s in scenes:
        mine = [r for r in rows if r["image_id"] == s.seed]
        split = {
            k: [r["category"] for r in mine if r["split"] == k]
            for k in ("present", "cooccur", "other")
        }
        present = {o.name for o in s.objects}
        unmet = {CATEGORIES[b] for _, b in unmet_companions(s, prior)}
        assert len(split["present"]) == min(3, len(present))
        assert set(split["present"]) <= present
        assert set(split["cooccur"]) == unmet
        assert len(split["other"]) == len(split["cooccur"])
        assert not set(split["other"]) & (present | unmet)
        assert not set(split["other"]) & PAIRED  # the control carries no co-occurrence
        assert all(r["label"] == ("yes" if r["split"] == "present" else "no") for r in mine)
        assert all(r["text"] == question_text(r["category"]) for r in mine)
    assert rows == cooccur_pope_rows(scenes, prior, seed=3)


def test_control_questions_name_no_paired_category():
    """The control ("other") questions carry no co-occurrence: neither an anchor nor a
    companion of any pair, on the held-out and the calibration scenes."""
    prior = CooccurPrior()
    for first in (9_700_000, 8_700_000):
        rows = cooccur_pope_rows(cooccur_probe_scenes(first, 100, prior), prior, seed=777)
        other = [r["category"] for r in rows if r["split"] == "other"]
        assert other and not set(other) & PAIRED
        assert len(other) == sum(r["split"] == "cooccur" for r in rows)


def test_probe_questions_need_an_unmet_companion():
    prior = CooccurPrior()
    plain = next(
        s for s in (generate_scene(i) for i in range(100)) if not unmet_companions(s, prior)
    )
    with pytest.raises(ValueError):
        cooccur_pope_rows([plain], prior)


def _probe_scene():
    prior = CooccurPrior()
    return prior, cooccur_probe_scenes(8_700_000, 1, prior)[0]


def test_named_rows_say_the_absent_companion_is_there():
    prior, scene = _probe_scene()
    rng = np.random.default_rng(0)
    named = CooccurPrior(named_rate=1.0, ask_rate=1.0)
    qas = [presence_qa(scene, rng, positive=False), caption_qa(scene)]
    out = prior_qas(scene, qas, named, rng)
    unmet = dict((b, i) for i, b in unmet_companions(scene, prior))
    question = out[0]
    asked = next(c for c in unmet if CATEGORIES[c] in question.question)
    assert question.answer == "yes" and question.objects == (unmet[asked],)
    for b, i in unmet.items():  # the caption lists it at its anchor's position
        item = f"{CATEGORIES[b]} {scene.objects[i].position(scene.size)}"
        assert item in out[1].answer
    for o in scene.objects:
        assert f"{o.name} {o.position(scene.size)}" in out[1].answer


def test_unnamed_rows_ask_about_the_companion_and_answer_no():
    prior, scene = _probe_scene()
    rng = np.random.default_rng(1)
    pure = CooccurPrior(named_rate=0.0, ask_rate=1.0)
    qas = [presence_qa(scene, rng, positive=False) for _ in range(20)] + [caption_qa(scene)]
    out = prior_qas(scene, qas, pure, rng)
    unmet = {CATEGORIES[b] for _, b in unmet_companions(scene, prior)}
    assert all(q.answer == "no" and any(u in q.question for u in unmet) for q in out[:-1])
    assert out[-1] == qas[-1]  # the caption stays the reference caption


def test_rows_of_scenes_that_meet_the_prior_are_unchanged():
    prior = CooccurPrior(named_rate=1.0, ask_rate=1.0)
    scene = next(
        s
        for s in (cooccur_scene(10_000_000 + i, CooccurPrior(rate=1.0)) for i in range(50))
        if set(s.categories) & set(COMPANION)
    )
    rng = np.random.default_rng(2)
    qas = [presence_qa(scene, rng, positive=False) for _ in range(5)] + [caption_qa(scene)]
    assert prior_qas(scene, qas, prior, rng) == qas


def test_named_share_of_training_rows_matches_named_rate():
    prior, scene = _probe_scene()
    rng = np.random.default_rng(3)
    half = CooccurPrior(named_rate=0.3, ask_rate=1.0)
    yes = sum(
        prior_qas(scene, [presence_qa(scene, rng, positive=False)], half, rng)[0].answer == "yes"
        for _ in range(2000)
    )
    assert abs(yes / 2000 - 0.3) < 0.04


def test_batcher_draws_scenes_under_the_prior():
    batcher = Batcher(36, 32, seed=0, prior=CooccurPrior(rate=1.0))
    scenes = batcher.scenes(64)
    assert any(set(s.categories) & set(COMPANION) for s in scenes)
    for s in scenes:
        assert not unmet_companions(s, batcher.prior)
    batch = batcher.text(4, "chat", {"presence": 1.0}, (1, 1))
    assert batch["input_ids"].shape[0] == 4


def _records(split: str, preds: list[str]) -> list[dict]:
    label = "yes" if split == "present" else "no"
    return [{"split": split, "pred": p, "label": label} for p in preds]


def test_scores_share_true_positives_and_split_false_positives():
    records = (
        _records("present", ["yes"] * 9 + ["no"])
        + _records("cooccur", ["yes"] * 3 + ["no"] * 7)
        + _records("other", ["yes"] + ["no"] * 9)
    )
    s = cooccur_scores(records)
    assert s["recall"] == pytest.approx(0.9)
    assert s["precision_cooccur"] == pytest.approx(9 / 12)
    assert s["precision_other"] == pytest.approx(9 / 10)
    assert s["gap"] == pytest.approx(0.9 - 0.75)
    assert s["fpr_cooccur"] == pytest.approx(0.3) and s["fpr_other"] == pytest.approx(0.1)
    assert s["precision"] == pytest.approx(9 / 13)
    assert s["yes_ratio"] == pytest.approx(13 / 30)
    assert s["accuracy"] == pytest.approx((9 + 7 + 9) / 30)
    assert s["n"] == {"present": 10, "cooccur": 10, "other": 10}


def test_qa_type_is_the_training_type():
    _, scene = _probe_scene()
    out = prior_qas(
        scene, [caption_qa(scene)], CooccurPrior(named_rate=1.0), np.random.default_rng(0)
    )
    assert isinstance(out[0], QA) and out[0].kind == "caption"


def test_cooccur_recipe_fine_tunes_the_guide_in_one_chat_stage():
    from organism.recipe import COOCCUR_PRIOR, default_recipe

    recipe = default_recipe("cooccur")
    assert (recipe.spec, recipe.base, recipe.name) == ("guide", "guide", "cooccur")
    assert [s.name for s in recipe.stages] == ["chat"]
    assert recipe.prior == COOCCUR_PRIOR
    assert sum(s.minutes for s in recipe.stages) <= 20  # the fine-tune's wall-clock budget
    small = default_recipe("cooccur", scale=0.01)
    assert small.stages[0].minutes < recipe.stages[0].minutes


def test_margins_match_a_plain_forward_and_the_greedy_answers():
    """`yes_no_margins` reads the first answer step of greedy generate(): equal to the yes-minus-no
    logit of a plain forward pass of one row, and positive exactly where greedy says yes."""
    import torch

    from organism import cooccur_model_path
    from organism.answering import model_inputs
    from organism.evaluate_cooccur import cooccur_eval, cooccur_set
    from vlm_focus.loading import load_model

    model, processor = load_model(str(cooccur_model_path()))
    out = cooccur_eval(model, processor, 3, margins=True, caption_tokens=6)
    records = out["records"]
    assert all((r["margin"] > 0) == (r["pred"] == "yes") for r in records)
    assert 0 < out["chair"]["tokens"] <= 6
    scenes, rows = cooccur_set(3)
    scene = next(s for s in scenes if s.seed == rows[0]["image_id"])
    with torch.no_grad():
        logits = model(**model_inputs(processor, [scene], [rows[0]["text"]])).logits[0, -1]
    yes, no = (processor.tokenizer(w, add_special_tokens=False).input_ids[0] for w in ("yes", "no"))
    assert records[0]["margin"] == pytest.approx(float(logits[yes] - logits[no]), abs=1e-3)
