"""``benchmarks/decode.py``'s generate() arguments: a model with sliding-window layers compiles
with transformers' default ``dynamic=None`` (its static ring buffer guards on a Python length,
so ``dynamic=False`` recompiles every step, unwrapped too); every other model with
``dynamic=False``, so that any recompile would show."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from decode import generate_kwargs  # noqa: E402


@pytest.mark.parametrize(("sliding", "dynamic"), [(False, False), (True, None)])
def test_compiled_mode_picks_dynamic_by_sliding_layers(sliding, dynamic):
    kwargs = generate_kwargs("compiled", 4, cuda=False, sliding=sliding)
    config = kwargs["compile_config"]
    assert kwargs["cache_implementation"] == "static"
    assert config.fullgraph and config.dynamic is dynamic and config.mode == "default"


def test_eager_modes_carry_no_compile_config():
    assert "compile_config" not in generate_kwargs("static", 4, cuda=False, sliding=True)
    assert "cache_implementation" not in generate_kwargs("dynamic", 4, cuda=False)
