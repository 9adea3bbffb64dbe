"""A guard judged on labelled prompt files through its model: every head, per source, at its own thresholds.

What ``hf-lsad evaluate --guard G --benign-prompts NAME=FILE ... --unsafe-prompts NAME=FILE ... [--system TURN]``
runs. Each source's prompts are screened as ``generate`` would screen them, under the deployment's system turn when
given (:mod:`hf_lsad.generation.bulk`, so any guard that reads the prompt works, two-headed guards included, with no
activation store), then each benign source gives its flag rate and each unsafe source its flag rate (the TPR at the
guard's thresholds), the share each head flagged on its own (which head catches a category, which flags a benign
source) and, per head, the AUROC of its score against every benign row pooled. Each unsafe source's TPR is also read
at thresholds set again to flag 5% and 1% of every benign row pooled (the protocol's
:data:`~hf_lsad.evaluation.sources.REPORTED_FPRS`, the heads keeping their shares of the guard's budget), which judges
the ranking apart from where the thresholds sit; the summary gives the median and the worst source of each, as the
project judges its own guards.
:mod:`hf_lsad.evaluation.plots` draws the same numbers.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from ..core.metrics import auroc
from ..core.prompt_inputs import check_system_turn
from ..data.tables import PromptRow
from ..generation.bulk import plan_batches
from ..generation.model import GuardedModelForCausalLM
from ..guard.types import SafetyReport
from .sources import REPORTED_FPRS, threshold_at


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
    head_flags: dict[str, np.ndarray] = field(default_factory=dict)
    """Each head's ``[rows]`` bool: the head was above its threshold (one of the report's ``decided_by``)."""
    errors: list[str] = field(default_factory=list)
    """Rows not screened (empty, not text, beyond the context), with why."""


@dataclass
class PromptEvaluation:
    """Every source's verdicts and each head's threshold."""

    sources: list[SourceScores]
    thresholds: dict[str, float]
    """Each head's threshold, the anomaly head first."""
    system: str | None = None
    """The system turn every prompt was screened under (``None``: the chat template's default)."""
    shares: dict[str, float] | None = None
    """Each head's share of the guard's false-positive budget (``None``: a guard without one, whose heads count
    alike), which the thresholds at :data:`~hf_lsad.evaluation.sources.REPORTED_FPRS` keep."""
    _fixed: dict[float, dict[str, float]] | None = field(default=None, init=False, repr=False, compare=False)
    """:meth:`fixed_fpr_thresholds`, set once: the metrics, the summary and the page all read them."""

    def metrics(self) -> dict[str, dict[str, Any]]:
        """Per source: ``rows``, ``flagged`` (the FPR of a benign source, the TPR of an unsafe one),
        ``flagged_by_<head>`` (the share above that head's threshold; rows above several count for each) and, for an
        unsafe source, ``auroc_<head>`` against every benign row pooled and ``flagged_at_fpr_<rate>`` at each of
        :data:`~hf_lsad.evaluation.sources.REPORTED_FPRS`; ``errors`` when rows were not screened."""
        benign = [s for s in self.sources if not s.unsafe]
        fixed = self.fixed_fpr_thresholds()
        rows: dict[str, dict[str, Any]] = {}
        for source in self.sources:
            entry: dict[str, Any] = {"unsafe": source.unsafe, "rows": len(source.flagged)}
            entry["flagged"] = float(source.flagged.mean()) if len(source.flagged) else None
            for head, flags in source.head_flags.items():
                entry[f"flagged_by_{head}"] = float(flags.mean()) if len(flags) else None
            if source.unsafe and benign:
                for head in self.thresholds:
                    negatives = np.concatenate([s.head_scores[head] for s in benign])
                    entry[f"auroc_{head}"] = _auroc(negatives, source.head_scores[head])
                for fpr, thresholds in fixed.items():
                    entry[f"flagged_at_fpr_{fpr:g}"] = self._caught(source, thresholds)
            if source.errors:
                entry["errors"] = len(source.errors)
            rows[source.name] = entry
        return rows

    def fixed_fpr_thresholds(self) -> dict[float, dict[str, float]]:
        """Per rate of :data:`~hf_lsad.evaluation.sources.REPORTED_FPRS`, each head's threshold such that the heads
        together flag that share of every benign row pooled, each keeping its share of the budget
        (:func:`~hf_lsad.evaluation.sources.threshold_at`, the plain quantile); a row that failed closed counts as
        above every threshold."""
        if self._fixed is None:
            benign = [s for s in self.sources if not s.unsafe]
            reference = torch.from_numpy(np.concatenate([self._score_matrix(s) for s in benign]))  # [benign, heads]
            shares = [1.0] * len(self.thresholds) if self.shares is None else [self.shares[h] for h in self.thresholds]
            self._fixed = {
                fpr: dict(zip(self.thresholds, threshold_at(reference, fpr, shares))) for fpr in REPORTED_FPRS
            }
        return self._fixed

    def summary(self) -> dict[str, Any]:
        """The unsafe sources together: the median and the worst source's TPR at the guard's thresholds
        (``at_guard_thresholds``) and at each of :data:`~hf_lsad.evaluation.sources.REPORTED_FPRS` of the benign rows
        (``at_fpr_<rate>``, with the
        thresholds), the figures the project judges its guards by."""
        unsafe = [s for s in self.sources if s.unsafe]
        summary: dict[str, Any] = {
            "at_guard_thresholds": median_and_worst({s.name: float(s.flagged.mean()) for s in unsafe})
        }
        for fpr, thresholds in self.fixed_fpr_thresholds().items():
            caught = {s.name: self._caught(s, thresholds) for s in unsafe}
            summary[f"at_fpr_{fpr:g}"] = {"thresholds": thresholds, **median_and_worst(caught)}
        summary["benign_rows"] = sum(len(s.flagged) for s in self.sources if not s.unsafe)
        return summary

    def _score_matrix(self, source: SourceScores) -> np.ndarray:
        """``[rows, heads]``: each head's deciding score, a row that failed closed (NaN) above every threshold."""
        return np.stack([np.nan_to_num(source.head_scores[h], nan=np.inf) for h in self.thresholds], axis=1)

    def _caught(self, source: SourceScores, thresholds: dict[str, float]) -> float:
        above = self._score_matrix(source) > np.array([thresholds[h] for h in self.thresholds])
        return float(above.any(axis=1).mean())


