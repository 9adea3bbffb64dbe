"""A guard judged on labelled prompt files through its model: every head, per source, at its own thresholds.

What ``hf-lsad evaluate --guard G --benign-prompts NAME=FILE ... --unsafe-prompts NAME=FILE ...`` runs. Each
source's prompts are screened as ``generate`` would screen them (:mod:`hf_lsad.generation.bulk`, so any guard that
reads the prompt works, two-headed guards included, with no activation store), then each benign source gives its
flag rate and each unsafe source its flag rate (the TPR at the guard's thresholds) and, per head, the AUROC of its
score against every benign row pooled. :mod:`hf_lsad.evaluation.plots` draws the same numbers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
from sklearn.metrics import roc_auc_score

from ..data.tables import PromptRow
from ..generation.bulk import left_padded, tokenize_rows
from ..generation.model import GuardedModelForCausalLM
from ..guard.types import SafetyReport


@dataclass
class SourceScores:
    """One source's verdicts."""

    name: str
    unsafe: bool
    """Whether the source's prompts should be flagged."""
    flagged: np.ndarray
    """``[rows]`` bool: flagged by the guard (rows that failed closed included)."""
    head_scores: dict[str, np.ndarray] = field(default_factory=dict)
    """Each head's ``[rows]`` deciding score (NaN for a row that failed closed)."""
    errors: list[str] = field(default_factory=list)
    """Rows not screened (empty, not text, beyond the context), with why."""


@dataclass
class PromptEvaluation:
    """Every source's verdicts and each head's threshold."""

    sources: list[SourceScores]
    thresholds: dict[str, float]
    """Each head's threshold, the anomaly head first."""

    def metrics(self) -> dict[str, dict[str, Any]]:
        """Per source: ``rows``, ``flagged`` (the FPR of a benign source, the TPR of an unsafe one) and, for an
        unsafe source, ``auroc_<head>`` against every benign row pooled; ``errors`` when rows were not screened."""
        benign = [s for s in self.sources if not s.unsafe]
        rows: dict[str, dict[str, Any]] = {}
        for source in self.sources:
            entry: dict[str, Any] = {"unsafe": source.unsafe, "rows": len(source.flagged)}
            entry["flagged"] = float(source.flagged.mean()) if len(source.flagged) else None
            if source.unsafe and benign:
                for head in self.thresholds:
                    negatives = np.concatenate([s.head_scores[head] for s in benign])
                    entry[f"auroc_{head}"] = _auroc(negatives, source.head_scores[head])
            if source.errors:
                entry["errors"] = len(source.errors)
            rows[source.name] = entry
        return rows


def evaluate_prompt_sources(
    guarded: GuardedModelForCausalLM,
    sources: dict[str, tuple[list[PromptRow], bool]],
    *,
    batch_size: int = 16,
) -> PromptEvaluation:
    """Screen each source's rows (``name -> (rows, unsafe)``) with ``guarded`` and collect the verdicts."""
    if not sources:
        raise ValueError("no prompt sources to evaluate")
    if not any(unsafe for _, unsafe in sources.values()) or all(unsafe for _, unsafe in sources.values()):
        raise ValueError("evaluation needs at least one benign and one unsafe source")
    results, thresholds = [], {}
    for name, (rows, unsafe) in sources.items():
        reports, errors = _screen(guarded, rows, batch_size)
        if not reports:
            raise ValueError(f"source {name!r}: no row could be screened ({len(errors)} errors)")
        verdicts = [r.head_verdicts() for r in reports]
        thresholds = {v.name: float(v.threshold) for v in verdicts[0]}
        scores = {
            head: np.array([np.nan if r.error else v[i].score for r, v in zip(reports, verdicts)], dtype=float)
            for i, head in enumerate(thresholds)
        }
        flagged = np.array([r.flagged for r in reports], dtype=bool)
        results.append(SourceScores(name, unsafe, flagged, scores, errors))
    return PromptEvaluation(results, thresholds)


def _screen(guarded: GuardedModelForCausalLM, rows: list[PromptRow], batch_size: int) -> tuple[list, list[str]]:
    """Reports of the rows that can be screened, and why the others cannot."""
    errors = [f"{row.id}: {row.error}" for row in rows if row.error is not None]
    readable = [row for row in rows if row.error is None]
    token_ids, too_long = tokenize_rows(guarded, readable, True)
    errors += [f"{readable[i].id}: {message}" for i, message in sorted(too_long.items())]
    order = sorted((i for i in range(len(readable)) if i not in too_long), key=lambda i: (len(token_ids[i]), i))
    reports: list[SafetyReport] = []
    for start in range(0, len(order), batch_size):
        batch = [token_ids[i] for i in order[start : start + batch_size]]
        reports += guarded.screen(*left_padded(guarded, batch))
    return reports, errors


def _auroc(negatives: np.ndarray, positives: np.ndarray) -> float | None:
    """AUROC of ``positives`` above ``negatives``; rows that failed closed count as the highest score."""
    negatives = np.nan_to_num(negatives, nan=np.inf)
    positives = np.nan_to_num(positives, nan=np.inf)
    if not len(negatives) or not len(positives):
        return None
    labels = np.r_[np.zeros(len(negatives)), np.ones(len(positives))]
    scores = np.r_[negatives, positives]
    finite_max = np.nanmax(np.where(np.isfinite(scores), scores, np.nan)) if np.isfinite(scores).any() else 0.0
    return float(roc_auc_score(labels, np.where(np.isfinite(scores), scores, finite_max + 1.0)))
