"""The report of `hallucination_quality.py`: its markdown tables, goal lines and plot, from the
report dict the benchmark writes as JSON."""

from __future__ import annotations

import sys
from pathlib import Path

from paired_stats import GOALS


def finite(value):
    """``value`` with NaN floats written as None, for strict JSON."""
    if isinstance(value, float) and value != value:
        return None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [finite(v) for v in value]
    return value


def _pct(x) -> str:
    return "n/a" if x is None or x != x else f"{100 * x:.1f}"


def _p(test: dict | None) -> str:
    if not test:
        return "-"
    return f"{test['p']:.3g} ({test['a_only']}/{test['b_only']})"


def words(options: dict) -> str:
    if not options:
        return "defaults"
    return ", ".join(f"{k}={Path(v).stem if k == 'centre' else v}" for k, v in options.items())


def _setting_words(row: dict) -> str:
    if row["kind"] == "shift":
        return row["label"]
    if row["kind"] in ("chosen", "cutoff only"):
        return f"{row['kind']}: {words(row.get('changed', row['options']))}"
    return row["kind"]


def _tick(check: dict | None) -> str:
    """``met``, or ``no`` with the conditions that failed."""
    if not check:
        return "-"
    if check["met"]:
        return "**met**"
    return "no (" + ", ".join(k for k, v in check.items() if v is False and k != "met") + ")"


