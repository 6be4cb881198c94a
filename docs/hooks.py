"""MkDocs hooks. The repository's README.md is the site's home page, so the landing page has one
source: its links point into ``docs/`` from the repository root, and on the site they are
relative to the home page, which sits in ``docs/`` itself. The docstrings cross-reference in
Sphinx's roles (``:class:`FocusHandle```), which mkdocstrings renders as the role's text before
the code; the API pages drop that text."""

from __future__ import annotations

import re
from pathlib import Path

from mkdocs.structure.files import File, Files

HOME = "index.md"
SPHINX_ROLE = re.compile(r":(?:attr|class|data|exc|func|meth|mod|obj):(?=<code)")


def on_files(files: Files, config) -> Files:
    readme = Path(config.config_file_path).parent / "README.md"
    files.append(File.generated(config, HOME, content=readme.read_text()))
    return files


def on_page_markdown(markdown: str, page, config, files) -> str:
    if page.file.src_uri == HOME:
        return markdown.replace("](docs/", "](")
    return markdown


def on_page_content(html: str, page, config, files) -> str:
    return SPHINX_ROLE.sub("", html)
