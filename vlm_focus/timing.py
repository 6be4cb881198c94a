"""Prefill timing for pruned-vs-unpruned ratios measured in one run (CPU or CUDA)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch


def median_seconds(fn: Callable[[], object], repeats: int = 5, warmup: int = 1) -> float:
    """Median wall time of ``fn()``; CUDA work is synchronised before each clock read."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def prefill_fn(model: torch.nn.Module, inputs: dict) -> Callable[[], object]:
    """One prefill as ``generate()`` runs it: cache on, logits for the last position only."""

    def run() -> object:
        with torch.inference_mode():
            return model(**inputs, use_cache=True, logits_to_keep=1)

    return run
