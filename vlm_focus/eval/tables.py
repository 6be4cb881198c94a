"""Result tables: one markdown and one CSV file from a list of summary dicts."""

from __future__ import annotations

import csv
from collections.abc import Sequence
from pathlib import Path


def _cell(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.4f}" if abs(value) < 100 else f"{value:.1f}"
    return "" if value is None else str(value)


def markdown_table(rows: Sequence[dict], columns: Sequence[str]) -> str:
    """A GitHub markdown table of ``columns`` (missing values left empty)."""
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for r in rows:
        lines.append("| " + " | ".join(_cell(r.get(c)) for c in columns) + " |")
    return "\n".join(lines) + "\n"


def write_table(rows: Sequence[dict], columns: Sequence[str], stem: str | Path) -> list[Path]:
    """Write ``<stem>.md`` and ``<stem>.csv``; returns both paths."""
    stem = Path(stem)
    stem.parent.mkdir(parents=True, exist_ok=True)
    md = stem.with_suffix(".md")
    md.write_text(markdown_table(rows, columns))
    path = stem.with_suffix(".csv")
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(columns), extrasaction="ignore")
        writer.writeheader()
        for r in rows:
            writer.writerow({c: r.get(c) for c in columns})
    return [md, path]