def markdown(report: dict) -> str:
    t = report.get("run_timing", {"runs": 0, "seconds": 0.0, "cpu_seconds": 0.0})
    q = report.get("questions", {})
    lines = [
        f"# Co-occurrence hallucination and its mitigations ({Path(report['model']).name})",
        "",
        f"`{report['command']}`",
        "",
        f"Machine: {report['machine']}; torch {report['torch']}, transformers "
        f"{report['transformers']}. The last invocation took {report['seconds']:.0f} s"
        + (" (partial: still running or killed)" if report["partial"] else "")
        + f". Model: `{report['model']}`. {t['runs']} runs took {t['seconds']:.0f} s of wall "
        f"time and {t['cpu_seconds']:.0f} s of process CPU time, summed per run (runs "
        "finished by earlier invocations of the same command count as they took; the machine "
        "was shared, so the times are upper bounds).",
        "",
        f"{report['images']} held-out probe scenes (seeds from 9,700,000; {q.get('present')} "
        f"present, {q.get('cooccur')} cooccur and {q.get('other')} control questions); settings "
        f"chosen on {report['calibration']} "
        "calibration scenes (seeds from 8,700,000). In percent unless said. P_cooc / P_other: "
        "precision with the cooccur / the control questions (the same present questions); "
        "closed: share of greedy's gap closed by raising P_cooc; cost: recall points lost "
        "against greedy; flips: answers that differ from greedy's. shift: greedy's answers "
        "with the yes-minus-no logit moved by delta so that its recall equals the row's. "
        "McNemar: two-sided exact p on the present + cooccur questions (row right only / "
        "other right only). Captions: at most "
        f"{report['caption_tokens']} new tokens, the last unfinished sentence dropped; "
        "companion: captions naming an absent companion; obj recall: share of the scene's "
        "objects named; tokens: mean new tokens.",
    ]
    for pruning, part in report["prunings"].items():
        rows = part["rows"]
        lines += [
            "",
            f"## {pruning}: yes/no",
            "",
            "| method | setting | P_cooc | P_other | gap | closed | recall | cost | yes-ratio | "
            "flips | shift delta | shift P_cooc | shift closed | shift yes-ratio | "
            "McNemar vs greedy | McNemar vs shift | goal |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|---|",
        ]
        for r in rows:
            s = r.get("shift", {})
            delta = f"{s['delta']:+.2f}" if s else "-"
            lines.append(
                f"| {r.get('method', r['label'])} | {_setting_words(r)} | "
                f"{_pct(r['precision_cooccur'])} | {_pct(r['precision_other'])} | "
                f"{_pct(r['gap'])} | {_pct(r['closed'])} | {_pct(r['recall'])} | "
                f"{_pct(r['recall_cost'])} | {_pct(r['yes_ratio'])} | {r.get('flips', '-')} | "
                f"{delta} | {_pct(s.get('precision_cooccur'))} | {_pct(s.get('closed'))} | "
                f"{_pct(s.get('yes_ratio'))} | {_p(r.get('mcnemar_greedy'))} | "
                f"{_p(r.get('mcnemar_shift'))} | {_tick(r.get('goal_yes_no'))} |"
            )
        lines += [
            "",
            f"## {pruning}: captions",
            "",
            "| method | setting | CHAIR_i | CHAIR_s | companion | obj recall | tokens | words | "
            "goal |",
            "|---|---|---:|---:|---:|---:|---:|---:|---|",
        ]
        for r in rows:
            if "caption_CHAIR_i" not in r:
                continue
            lines.append(
                f"| {r.get('method', r['label'])} | {_setting_words(r)} | "
                f"{_pct(r['caption_CHAIR_i'])} | {_pct(r['caption_CHAIR_s'])} | "
                f"{_pct(r['caption_companion_rate'])} | {_pct(r['caption_recall'])} | "
                f"{r['caption_tokens']:.1f} | {r['caption_length']:.1f} | "
                f"{_tick(r.get('goal_captions'))} |"
            )
        lines += ["", *goal_lines(rows, pruning)]
    if report.get("embedded"):
        e = report["embedded"]
        lines += [
            "",
            f"## Embedded model ({Path(e['model']).name}): POPE adversarial and CHAIR",
            "",
            f"The shipped adversarial questions of the first {e['images']} held-out images "
            f"({e['questions']} questions, LLaVA suffix), greedy; every method at its defaults; "
            "the shift at each method's recall. McNemar on every question. Captions: "
            "organism prompt, 64 new tokens at most, unfinished sentence dropped.",
            "",
            "| row | accuracy | precision | recall | F1 | yes-ratio | McNemar vs greedy | "
            "McNemar vs shift | CHAIR_i | CHAIR_s | obj recall | tokens |",
            "|---|---:|---:|---:|---:|---:|---|---|---:|---:|---:|---:|",
        ]
        for r in e["rows"]:
            cap = "caption_CHAIR_i" in r
            lines.append(
                f"| {r['label']} | {_pct(r['accuracy'])} | {_pct(r['precision'])} | "
                f"{_pct(r['recall'])} | {_pct(r['f1'])} | {_pct(r['yes_ratio'])} | "
                f"{_p(r.get('mcnemar_greedy'))} | {_p(r.get('mcnemar_shift'))} | "
                + (
                    f"{_pct(r['caption_CHAIR_i'])} | {_pct(r['caption_CHAIR_s'])} | "
                    f"{_pct(r['caption_recall'])} | {r['caption_tokens']:.1f} |"
                    if cap
                    else "- | - | - | - |"
                )
            )
    lines += [
        "",
        "Calibration choices (largest calibration gain in P_cooc at a calibration recall cost "
        "<= 1 point; defaults when none qualifies): "
        + "; ".join(
            f"{p}: " + ", ".join(f"{m} {words(o)}" for m, o in ch.items())
            for p, ch in report["chosen"].items()
        )
        + ". Caption choices (largest drop in captions naming an absent companion at a "
        "calibration cost <= 2 points of object recall; defaults when none qualifies): "
        + "; ".join(
            f"{p}: " + ", ".join(f"{m} {words(o)}" for m, o in ch.items())
            for p, ch in report.get("caption_chosen", {}).items()
        )
        + ". Every calibration row is in the JSON file.",
        "",
        "![P_cooc against recall: the shift's curve and the methods](hallucination_quality.png)",
    ]
    return "\n".join(lines) + "\n"