def median_and_worst(rates: dict[str, float]) -> dict[str, Any]:
    """``rates`` by source with their median and the worst (lowest) source: how the project reads a guard's catch."""
    worst = min(rates, key=rates.__getitem__)
    return {
        "median": statistics.median(rates.values()),
        "worst": {"source": worst, "rate": rates[worst]},
        "sources": rates,
    }


def evaluate_prompt_sources(
    guarded: GuardedModelForCausalLM,
    sources: dict[str, tuple[list[PromptRow], bool]],
    *,
    batch_size: int = 16,
    system: str | None = None,
    progress: bool = True,
) -> PromptEvaluation:
    """Screen each source's rows (``name -> (rows, unsafe)``) with ``guarded`` and collect the verdicts, with a
    progress bar per source unless ``progress`` is false. ``system``: the system turn before each prompt, as the
    deployment sends it (``None``: the template's default); a guard's thresholds hold for the turn they were set
    under, so judge a guard taught under a turn under it."""
    check_system_turn(system)
    check_prompt_sources(sources)
    results, thresholds = [], {}
    for name, (rows, unsafe) in sources.items():
        reports, errors = _screen(guarded, rows, batch_size, system, name if progress else None)
        if not reports:
            raise ValueError(f"source {name!r}: no row could be screened ({len(errors)} errors)")
        verdicts = [r.head_verdicts() for r in reports]
        thresholds = {v.name: float(v.threshold) for v in verdicts[0]}
        scores = {
            head: np.array([np.nan if r.error else v[i].score for r, v in zip(reports, verdicts)], dtype=float)
            for i, head in enumerate(thresholds)
        }
        head_flags = {head: np.array([v[i].flagged for v in verdicts], dtype=bool) for i, head in enumerate(thresholds)}
        flagged = np.array([r.flagged for r in reports], dtype=bool)
        results.append(SourceScores(name, unsafe, flagged, scores, head_flags, errors))
    budget = guarded.guard.budget
    shares = None if budget is None else dict(zip(budget.heads, budget.shares))
    return PromptEvaluation(results, thresholds, system, shares)


def check_prompt_sources(sources: dict[str, tuple[list[PromptRow], bool]]) -> None:
    """Refuse sources (``name -> (rows, unsafe)``) that cannot be evaluated: none, no benign or no unsafe one, or a
    prompt (a conversation, read whole) that one source gives as benign and another as unsafe, which would count
    against the guard both ways."""
    if not sources:
        raise ValueError("no prompt sources to evaluate")
    if not any(unsafe for _, unsafe in sources.values()) or all(unsafe for _, unsafe in sources.values()):
        raise ValueError("evaluation needs at least one benign and one unsafe source")
    benign: dict[object, str] = {}
    for name, (rows, unsafe) in sources.items():
        for row in rows if not unsafe else []:
            if row.text is not None:
                benign.setdefault(_prompt_key(row), name)
    for name, (rows, unsafe) in sources.items():
        both = [row for row in rows if unsafe and row.text is not None and _prompt_key(row) in benign]
        if both:
            raise ValueError(
                f"{len(both)} prompts of the unsafe source {name!r} are in the benign source "
                f"{benign[_prompt_key(both[0])]!r} too (each prompt has one label), e.g. {both[0].text!r}"
            )


def _prompt_key(row: PromptRow) -> object:
    """What the guard reads of a row: its conversation when it was read whole, else its prompt."""
    if row.conversation is not None:
        return tuple((turn["role"], turn["content"]) for turn in row.conversation)
    return row.text


def _screen(
    guarded: GuardedModelForCausalLM, rows: list[PromptRow], batch_size: int, system: str | None, progress: str | None
) -> tuple[list, list[str]]:
    """Reports of the rows that can be screened under ``system``, and why the others cannot; a bar named
    ``progress`` if given."""
    batches, errors = plan_batches(guarded, rows, batch_size=batch_size, system=system)
    reports: list[SafetyReport] = []
    with tqdm(total=sum(len(b.ids) for b in batches), unit="row", desc=progress, disable=progress is None) as bar:
        for batch in batches:
            reports += guarded.screen(*batch.tensors(guarded.tokenizer))
            bar.update(len(batch.ids))
    return reports, [f"{row_id}: {error}" for row_id, error in errors]


def _auroc(negatives: np.ndarray, positives: np.ndarray) -> float | None:
    """AUROC of ``positives`` above ``negatives``; rows that failed closed (NaN) count as the highest score."""
    if not len(negatives) or not len(positives):
        return None
    scores = np.r_[negatives, positives]
    top = np.nanmax(scores) + 1.0 if np.isfinite(scores).any() else 0.0
    return auroc(np.nan_to_num(negatives, nan=top), np.nan_to_num(positives, nan=top))
