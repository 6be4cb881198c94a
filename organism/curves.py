"""Learning-curve plot of a training log (one panel per stage)."""

from __future__ import annotations

from pathlib import Path


def plot_curves(history: list[dict], path: Path, title: str = "") -> None:
    """Loss (left axis) and probe accuracies (right axis) against minutes, per stage."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    stages = list(dict.fromkeys(h["stage"] for h in history))
    if not stages:
        return
    fig, axes = plt.subplots(1, len(stages), figsize=(4.2 * len(stages), 3.4), squeeze=False)
    for ax, stage in zip(axes[0], stages, strict=True):
        rows = [h for h in history if h["stage"] == stage]
        t = [h["seconds"] / 60 for h in rows]
        ax.plot(t, [h["loss"] for h in rows], color="tab:grey", lw=1, label="loss")
        ax.set_yscale("log")
        ax.set_xlabel("minutes")
        ax.set_title(f"{title} {stage}")
        ax2 = ax.twinx()
        for key, colour in (
            ("object_patch_acc", "tab:green"),
            ("probe_presence", "tab:blue"),
            ("probe_relation", "tab:red"),
            ("probe_cat_last_presence", "lightsteelblue"),
            ("probe_cat_last_relation", "lightsalmon"),
            ("probe_twohop", "tab:purple"),
            ("probe_cat_last_twohop", "plum"),
        ):
            pts = [(h["seconds"] / 60, h[key]) for h in rows if key in h]
            if pts:
                ax2.plot(*zip(*pts, strict=True), color=colour, marker=".", label=key)
        ax2.set_ylim(0, 1.02)
        lines = ax.get_legend_handles_labels()[0] + ax2.get_legend_handles_labels()[0]
        ax.legend(lines, [ln.get_label() for ln in lines], fontsize=7, loc="center right")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
