"""Plots of evaluation results (matplotlib, Agg backend)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path


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
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
