"""Pictures of a :class:`~hf_lsad.evaluation.prompts.PromptEvaluation`: per head, ROC curves of each unsafe
source against every benign row pooled, with the guard's operating point marked, and score histograms of every
source with the threshold drawn in; and one self-contained HTML page holding the table and the pictures.

Needs matplotlib (the ``plots`` extra); without it :func:`write_report` writes the HTML table alone and says why.
"""

from __future__ import annotations

import base64
import html
import importlib.util
from pathlib import Path
from typing import Any

import numpy as np
from sklearn.metrics import roc_curve

from ..core.metrics import flag_rate
from .prompts import PromptEvaluation
from .sources import REPORTED_FPRS

PLOTS_EXTRA = "pip install 'hf-lsad[plots]'"


def write_report(evaluation: PromptEvaluation, folder: str | Path, *, title: str = "hf-lsad evaluation") -> list[str]:
    """Write ``roc-<head>.png`` and ``scores-<head>.png`` for each head and ``report.html`` into ``folder``;
    return the names of the files written."""
    path = Path(folder)
    path.mkdir(parents=True, exist_ok=True)
    pictures = _draw(evaluation, path) if importlib.util.find_spec("matplotlib") is not None else []
    note = "" if pictures else f"<p>No pictures: matplotlib is not installed ({html.escape(PLOTS_EXTRA)}).</p>"
    (path / "report.html").write_text(_html(evaluation, path, pictures, title, note), encoding="utf-8")
    return [*pictures, "report.html"]


