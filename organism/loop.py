"""The one training loop of the organism VLMs, for every architecture (CPU, the stages of a
:mod:`.recipe`).

`train` runs a recipe from scratch through its architecture's record (:mod:`.architectures`,
keyed by the recipe's ``model_type``): the LLaVA-shaped organisms in :mod:`.llava_train`,
organism-qwen in :mod:`.qwen_train`. Every stage of either runs through :func:`run_stage` for
`steps` or `minutes` of wall-clock time, whichever ends first; the learning rate follows a
cosine over the larger of these fractions, so a slower machine still ends its schedule (with
fewer steps). CPU seconds are logged beside wall seconds to show how much of the two cores the
run got. Steps run under bf16 autocast where the CPU multiplies bf16 faster than float32, and in
float32 elsewhere (:func:`training_dtype`).
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from .architectures import architecture
from .recipe import StageConfig


def train(recipe, out_dir: Path, quiet: bool = False) -> dict:
    """Run ``recipe`` from scratch with its architecture's stages; returns the run's summary."""
    run = architecture(recipe.model_type).part("train")
    return run(recipe, Path(out_dir), quiet=quiet)


class _Stream(torch.utils.data.IterableDataset):
    """Endless batches from `make()`, built in a worker process so that drawing overlaps compute."""

    def __init__(self, make) -> None:
        super().__init__()
        self.make = make

    def __iter__(self):
        while True:
            yield self.make()


def prefetch(make: Callable[[], object]) -> Iterator:
    """Iterator over `make()` results, produced one step ahead by a single worker process."""
    loader = torch.utils.data.DataLoader(
        _Stream(make),
        batch_size=None,
        num_workers=1,
        prefetch_factor=2,
        worker_init_fn=lambda _: torch.set_num_threads(1),
    )
    return iter(loader)


def jsonl_logger(
    path: Path, history: list[dict], quiet: bool = False
) -> Callable[[str, int, Clock, dict], None]:
    """A stage log (``log(stage, step, clock, values)``, what :func:`run_stage` calls): each
    record, with the stage's wall and CPU seconds so far, is appended to ``history`` and to
    ``path`` as a JSON line, and printed unless ``quiet``."""

    def log(stage: str, step: int, clock: Clock, values: dict) -> None:
        row = {"stage": stage, "step": step, "seconds": round(clock.wall(), 1)}
        row |= {"cpu_seconds": round(clock.cpu(), 1), **values}
        history.append(row)
        with Path(path).open("a") as f:
            f.write(json.dumps(row) + "\n")
        if not quiet:
            print(json.dumps(row), flush=True)

    return log


class Clock:
    """Wall-clock and process CPU seconds since construction."""

    def __init__(self) -> None:
        self.wall0, self.cpu0 = time.time(), time.process_time()

    def wall(self) -> float:
        return time.time() - self.wall0

    def cpu(self) -> float:
        return time.process_time() - self.cpu0


def _frac(stage: StageConfig, step: int, clock: Clock) -> float:
    return max(step / stage.steps, clock.wall() / (60 * stage.minutes))


def learning_rate(stage: StageConfig, step: int, clock: Clock) -> float:
    """Linear warm-up over ``stage.warmup`` steps, then a cosine over the stage's fraction done."""
    warm = min(1.0, (step + 1) / stage.warmup)
    return stage.lr * warm * 0.5 * (1 + math.cos(math.pi * min(_frac(stage, step, clock), 1.0)))


def stage_done(stage: StageConfig, step: int, clock: Clock) -> bool:
    """True once ``step`` steps or the clock's wall seconds reach the stage's budget."""
    return _frac(stage, step, clock) >= 1.0


@functools.cache
def training_dtype() -> torch.dtype:
    """bfloat16 where this CPU multiplies it faster than float32 (native bf16 units), else
    float32: without them, bf16 autocast is emulated and runs tens of times slower."""
    a = torch.randn(384, 384)

    def seconds(bf16: bool) -> float:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            a @ a  # warm-up
            start = time.perf_counter()
            for _ in range(4):
                a @ a
            return time.perf_counter() - start

    return torch.bfloat16 if seconds(True) < seconds(False) else torch.float32


def autocast() -> contextlib.AbstractContextManager:
    """The training steps' precision (:func:`training_dtype`)."""
    if training_dtype() == torch.bfloat16:
        return torch.autocast("cpu", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def descend(opt: torch.optim.Optimizer, params: list, loss: torch.Tensor) -> None:
    """One optimiser step on `loss`, gradients clipped to norm 1."""
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    opt.step()


def run_stage(
    stage: StageConfig,
    params: list,
    batches: Iterator,
    step: Callable[[object], tuple[torch.Tensor, dict]],
    log: Callable[[str, int, Clock, dict], None],
    probe: Callable[[], dict] | None = None,
    every: int = 25,
    log_every: int = 25,
    clock: Clock | None = None,
) -> None:
    """Train ``params`` (AdamW, weight decay 0.01) until the stage's budget is spent.

    Each step sets the learning rate, draws a batch and descends on ``step(batch)``'s loss; the
    step's record (floats) is logged every ``log_every`` steps, and with ``probe`` its values
    are added and logged every ``every`` steps and at the end. ``clock`` (default: now) times
    the stage's budget."""
    opt = torch.optim.AdamW(params, lr=stage.lr, weight_decay=0.01)
    clock, n = clock or Clock(), 0
    while not stage_done(stage, n, clock):
        for group in opt.param_groups:
            group["lr"] = learning_rate(stage, n, clock)
        loss, record = step(next(batches))
        descend(opt, params, loss)
        n += 1
        if probe is not None and (n % every == 0 or stage_done(stage, n, clock)):
            log(stage.name, n, clock, record | probe())
        elif n % log_every == 0:
            log(stage.name, n, clock, record)
