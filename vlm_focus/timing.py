"""Prefill timing for pruned-vs-unpruned ratios measured in one run (CPU or CUDA).

:func:`paired_seconds` alternates the two runs (unpruned, pruned, pruned, unpruned, ...) so that
load and clock drift hit both alike. The reported ratio is the median pair's, and the times
shown are that pair's, so that they agree with the ratio; the spread (min-max) of all pairs and
their count come with it: a ratio whose spread is wide is not to be trusted.
:func:`prefill_report` is the one wording of it for every command and the demo.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch
from transformers import LogitsProcessor

#: Above this relative spread of the paired ratios ((max - min) / median) a ratio is flagged.
TRUSTED_SPREAD = 0.15


def _sync() -> Callable[[], None]:
    return torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)


def sync_of(model: torch.nn.Module) -> Callable[[], None]:
    """What waits for ``model``'s device before a clock read (nothing on a CPU)."""
    cuda = next(model.parameters()).device.type == "cuda"
    return torch.cuda.synchronize if cuda else (lambda: None)


class PrefillClock(LogitsProcessor):
    """Notes when ``generate()`` first asks for the next token: the end of prefill
    (``first``, a ``time.perf_counter()`` reading; ``None`` until then)."""

    def __init__(self, sync: Callable[[], None]) -> None:
        self.sync = sync
        self.first: float | None = None

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.Tensor:
        if self.first is None:
            self.sync()
            self.first = time.perf_counter()
        return scores


