"""The README's Python examples run as pasted: every ```python block, each in a fresh namespace
from the repository root, except those marked as not run (they need the hub or a GPU)."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import torch
import transformers
from torch._dynamo.utils import counters

ROOT = Path(__file__).resolve().parents[1]
NOT_RUN = "<!-- readme-example: not run"


def readme_examples() -> list[tuple[int, str]]:
    """``(line, code)`` of every runnable Python block of the README."""
    text = (ROOT / "README.md").read_text()
    out = []
    for match in re.finditer(r"```python\n(.*?)```", text, flags=re.S):
        before = text[: match.start()].rstrip().rsplit("\n", 1)[-1]
        if not before.startswith(NOT_RUN):
            out.append((text[: match.start()].count("\n") + 1, match.group(1)))
    return out


def test_the_readme_has_runnable_examples_and_marks_the_others():
    text = (ROOT / "README.md").read_text()
    assert len(EXAMPLES) >= 3
    assert text.count(NOT_RUN) == text.count("```python") - len(EXAMPLES)


EXAMPLES = readme_examples()


@pytest.mark.parametrize("line, code", EXAMPLES, ids=[f"README.md:{line}" for line, _ in EXAMPLES])
def test_a_readme_example_runs_as_pasted(line, code, monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    exec(compile(code, f"README.md:{line}", "exec"), {"__name__": "__readme__"})


def test_the_cpu_lmms_eval_example_is_limited_and_says_how_long_the_full_run_takes():
    text = (ROOT / "README.md").read_text()
    command = re.search(r"```bash\n(lmms-eval [^`]*?pretrained=embedded[^`]*?)```", text, re.S)
    assert command and "--limit 100" in command.group(1)
    after = text[command.end() : command.end() + 800]
    assert "Without `--limit` lmms-eval answers all 3,000 questions" in after


def test_the_fast_decoding_example_compiles_on_a_cpu_as_pasted(monkeypatch):
    """The "Fast decoding" block, as pasted, compiles its decode steps on a CPU: dynamo builds
    graphs (without ``_compile_all_devices`` transformers skips compiling off CUDA, and builds
    none). Dynamo's eager backend stands in for inductor, whose C++ build takes minutes on a
    CPU; tests/test_static_cache.py runs inductor."""
    text = (ROOT / "README.md").read_text()
    match = re.compile(r"```python\n(.*?)```", re.S).search(text, text.index("## Fast decoding"))
    line = text[: match.start()].count("\n") + 1

    @dataclasses.dataclass
    class EagerCompileConfig(transformers.CompileConfig):
        backend: str = "eager"

    monkeypatch.setattr(transformers, "CompileConfig", EagerCompileConfig)
    monkeypatch.chdir(ROOT)
    torch._dynamo.reset()
    counters.clear()
    exec(compile(match.group(1), f"README.md:{line}", "exec"), {"__name__": "__readme__"})
    assert counters["stats"]["unique_graphs"] >= 1, dict(counters["stats"])
    torch._dynamo.reset()
