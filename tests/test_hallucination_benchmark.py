"""The hallucination benchmark's statistics (benchmarks/paired_stats.py) against hand counts, and
its scoring of a run against the equal-recall shift."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from paired_stats import (  # noqa: E402
    GOALS,
    caption_goal,
    equal_recall_shift,
    mcnemar,
    mcnemar_p,
    shift_for_yes_count,
    shifted,
    yes_no_goal,
)


@pytest.mark.parametrize(
    ("b", "c", "expected"),
    [
        (0, 0, 1.0),
        (5, 5, 1.0),
        (1, 0, 1.0),  # 2 * 1/2
        (6, 0, 2 / 64),  # 2 * (1/2)^6 = 0.03125
        (0, 6, 2 / 64),
        (8, 2, 2 * (1 + 10 + 45) / 1024),  # 2 * P(X <= 2), X ~ Bin(10, 1/2) = 0.109375
        (10, 1, 2 * 12 / 2048),
    ],
)
def test_mcnemar_exact_p_matches_hand_binomial(b, c, expected):
    assert mcnemar_p(b, c) == pytest.approx(expected)


def test_mcnemar_p_is_symmetric_and_a_known_table_value():
    # 15 vs 5 discordant pairs: the textbook two-sided exact p is 0.0414
    assert mcnemar_p(15, 5) == pytest.approx(mcnemar_p(5, 15))
    assert mcnemar_p(15, 5) == pytest.approx(0.041389, abs=1e-6)
    big = mcnemar_p(400, 300)  # no overflow with many pairs
    assert 0 < big < 0.001 and math.isfinite(big)


@pytest.mark.parametrize("bad", [-1, 1.5, True, "3"])
def test_mcnemar_rejects_non_counts(bad):
    with pytest.raises(ValueError, match="count"):
        mcnemar_p(bad, 1)


def test_mcnemar_counts_discordant_pairs():
    labels = ["yes", "yes", "no", "no", "no", "yes"]
    a = ["yes", "no", "no", "no", "yes", "yes"]  # right on 0, 2, 3, 5
    b = ["yes", "yes", "yes", "no", "no", "no"]  # right on 0, 1, 3, 4
    out = mcnemar(a, b, labels)
    assert (out["a_only"], out["b_only"]) == (2, 2)  # a only: 2, 5; b only: 1, 4
    assert out["p"] == 1.0
    with pytest.raises(ValueError, match="equal lengths"):
        mcnemar(a, b[:-1], labels)


def test_shift_reaches_each_yes_count():
    margins = [2.0, -1.0, 0.5, 3.0, -4.0]
    for k in range(len(margins) + 1):
        delta = shift_for_yes_count(margins, k)
        assert sum(m + delta > 0 for m in margins) == k
    # just past the 2nd largest margin: the fewest other margins cross with it
    assert shift_for_yes_count(margins, 2) == pytest.approx(-2.0, abs=1e-5)
    assert shift_for_yes_count(margins, 0) == -3.0
    with pytest.raises(ValueError, match="k must be"):
        shift_for_yes_count(margins, 6)


def test_equal_recall_shift_on_a_constructed_margin_list():
    """Greedy margins of 4 present and 4 absent questions; a method that says yes to 2 of the
    4 present ones. The best shift that matches its recall keeps the 2 largest present margins
    (3, 1) and answers every question by the same threshold, just below 1: delta = -1 + tiny,
    so the absent question at 0.6 stays no (a shift of -0.6 would reach the same recall with
    more false yes)."""
    labels = ["yes"] * 4 + ["no"] * 4
    margins = [3.0, 1.0, 0.2, -2.0, 2.5, 0.6, -0.5, -3.0]
    method = ["yes", "no", "no", "yes", "no", "no", "no", "no"]  # 2 of 4 present say yes
    delta, preds = equal_recall_shift(margins, labels, method)
    assert delta == pytest.approx(-1.0, abs=1e-5) and delta > -1.0
    assert preds == ["yes", "yes", "no", "no", "yes", "no", "no", "no"]
    assert preds == shifted(margins, delta)
    recall = lambda p: sum(x == "yes" for x, y in zip(p, labels) if y == "yes") / 4  # noqa: E731
    assert recall(preds) == recall(method) == 0.5


def _row(**over):
    row = {
        "closed": 0.4,
        "recall_cost": 0.01,
        "precision_cooccur": 0.85,
        "shift": {"precision_cooccur": 0.82},
        "mcnemar_greedy": {"p": 0.01},
        "mcnemar_shift": {"p": 0.04},
    }
    for key, value in over.items():
        row[key] = value
    return row


def test_yes_no_goal_needs_every_condition():
    assert yes_no_goal(_row())["met"]
    assert yes_no_goal(_row(recall_cost=0.84 - 0.83))["met"]  # 1 point, float noise included
    failures = {
        "closed": _row(closed=0.29),
        "recall": _row(recall_cost=0.02),
        "beats_shift": _row(shift={"precision_cooccur": 0.85}),
        "p_greedy": _row(mcnemar_greedy={"p": 0.05}),
        "p_shift": _row(mcnemar_shift={"p": 0.2}),
    }
    for name, row in failures.items():
        check = yes_no_goal(row)
        assert not check["met"] and not check[name]
        assert all(v for k, v in check.items() if k not in (name, "met"))
    assert not yes_no_goal(_row(closed=float("nan")))["met"]  # no gap: nothing closed


def test_caption_goal_is_relative_to_greedy():
    base = {"caption_companion_rate": 0.5, "caption_CHAIR_i": 0.4, "caption_recall": 0.8}
    good = {"caption_companion_rate": 0.35, "caption_CHAIR_i": 0.3, "caption_recall": 0.78}
    check = caption_goal(good, base)
    assert check["met"]
    assert check["companion_drop"] == pytest.approx(0.3)
    assert check["chair_drop"] == pytest.approx(0.25)
    assert not caption_goal({**good, "caption_recall": 0.77}, base)["recall"]
    assert not caption_goal({**good, "caption_CHAIR_i": 0.31}, base)["chair_i"]
    assert not caption_goal(good, {**base, "caption_companion_rate": 0.0})["met"]
    assert GOALS["companion_drop"] == 0.30 and GOALS["chair_drop"] == 0.25


def test_benchmark_scores_a_run_against_greedy_and_its_shift(monkeypatch):
    """`scored` on hand-made records: the gap closed, the cost, the shift at equal recall and
    the McNemar pairs (present + cooccur questions only)."""
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "hallucination_quality.py"
    spec = importlib.util.spec_from_file_location("hallucination_quality", path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "hallucination_quality", module)
    spec.loader.exec_module(module)
    from organism.evaluate_cooccur import cooccur_scores

    def records(splits, labels, preds, margins=None):
        out = [
            {"split": s, "label": y, "pred": p}
            for s, y, p in zip(splits, labels, preds, strict=True)
        ]
        for r, m in zip(out, margins or [], strict=False):
            r["margin"] = m
        return out

    splits = ["present"] * 4 + ["cooccur"] * 2 + ["other"] * 2
    labels = ["yes"] * 4 + ["no"] * 4
    margins = [3.0, 2.0, 1.0, 0.5, 1.5, 0.2, 0.1, -2.0]
    greedy_preds = ["yes" if m > 0 else "no" for m in margins]
    greedy = {"records": records(splits, labels, greedy_preds, margins)}
    greedy["pope"] = cooccur_scores(greedy["records"])
    assert greedy["pope"]["precision_cooccur"] == pytest.approx(4 / 6)
    assert greedy["pope"]["precision_other"] == pytest.approx(4 / 5)
    method_preds = ["yes", "yes", "yes", "yes", "no", "no", "no", "no"]
    run = {"records": records(splits, labels, method_preds)}
    run["pope"] = cooccur_scores(run["records"])
    row = module.scored("chosen", "m", run, greedy, {})
    assert row["precision_cooccur"] == 1.0 and row["recall_cost"] == 0.0
    assert row["closed"] == pytest.approx((1.0 - 4 / 6) / (4 / 5 - 4 / 6))
    # equal recall (all 4 present): the threshold just below the smallest present margin, 0.5,
    # so the cooccur question at 0.2 and the control at 0.1 turn no, the one at 1.5 stays yes
    assert row["shift"]["delta"] == pytest.approx(-0.5, abs=1e-5)
    assert row["shift"]["precision_cooccur"] == pytest.approx(4 / 5)
    assert row["shift"]["precision_other"] == 1.0
    # present + cooccur: the method is right on both cooccur questions, greedy on neither and
    # the shift on one
    assert (row["mcnemar_greedy"]["a_only"], row["mcnemar_greedy"]["b_only"]) == (2, 0)
    assert (row["mcnemar_shift"]["a_only"], row["mcnemar_shift"]["b_only"]) == (1, 0)
    assert row["flips"] == 3  # the two cooccur questions and one control question


def test_methods_follow_the_registry_and_skip_what_it_refuses(monkeypatch):
    """Every registered mitigation is a method; a variant or grid point whose options the
    registry refuses is skipped (a variant-less mitigation runs as it is), so the benchmark
    picks up new methods and survives renamed options."""
    import importlib.util

    from vlm_focus import hallucination as hal

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "hallucination_quality.py"
    spec = importlib.util.spec_from_file_location("hallucination_quality", path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "hallucination_quality", module)
    spec.loader.exec_module(module)
    monkeypatch.setattr(module, "VARIANTS", {"visual_beam": [{"no_such_option": 1}]})
    monkeypatch.setattr(
        module,
        "GRID",
        {"visual_beam": [{"weight": 3.0}, {"no_such_option": 2}, {"weight": "high"}]},
    )
    methods = module.methods()
    assert sorted({m.mitigation for m in methods}) == hal.mitigations()
    beam = next(m for m in methods if m.mitigation == "visual_beam")
    assert (beam.label, beam.base) == ("visual_beam", {})
    assert module.grid(beam) == [{}, {"weight": 3.0}]  # the defaults first, the refused dropped
    contrast = next(m for m in methods if m.mitigation == "instruction_contrast")
    assert module.cutoff_only(contrast, {"beta": 0.2}) == {"beta": 0.2, "alpha": 0.0}
    assert module.cutoff_only(beam, {}) is None  # no plausibility cutoff
