"""The README is the landing page: what the library is, the two commands, one example that runs
as pasted, the support matrix, measured numbers and the links to the documentation."""

from __future__ import annotations

import re

import pytest
import yaml
from doc_pages import README, ROOT, examples, python_blocks

EXAMPLES = examples([README])
TEXT = README.read_text()


def test_the_readme_is_a_landing_page_that_says_first_what_the_library_is():
    assert len(TEXT.splitlines()) <= 250
    first = TEXT.index("```")
    assert TEXT.startswith("# vlm_focus\n") and "is a plugin for Hugging Face" in TEXT[:first]


def test_the_two_commands_come_first_and_ci_runs_exactly_the_second():
    install, tests = re.findall(r"```bash\n(.*?)\n```", TEXT, flags=re.S)[:2]
    assert install == "pip install torch==2.13.0 -e . && vlm-focus run"
    assert tests.startswith("pip install torch==2.14.1") and tests.endswith("python -m pytest -q")
    assert TEXT.index(tests) < TEXT.index("## ")  # before any section
    ci = (ROOT / ".ci" / "run").read_text()
    assert re.search(rf"^{re.escape(tests)}$", ci, re.M)


def test_the_readme_has_an_example_that_runs_and_marks_the_others():
    blocks = python_blocks(README)
    assert EXAMPLES and len(EXAMPLES) == sum(runs for _, _, runs in blocks)


@pytest.mark.parametrize("where, code", EXAMPLES, ids=[where for where, _ in EXAMPLES])
def test_a_readme_example_runs_as_pasted(where, code, monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    exec(compile(code, where, "exec"), {"__name__": "__readme__"})


def test_the_support_matrix_is_one_marked_table_row_per_supported_model():
    from vlm_focus import supported_models

    start = TEXT.index(
        "<!-- support-matrix:start (generated: vf.integrations.support_matrix()) -->"
    )
    end = TEXT.index("<!-- support-matrix:end -->")
    rows = [r for r in TEXT[start:end].splitlines() if r.startswith("| ")]
    header = [c.strip() for c in rows[0].strip("|").split("|")]
    assert header[1:] == [
        "images",
        "several images",
        "video",
        "static cache",
        "lmms-eval",
        "vLLM plugin",
    ]
    types = [re.match(r"\| `(\w+)`", row).group(1) for row in rows[1:]]
    assert sorted(types) == sorted(supported_models())


def test_every_measured_number_names_the_table_it_comes_from():
    section = TEXT[TEXT.index("## Measured") :]
    section = section[: section.index("\n## ")]
    rows = [r for r in section.splitlines() if r.startswith("| ") and "---" not in r][1:]
    assert rows
    for row in rows:
        source = row.strip("|").split("|")[-1].strip()
        path = re.fullmatch(r"`([\w/.]+\.md)`", source).group(1)
        assert (ROOT / path).is_file(), row


def test_the_readme_links_every_page_of_the_site():
    nav = yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"]
    linked = set(re.findall(r"\]\(docs/([\w.-]+\.md)\)", TEXT))
    pages = {page for entry in nav for page in entry.values()} - {"index.md"}
    assert pages - linked <= {"vllm_in_llm_pruning.md"}, pages - linked  # linked from vllm.md
    assert linked <= pages
