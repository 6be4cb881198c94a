"""Plots of evaluation results (matplotlib, Agg backend)."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

#: What to install for the plots (``eval`` and ``demo`` carry matplotlib).
PLOT_EXTRA = "pip install 'vlm-focus[eval]' (or matplotlib)"


def available() -> bool:
    """Whether matplotlib imports, i.e. whether the plots can be drawn."""
    try:
        import matplotlib  # noqa: F401
    except ModuleNotFoundError:
        return False
    return True


def _optional(draw: Callable[..., Path]) -> Callable[..., Path | None]:
    """A plot is a by-product of finished work: without matplotlib it is skipped with a
    one-line notice on stderr (and ``None`` returned) instead of failing the command. The
    evaluation commands say so before their work starts (:func:`vlm_focus.eval.common.
    check_extras`) and then do not call the plot."""

    @functools.wraps(draw)
    def drawn(*args: Any, **kwargs: Any) -> Path | None:
        if not available():
            print(f"plot skipped: matplotlib is not installed; {PLOT_EXTRA}", file=sys.stderr)
            return None
        return draw(*args, **kwargs)

    return drawn


@_optional
def retention_plot(summaries: Sequence[dict], path: str | Path, metric: str = "f1") -> Path:
    """POPE ``metric`` against the share of visual tokens kept, one line per pruner and one
    panel per split; the unpruned run is the point at keep = 1 shared by every line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    splits = list(dict.fromkeys(s["split"] for s in summaries))
    fig, axes = plt.subplots(1, len(splits), figsize=(4.2 * len(splits), 3.6), squeeze=False)
    for ax, split in zip(axes[0], splits, strict=True):
        rows = [s for s in summaries if s["split"] == split]
        base = next((s for s in rows if s["pruner"] is None and s["mitigate"] == "none"), None)
        pruners = sorted({s["pruner"] for s in rows if s["pruner"] is not None})
        for name in pruners:
            pts = sorted(
                (s["visual_kept"] / max(s["visual_total"], 1), s[metric])
                for s in rows
                if s["pruner"] == name
            )
            if base is not None:
                pts.append((1.0, base[metric]))
            xs, ys = zip(*pts, strict=True)
            ax.plot(xs, ys, marker="o", label=name)
        if base is not None:
            ax.axhline(base[metric], color="grey", lw=0.8, ls="--", label="unpruned")
        ax.set_xscale("log")
        ax.set_xlabel("visual tokens kept (share)")
        ax.set_ylabel(f"POPE {metric}")
        ax.set_title(split)
        ax.grid(alpha=0.3)
    axes[0][-1].legend(fontsize=7)
    return _save(fig, path, dpi=110)


@_optional
def grounding_examples(
    records: Sequence[dict],
    truth: dict,
    image_path,
    path: str | Path,
    n: int = 8,
) -> Path:
    """A grid of the first ``n`` present queries: ground-truth boxes (green), the predicted
    top box (red, with its region score) and the attention peak (yellow cross).

    ``truth`` maps ``(image_id, category_id)`` to boxes; ``image_path(image_id)`` to a file.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle
    from PIL import Image

    chosen = [r for r in records if r["present"]][:n]
    cols = min(4, max(len(chosen), 1))
    rows = max(1, -(-len(chosen) // cols))
    fig, axes = plt.subplots(rows, cols, figsize=(2.6 * cols, 2.8 * rows), squeeze=False)
    for ax in axes.ravel():
        ax.axis("off")
    for ax, r in zip(axes.ravel(), chosen, strict=False):
        with Image.open(image_path(r["image_id"])) as im:
            ax.imshow(im.convert("RGB"))
        for x, y, w, h in truth.get((r["image_id"], r["category_id"]), []):
            ax.add_patch(Rectangle((x, y), w, h, fill=False, color="lime", lw=1.5))
        if r["boxes"]:
            b = r["boxes"][0]
            x, y, w, h = b["bbox"]
            ax.add_patch(Rectangle((x, y), w, h, fill=False, color="red", lw=1.5))
        ax.plot(*r["point"], marker="x", color="yellow", ms=8, mew=2)
        ax.set_title(f"{r['category']}  score {r['score']:.2f}", fontsize=7)
    return _save(fig, path, dpi=100)


def _save(fig: Any, path: str | Path, dpi: int) -> Path:
    """Lay ``fig`` out, write it to ``path`` (making its folder) and close it."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path
