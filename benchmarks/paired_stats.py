"""Paired statistics of yes/no answers for the hallucination benchmarks: McNemar's exact test on
answer flips, the constant-shift baseline at a given recall, and the benchmark's goal checks.

Plain Python (``math.comb``), no SciPy: the benchmark scripts and their tests import it alone.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

#: The goals, evaluated on held-out scenes with settings chosen on calibration scenes.
#: Yes/no: a method closes >= ``closed`` of the co-occurrence precision gap at a recall cost
#: <= ``recall_cost`` (a share: 0.01 = 1 point), beats the constant shift at its own recall, and
#: its answer flips differ from greedy's and from the shift's with McNemar p < ``p``.
#: Captions: >= ``companion_drop`` fewer captions naming an absent companion and CHAIR_i
#: down >= ``chair_drop`` (both relative to greedy) at <= ``caption_recall_cost`` object recall.
GOALS = {
    "closed": 0.30,
    "recall_cost": 0.01,
    "p": 0.05,
    "companion_drop": 0.30,
    "chair_drop": 0.25,
    "caption_recall_cost": 0.02,
}


#: How far past the k-th margin the equal-recall shift goes (logits): far below any gap that
#: separates two answers, and far above float noise at logits of a few units.
SHIFT_STEP = 1e-6


def mcnemar_p(b: int, c: int) -> float:
    """Two-sided exact McNemar p-value from the discordant pairs: ``b`` questions only the
    first run answers right, ``c`` only the second. Under the null each discordant pair goes
    either way with probability 1/2, so p = min(1, 2 * P(X <= min(b, c))), X ~ Bin(b + c, 1/2);
    1.0 without discordant pairs."""
    for name, value in (("b", b), ("c", c)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be a count (an int >= 0), got {value!r}")
    n = b + c
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, i) for i in range(min(b, c) + 1))
    return min(1.0, 2 * tail / 2**n)


def mcnemar(preds_a: Sequence[str], preds_b: Sequence[str], labels: Sequence[str]) -> dict:
    """McNemar's exact test of two runs' answers to the same questions: ``a_only`` (a right, b
    wrong), ``b_only`` (the reverse) and the two-sided ``p``."""
    if not len(preds_a) == len(preds_b) == len(labels):
        raise ValueError(
            f"paired answers need equal lengths, got {len(preds_a)}, {len(preds_b)}, {len(labels)}"
        )
    a_only = sum(a == y != b for a, b, y in zip(preds_a, preds_b, labels, strict=True))
    b_only = sum(b == y != a for a, b, y in zip(preds_a, preds_b, labels, strict=True))
    return {"a_only": a_only, "b_only": b_only, "p": mcnemar_p(a_only, b_only)}


def shifted(margins: Sequence[float], delta: float) -> list[str]:
    """Answers of the constant-shift baseline: ``yes`` where ``margin + delta > 0`` (the margin
    is the unmitigated run's yes-minus-no logit at the first answer token)."""
    return ["yes" if m + delta > 0 else "no" for m in margins]


def shift_for_yes_count(margins: Sequence[float], k: int) -> float:
    """The best shift ``delta`` under which ``k`` of ``margins`` say yes (``margin + delta >
    0``): the smallest such shift, just past the k-th largest margin, so that the fewest other
    margins (the negatives' too, when the positives' margins are passed) cross with them. With
    tied margins at the boundary no shift gives exactly ``k``; this one gives the nearest count
    above it (the caller reads the recall it reached)."""
    if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= len(margins):
        raise ValueError(f"k must be an int in [0, {len(margins)}], got {k!r}")
    if not margins:
        return 0.0
    top = sorted(margins, reverse=True)
    if k == 0:
        return -top[0]  # nothing above the largest margin
    step = SHIFT_STEP if k == len(top) else min(SHIFT_STEP, (top[k - 1] - top[k]) / 2)
    return -top[k - 1] + (step if step > 0 else SHIFT_STEP)


def equal_recall_shift(
    margins: Sequence[float], labels: Sequence[str], preds: Sequence[str]
) -> tuple[float, list[str]]:
    """The best constant shift whose recall equals that of ``preds`` on the same questions, and
    its answers: as many ``yes`` on the positive questions as ``preds`` has, and of the shifts
    that give them, the one with the fewest ``yes`` on the negatives (`shift_for_yes_count`)."""
    if not len(margins) == len(labels) == len(preds):
        raise ValueError("margins, labels and preds must be paired (equal lengths)")
    positive = [m for m, y in zip(margins, labels, strict=True) if y == "yes"]
    k = sum(p == "yes" for p, y in zip(preds, labels, strict=True) if y == "yes")
    delta = shift_for_yes_count(positive, k)
    return delta, shifted(margins, delta)


def yes_no_goal(row: dict, goals: dict = GOALS) -> dict:
    """The yes/no goal of one method row: each condition and ``met`` (all of them). The row
    holds ``closed``, ``recall_cost``, ``precision_cooccur``, ``shift`` (the equal-recall
    shift's scores, with ``precision_cooccur``) and ``mcnemar_greedy`` / ``mcnemar_shift``
    (each with ``p``)."""
    checks = {
        "closed": _ge(row.get("closed"), goals["closed"]),
        "recall": _le(row.get("recall_cost"), goals["recall_cost"]),
        "beats_shift": _gt(row.get("precision_cooccur"), row["shift"]["precision_cooccur"]),
        "p_greedy": _lt(row["mcnemar_greedy"]["p"], goals["p"]),
        "p_shift": _lt(row["mcnemar_shift"]["p"], goals["p"]),
    }
    return {**checks, "met": all(checks.values())}


def caption_goal(row: dict, base: dict, goals: dict = GOALS) -> dict:
    """The caption goal of one row against the greedy row ``base`` (each with
    ``caption_companion_rate``, ``caption_CHAIR_i`` and ``caption_recall``): each condition
    and ``met``. A baseline rate of 0 leaves nothing to reduce: that condition fails."""
    companion = _drop(row["caption_companion_rate"], base["caption_companion_rate"])
    chair = _drop(row["caption_CHAIR_i"], base["caption_CHAIR_i"])
    cost = base["caption_recall"] - row["caption_recall"]
    checks = {
        "companion": _ge(companion, goals["companion_drop"]),
        "chair_i": _ge(chair, goals["chair_drop"]),
        "recall": _le(cost, goals["caption_recall_cost"]),
    }
    return {**checks, "companion_drop": companion, "chair_drop": chair, "met": all(checks.values())}


def _drop(value: float, base: float) -> float:
    """Relative reduction ``1 - value / base`` (NaN when the base is 0)."""
    return 1 - value / base if base > 0 else float("nan")


# Comparisons that are False for a missing value or NaN (no gap, no baseline rate).
def _ge(x, y) -> bool:
    return x is not None and x == x and x >= y - 1e-12


def _le(x, y) -> bool:
    return x is not None and x == x and x <= y + 1e-12


def _gt(x, y) -> bool:
    return x is not None and y is not None and x == x and y == y and x > y


def _lt(x, y) -> bool:
    return x is not None and x == x and x < y