@dataclass
class PairedTiming:
    """Seconds of alternating runs: ``base[i]`` and ``other[i]`` form pair ``i``."""

    base: list[float]
    other: list[float]

    @property
    def runs(self) -> int:
        """Number of pairs."""
        return len(self.base)

    @property
    def ratios(self) -> list[float]:
        """Per pair, ``base / other`` (the speed-up of ``other``)."""
        return [b / o for b, o in zip(self.base, self.other, strict=True)]

    @property
    def median_pair(self) -> int:
        """Index of the pair whose ratio is the median (the lower middle one for an even
        count): the pair that every reported number comes from."""
        ratios = self.ratios
        return sorted(range(len(ratios)), key=ratios.__getitem__)[(len(ratios) - 1) // 2]

    @property
    def ratio(self) -> float:
        """The median pair's ratio, ``base / other``."""
        return self.ratios[self.median_pair]

    @property
    def base_seconds(self) -> float:
        """The median pair's ``base`` seconds (``base_seconds / other_seconds == ratio``)."""
        return self.base[self.median_pair]

    @property
    def other_seconds(self) -> float:
        """The median pair's ``other`` seconds."""
        return self.other[self.median_pair]

    @property
    def low(self) -> float:
        return min(self.ratios)

    @property
    def high(self) -> float:
        return max(self.ratios)

    @property
    def spread(self) -> float:
        """``(max - min) / median`` of the paired ratios."""
        return (self.high - self.low) / self.ratio

    @property
    def trusted(self) -> bool:
        """At least 3 pairs, and a spread within :data:`TRUSTED_SPREAD`."""
        return self.runs >= 3 and self.spread <= TRUSTED_SPREAD

    def summary(self) -> str:
        """E.g. ``1.68x (min-max 1.60-1.75 over 5 alternating pairs)``."""
        return (
            f"{self.ratio:.2f}x (min-max {self.low:.2f}-{self.high:.2f} over {self.runs} "
            "alternating pairs)"
        )

    def report(self) -> str:
        """The one timing line of every command and the demo: the median pair's times, their
        ratio and the pairs' spread, e.g. ``92.1 ms unpruned -> 35.7 ms pruned: 2.58x (median
        of 5 alternating pairs, min-max 2.41-2.66)``."""
        return (
            f"{self.base_seconds * 1e3:.1f} ms unpruned -> {self.other_seconds * 1e3:.1f} ms "
            f"pruned: {self.ratio:.2f}x (median of {self.runs} alternating pairs, min-max "
            f"{self.low:.2f}-{self.high:.2f})"
        )

    def warning(self) -> str | None:
        """Why the ratio is not to be trusted, or ``None``."""
        if self.trusted:
            return None
        if self.runs < 3:
            return f"only {self.runs} pair(s): too few to judge the spread; use --repeats 5 or more"
        return (
            f"the paired ratios spread by {100 * self.spread:.0f}% of their median (more than "
            f"{100 * TRUSTED_SPREAD:.0f}%): the machine is busy or the runs too short to trust "
            "this ratio; rerun on a quiet machine or with more repeats"
        )

    def to_dict(self) -> dict[str, float | int | bool]:
        return {
            "ratio": round(self.ratio, 3),
            "ratio_min": round(self.low, 3),
            "ratio_max": round(self.high, 3),
            "runs": self.runs,
            "trusted": self.trusted,
        }


def paired_seconds(
    fn: Callable[[], object],
    other: Callable[[], AbstractContextManager],
    repeats: int = 5,
    warmup: int = 1,
) -> PairedTiming:
    """Time ``fn()`` plainly and inside ``other()`` (e.g. ``lambda: vf.wrap(model, ...)``),
    alternating: pair ``i`` runs plain first when ``i`` is even and second when odd. Only
    ``fn()`` is timed (entering and leaving ``other()`` is not); CUDA work is synchronised
    before each clock read. Both sides get ``warmup`` untimed runs first."""
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats={repeats!r} must be an int >= 1")
    sync = _sync()

    def timed(context: Callable[[], AbstractContextManager] | None) -> float:
        if context is None:
            sync()
            start = time.perf_counter()
            fn()
            sync()
            return time.perf_counter() - start
        with context():
            sync()
            start = time.perf_counter()
            fn()
            sync()
            return time.perf_counter() - start

    return alternate(lambda: timed(None), lambda: timed(other), repeats, warmup)


def alternate(
    base: Callable[[], float], other: Callable[[], float], repeats: int = 5, warmup: int = 1
) -> PairedTiming:
    """Pairs of ``base()`` and ``other()``, each returning the seconds it measured, in ABBA
    order: pair ``i`` runs ``base`` first when ``i`` is even and second when odd, so that what
    one run leaves behind (caches, allocator, clocks) does not always favour the same side.
    Both get ``warmup`` unrecorded runs first."""
    for _ in range(warmup):
        base()
        other()
    base_seconds, other_seconds = [], []
    for i in range(repeats):
        if i % 2 == 0:
            base_seconds.append(base())
            other_seconds.append(other())
        else:
            other_seconds.append(other())
            base_seconds.append(base())
    return PairedTiming(base_seconds, other_seconds)


NOTHING_PRUNED = "nothing pruned: every visual token kept, no speed-up to measure"


def pruned_prefill_timing(
    model: torch.nn.Module,
    inputs: dict,
    pruned: Callable[[], AbstractContextManager],
    n_kept: int,
    n_visual: int,
    repeats: int = 5,
) -> PairedTiming | None:
    """:func:`paired_seconds` of one prefill, unpruned and inside ``pruned()`` (e.g.
    ``lambda: vf.wrap(model, focus)``); ``None`` when nothing is pruned, where a ratio of two
    identical runs only measures noise."""
    if n_kept >= n_visual:
        return None
    return paired_seconds(prefill_fn(model, inputs), pruned, repeats=repeats)


def prefill_report(timing: PairedTiming | None, n_kept: int, n_visual: int) -> str:
    """``prefill <times and ratio>``, or that nothing was pruned (``timing`` is then not
    needed: a ratio of two identical runs only measures noise)."""
    if n_kept >= n_visual or timing is None:
        return NOTHING_PRUNED
    return f"prefill {timing.report()}"


def prefill_fn(model: torch.nn.Module, inputs: dict) -> Callable[[], object]:
    """One prefill as ``generate()`` runs it: cache on, logits for the last position only."""

    def run() -> object:
        with torch.inference_mode():
            return model(**inputs, use_cache=True, logits_to_keep=1)

    return run