def goal_lines(rows: list[dict], pruning: str) -> list[str]:
    """The goal lines and a plain reading of one pruning's rows."""
    ranked = [r for r in rows if r.get("setting") == "chosen"]
    yes_no = [r for r in ranked if r.get("goal_yes_no", {}).get("met")]
    for_captions = [r for r in rows if r.get("caption_setting")]
    caps = [r for r in for_captions if r.get("goal_captions", {}).get("met")]
    g = GOALS
    out = [
        f"**Yes/no goal** ({pruning}; calibrated settings: closes >= {100 * g['closed']:.0f}% of "
        f"the gap at <= {100 * g['recall_cost']:.0f} recall point, P_cooc above the shift at "
        f"equal recall, McNemar p < {g['p']} against greedy and against that shift): "
        + ("met by " + ", ".join(r["label"] for r in yes_no) if yes_no else "**not met**")
        + ".",
        "",
        f"**Caption goal** ({pruning}; settings chosen on calibration captions: >= "
        f"{100 * g['companion_drop']:.0f}% fewer captions "
        f"naming an absent companion, CHAIR_i down >= {100 * g['chair_drop']:.0f}% relative, "
        f"<= {100 * g['caption_recall_cost']:.0f} points of object recall lost): "
        + ("met by " + ", ".join(r["label"] for r in caps) if caps else "**not met**")
        + ".",
    ]
    best = max(
        (r for r in ranked if r["recall_cost"] <= g["recall_cost"] + 1e-12),
        key=lambda r: r["precision_cooccur"],
        default=None,
    )
    if best is not None:
        s = best["shift"]
        out += [
            "",
            f"Reading: among calibrated settings within {100 * g['recall_cost']:.0f} recall point, "
            f"{best['label']} has the highest P_cooc ({_pct(best['precision_cooccur'])}%, "
            f"closing {_pct(best['closed'])}% of the gap); the constant shift at its recall "
            f"reaches {_pct(s['precision_cooccur'])}% (closing {_pct(s['closed'])}%), "
            f"McNemar p = {best['mcnemar_shift']['p']:.3g} against it.",
        ]
    cut = [r for r in rows if r["kind"] == "cutoff only"]
    if cut:
        out += [
            "",
            "Cutoff only (the chosen cutoff, zero contrast weight): "
            + "; ".join(f"{r['method']}: {r['flips']} answers differ from greedy" for r in cut)
            + ".",
        ]
    return out


def plot(report: dict, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: skipped the plot", file=sys.stderr)
        return False
    parts = report["prunings"]
    fig, axes = plt.subplots(1, len(parts), figsize=(7 * len(parts), 5), squeeze=False)
    for ax, (pruning, part) in zip(axes[0], parts.items(), strict=True):
        shown = [100 * r["recall"] for r in part["rows"] if r["kind"] != "shift"]
        low = max(0.0, min(shown) - 20)  # the plot shows the recall around the methods
        curve = [c for c in part["shift_curve"] if 100 * c["recall"] >= max(low, 1e-9)]
        ax.plot(
            [100 * c["recall"] for c in curve],
            [100 * c["precision_cooccur"] for c in curve],
            color="grey",
            lw=1,
            label="constant shift of greedy's yes-no logit",
        )
        for r in part["rows"]:
            if r["kind"] == "shift":
                continue
            marker = {
                "greedy": "*",
                "defaults": "o",
                "chosen": "s",
                "cutoff only": "x",
                "captions": "^",
            }[r["kind"]]
            ax.scatter(
                100 * r["recall"],
                100 * r["precision_cooccur"],
                marker=marker,
                label=r["label"],
                s=60 if r["kind"] == "greedy" else 30,
            )
        base = part["rows"][0]
        ax.axhline(
            100 * base["precision_other"],
            color="tab:green",
            lw=0.8,
            ls="--",
            label="greedy's P_other (no co-occurrence)",
        )
        ax.set_xlim(low, 101)
        ax.set_xlabel("recall (%)")
        ax.set_ylabel("P_cooc (%)")
        ax.set_title(f"{pruning}: methods against the shift's curve")
        ax.legend(fontsize=5)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True
