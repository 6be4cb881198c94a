"""The documentation as the tests read it: the README (the site's home page) and every page of
``docs/``, with their Python examples and their shell commands."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
#: A Python block preceded by this comment is not run as a whole (it needs the hub or a GPU);
#: the comment says why, and which test runs it otherwise.
NOT_RUN = "<!-- example: not run"
PYTHON = re.compile(r"```python\n(.*?)```", re.S)


def pages() -> list[Path]:
    """Every page of the site: the README first, then ``docs/*.md`` by name."""
    return [README, *sorted(DOCS.glob("*.md"))]


def name(page: Path) -> str:
    return page.relative_to(ROOT).as_posix()


def python_blocks(page: Path) -> list[tuple[int, str, bool]]:
    """``(line, code, runs)`` of every ```python block of ``page``: ``runs`` is False for a
    block marked :data:`NOT_RUN` on the line before it."""
    text = page.read_text()
    out = []
    for match in PYTHON.finditer(text):
        before = text[: match.start()].rstrip().rsplit("\n", 1)[-1]
        line = text[: match.start()].count("\n") + 1
        out.append((line, match.group(1), not before.startswith(NOT_RUN)))
    return out


def examples(page_list: list[Path]) -> list[tuple[str, str]]:
    """``(where, code)`` of every runnable Python block of the pages, ``where`` as
    ``path:line``."""
    return [
        (f"{name(page)}:{line}", code)
        for page in page_list
        for line, code, runs in python_blocks(page)
        if runs
    ]


def section_block(page: Path, heading: str) -> tuple[int, str]:
    """``(line, code)`` of the first ```python block after ``heading`` in ``page``."""
    text = page.read_text()
    match = PYTHON.search(text, text.index(heading))
    return text[: match.start()].count("\n") + 1, match.group(1)


def commands(program: str) -> list[tuple[str, str]]:
    """``(page, line)`` of every ``vlm-focus <program> ...`` command of the site, from bash
    blocks (comments after two spaces dropped) and from inline code."""
    found = []
    for page in pages():
        text = page.read_text()
        for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
            for line in block.splitlines():
                line = line.split("  #")[0].strip()
                if line.startswith(f"vlm-focus {program} "):
                    found.append((name(page), line))
        for span in re.findall(r"`(vlm-focus [^`]+)`", text):
            span = " ".join(span.split())
            if span.startswith(f"vlm-focus {program} "):
                found.append((name(page), span))
    return found