def _draw(evaluation: PromptEvaluation, path: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    benign = [s for s in evaluation.sources if not s.unsafe]
    unsafe = [s for s in evaluation.sources if s.unsafe]
    for head, threshold in evaluation.thresholds.items():
        negatives = np.concatenate([s.head_scores[head] for s in benign])
        negatives = negatives[np.isfinite(negatives)]
        fig, ax = plt.subplots(figsize=(5.5, 5))
        for source in unsafe:
            positives = source.head_scores[head][np.isfinite(source.head_scores[head])]
            if not len(positives):
                continue
            labels = np.r_[np.zeros(len(negatives)), np.ones(len(positives))]
            fpr, tpr, _ = roc_curve(labels, np.r_[negatives, positives])
            (line,) = ax.plot(fpr, tpr, label=source.name)
            ax.plot(flag_rate(negatives, threshold), flag_rate(positives, threshold), "o", color=line.get_color())
        ax.plot([0, 1], [0, 1], ":", color="grey")
        ax.set(xlabel="false-positive rate (benign sources pooled)", ylabel="true-positive rate", xlim=(0, 1))
        ax.set_title(f"head {head}: ROC per unsafe source (dot: the guard's threshold)", fontsize=9)
        ax.legend(fontsize=7, loc="lower right")
        fig.tight_layout()
        fig.savefig(path / f"roc-{head}.png", dpi=110)
        plt.close(fig)
        written.append(f"roc-{head}.png")

        fig, ax = plt.subplots(figsize=(7, 0.5 + 0.9 * len(evaluation.sources)))
        finite = np.concatenate([s.head_scores[head][np.isfinite(s.head_scores[head])] for s in evaluation.sources])
        bins = np.linspace(min(finite.min(), threshold), max(finite.max(), threshold), 41)
        for row, source in enumerate(evaluation.sources):
            values = source.head_scores[head][np.isfinite(source.head_scores[head])]
            counts, _ = np.histogram(values, bins=bins)
            height = counts / max(counts.max(), 1) * 0.8
            color = "tab:red" if source.unsafe else "tab:blue"
            ax.bar(bins[:-1], height, width=np.diff(bins), bottom=row, align="edge", color=color, alpha=0.7)
        ax.axvline(threshold, color="black", linestyle="--")
        ax.set_yticks(np.arange(len(evaluation.sources)) + 0.4, [s.name for s in evaluation.sources], fontsize=8)
        ax.set_xlabel(f"head {head} score (blue: benign, red: unsafe)")
        # in the title, not a legend: a legend inside the axes covers the bars of the top source
        ax.set_title(f"head {head}: scores per source (dashed: the threshold, {threshold:.4g})", fontsize=9)
        fig.tight_layout()
        fig.savefig(path / f"scores-{head}.png", dpi=110)
        plt.close(fig)
        written.append(f"scores-{head}.png")
    return written


def _html(evaluation: PromptEvaluation, path: Path, pictures: list[str], title: str, note: str) -> str:
    metrics, summary = evaluation.metrics(), evaluation.summary()
    heads = list(evaluation.thresholds)
    header = ["source", "kind", "rows", "flagged", *[f"by {h}" for h in heads], *[f"AUROC {h}" for h in heads]]
    header += [f"at {fpr:.0%} FPR" for fpr in REPORTED_FPRS]
    lines = []
    for name, row in metrics.items():
        cells = [name, "unsafe" if row["unsafe"] else "benign", str(row["rows"]), _percent(row["flagged"])]
        cells += [_percent(row.get(f"flagged_by_{h}")) for h in heads]
        cells += [_number(row.get(f"auroc_{h}")) for h in heads]
        cells += [_percent(row.get(f"flagged_at_fpr_{fpr:g}")) for fpr in REPORTED_FPRS]
        lines.append("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in cells) + "</tr>")
    spread = [summary["at_guard_thresholds"], *(summary[f"at_fpr_{fpr:g}"] for fpr in REPORTED_FPRS)]
    cells = ["median / worst unsafe source", "", "", *[_spread_cell(x) for x in spread[:1]]]
    cells += [""] * (2 * len(heads)) + [_spread_cell(x) for x in spread[1:]]
    lines.append("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in cells) + "</tr>")
    thresholds = ", ".join(f"{html.escape(h)} {t:.4g}" for h, t in evaluation.thresholds.items())
    turn = (
        ""
        if evaluation.system is None
        else f" Every prompt under the system turn {html.escape(repr(evaluation.system))}."
    )
    images = "".join(_figure(name, (path / name).read_bytes()) for name in pictures)
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>body{{font-family:sans-serif;max-width:60em;margin:2em auto}}table{{border-collapse:collapse}}
td,th{{border:1px solid #ccc;padding:.2em .6em;text-align:right}}td:first-child{{text-align:left}}
figure{{display:inline-block;margin:1em}}img{{max-width:100%}}</style></head>
<body><h1>{html.escape(title)}</h1>
<p>Thresholds: {thresholds}. <em>flagged</em> is a benign source's false-positive rate and an unsafe source's
true-positive rate at those thresholds; <em>by</em> a head, the share above that head's own threshold (a row above
several counts for each); AUROC is each head's score on the source against every benign row; <em>at 5% FPR</em> an
unsafe source's true-positive rate at thresholds set again to flag that share of every benign row
({summary["benign_rows"]}), each head keeping its share of the budget.{turn}</p>
<table><tr>{"".join(f"<th>{html.escape(h)}</th>" for h in header)}</tr>{"".join(lines)}</table>
{note}{images}
</body></html>
"""


def _figure(name: str, png: bytes) -> str:
    """An image embedded in the page, so the page is one file."""
    source = f"data:image/png;base64,{base64.b64encode(png).decode()}"
    return (
        f'<figure><img alt="{html.escape(name)}" src="{source}"><figcaption>{html.escape(name)}</figcaption></figure>'
    )


def _spread_cell(spread: dict[str, Any]) -> str:
    worst = spread["worst"]
    return f"{spread['median']:.1%} / {worst['rate']:.1%} ({worst['source']})"


def _percent(value: float | None) -> str:
    return "–" if value is None else f"{value:.1%}"


def _number(value: float | None) -> str:
    return "–" if value is None else f"{value:.3f}"
