"""The documentation site's pages (``docs/*.md``, built by ``mkdocs.yml``): every Python example
runs as pasted from the repository root, every generated table is what the code generates now,
and the site builds in strict mode with every page in its navigation. The README, the home page:
tests/test_readme.py; the commands of every page: tests/test_readme_commands.py."""

from __future__ import annotations

import dataclasses
import functools
import re
import subprocess
import sys

import pytest
import torch
import transformers
import yaml
from doc_pages import DOCS, ROOT, examples, name, pages, python_blocks, section_block
from torch._dynamo.utils import counters

import vlm_focus as vf

DOC_PAGES = [page for page in pages() if page.parent == DOCS]
EXAMPLES = examples(DOC_PAGES)
#: A table generated from the code sits between ``<!-- NAME:start (generated: vf.FUNCTION()) -->``
#: and ``<!-- NAME:end -->``.
GENERATED = re.compile(
    r"<!-- ([\w-]+):start \(generated: (vf(?:\.\w+)+)\(\)\) -->\n(.*?)<!-- \1:end -->", re.S
)


def nav_pages() -> list[str]:
    nav = yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"]
    return [page for entry in nav for page in entry.values()]


def test_every_page_is_in_the_navigation_and_the_navigation_names_only_pages():
    listed = nav_pages()
    assert listed[0] == "index.md"  # the README, added by docs/hooks.py
    assert sorted(listed[1:]) == sorted(page.name for page in DOC_PAGES)


def test_the_pages_have_runnable_examples_and_mark_the_others():
    blocks = [block for page in DOC_PAGES for block in python_blocks(page)]
    assert len(EXAMPLES) >= 4
    assert len(EXAMPLES) == sum(runs for _, _, runs in blocks)


@pytest.mark.parametrize("where, code", EXAMPLES, ids=[where for where, _ in EXAMPLES])
def test_a_page_example_runs_as_pasted(where, code, monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    exec(compile(code, where, "exec"), {"__name__": "__docs__"})


def test_every_generated_table_is_what_its_function_generates_now():
    found = []
    for page in pages():
        for match in GENERATED.finditer(page.read_text()):
            table, function, text = match.groups()
            generate = functools.reduce(getattr, function.split(".")[1:], vf)
            assert text == generate(), f"{name(page)}: {table} differs from {function}()"
            found.append(table)
    assert "pruner-options" in found


def test_the_cpu_lmms_eval_example_is_limited_and_says_how_long_the_full_run_takes():
    text = (DOCS / "lmms-eval.md").read_text()
    command = re.search(r"```bash\n(lmms-eval [^`]*?pretrained=embedded[^`]*?)```", text, re.S)
    assert command and "--limit 100" in command.group(1)
    after = text[command.end() : command.end() + 800]
    assert "Without `--limit` lmms-eval answers all 3,000 questions" in after


def test_the_fast_decoding_example_compiles_on_a_cpu_as_pasted(monkeypatch):
    """The fast decoding example, as pasted, compiles its decode steps on a CPU: dynamo builds
    graphs (without ``_compile_all_devices`` transformers skips compiling off CUDA, and builds
    none). Dynamo's eager backend stands in for inductor, whose C++ build takes minutes on a
    CPU; tests/test_static_cache.py runs inductor."""
    page = DOCS / "fast-decoding.md"
    line, code = section_block(page, "# Fast decoding")

    @dataclasses.dataclass
    class EagerCompileConfig(transformers.CompileConfig):
        backend: str = "eager"

    monkeypatch.setattr(transformers, "CompileConfig", EagerCompileConfig)
    monkeypatch.chdir(ROOT)
    torch._dynamo.reset()
    counters.clear()
    exec(compile(code, f"{name(page)}:{line}", "exec"), {"__name__": "__docs__"})
    assert counters["stats"]["unique_graphs"] >= 1, dict(counters["stats"])
    torch._dynamo.reset()


def test_the_site_builds_in_strict_mode_with_the_readme_as_its_home_page(tmp_path):
    """What .ci/run runs: a broken link or anchor, a page left out of the navigation or an API
    name that no longer exists fails the build."""
    pytest.importorskip("mkdocs")
    pytest.importorskip("mkdocstrings")
    site = tmp_path / "site"
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(site)],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    home = (site / "index.html").read_text()
    assert "support-matrix:start" in home and 'href="getting-started/"' in home
    for page in nav_pages()[1:]:
        assert (site / page.removesuffix(".md") / "index.html").is_file(), page
    api = (site / "api" / "index.html").read_text()
    assert 'id="vlm_focus.wrap"' in api and ":class:<code>" not in api  # docs/hooks.py
