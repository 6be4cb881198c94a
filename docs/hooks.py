"""MkDocs hooks: the repository's README.md is the site's home page, so the landing page has one
source. Its links point into ``docs/`` from the repository root; on the site they are relative to
the home page, which sits in ``docs/`` itself."""

from __future__ import annotations

from pathlib import Path

from mkdocs.structure.files import File, Files

HOME = "index.md"


def on_files(files: Files, config) -> Files:
    readme = Path(config.config_file_path).parent / "README.md"
    files.append(File.generated(config, HOME, content=readme.read_text()))
    return files


def on_page_markdown(markdown: str, page, config, files) -> str:
    if page.file.src_uri == HOME:
        return markdown.replace("](docs/", "](")
    return markdown
