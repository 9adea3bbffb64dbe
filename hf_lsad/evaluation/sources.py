"""Judging a guard the way a user meets it: harm and benign traffic from sources it never saw.

The protocol, in one place:

- **Rows** come from activation stores of the bundled pools (one store per pool and read, as
  ``hf-lsad collect --layer ... --position ...`` writes them: ``<folder>/<pool>/layer<L>-<position>``), each
  with its ``source`` (the package file it came from) and its benign domain.
- **Splits** are drawn per row from a hash of its id and a seed (:func:`split_of`): 60% fit, 20%
  validation, 20% test, the same for a row whichever subset of its pool was collected. Methods, layers and
  settings are chosen on validation rows; figures are reported on test rows.
- **Thresholds** are set on held-out benign chat: the score above which ``fpr`` of the chat rows of the
  threshold split lie (:func:`threshold_at`), at 5% and 1%; with a ``confidence``, the lower score that bounds the
  rate on fresh chat as the guard's budget does (:func:`~hf_lsad.guard.threshold.allowed_flags`).
- **Leave one source out** (:func:`leave_one_source_out`): for each unsafe source of :data:`EVAL_SOURCES`,
  fit on the fit rows of every *other* source and every benign domain, set the threshold, and report the
  held-out source's true-positive rate; the table gives each source, the median and the worst. Likewise
  each benign domain of :data:`EVAL_DOMAINS` is held out and its false-positive rate reported (when chat
  itself is held out, the threshold is set on the other benign domains).

A *method* is a function from training rows to a scorer (``fit(rows) -> score(rows) -> Tensor``), so the
supervised head, a text baseline and the anomaly head all go through the same protocol.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ..core.hook_point import Read
from ..core.splits import split_of
from ..data import load_pool
from ..data.pools import EVAL_SOURCES, is_reserved, is_unsafe_pool
from ..data.store import load_activations
from ..guard.threshold import budget_thresholds, fpr_threshold, union_flag_rate

BENIGN_DOMAINS: dict[str, str] = {
    "chat": "chat",
    "safe": "task_prompts",
    "benign_ood": "benign_ood",
    "lookalike": "lookalike",
    "questions": "questions",
    "statements": "statements",
}
"""Benign pool -> the domain it is held out as."""

EVAL_DOMAINS: tuple[str, ...] = ("chat", "task_prompts", "benign_ood", "lookalike")
"""The benign domains held out one at a time by default: the four the guard was first judged on. The domains of the
registry search (``questions``, ``statements``) are training data and are held out only when asked for, so the
summary stays comparable across the data added."""

THRESHOLD_DOMAIN = "chat"
"""Thresholds are set on held-out benign chat: the traffic a deployed guard mostly sees."""

REPORTED_FPRS: tuple[float, ...] = (0.05, 0.01)
"""The shares of held-out benign rows at which true-positive rates are reported: 5% and 1%."""


@dataclass
class SourceRows:
    """Rows of several pools with the activations of each read and what the protocol needs to know of them."""

    features: dict[Read, Tensor]
    """Per read, ``[n, hidden]`` float32."""
    ids: list[str]
    texts: list[str]
    sources: list[str]
    domains: list[str]
    """The benign domain of a benign row (:data:`BENIGN_DOMAINS`), ``"unsafe"`` for an unsafe row."""
    labels: Tensor
    """``[n]``: 1 for a row of an unsafe pool, 0 for a benign one."""
    splits: list[str]

    def __len__(self) -> int:
        return len(self.ids)

    def select(self, mask: Sequence[bool] | Tensor) -> SourceRows:
        keep = torch.as_tensor(list(mask) if not isinstance(mask, Tensor) else mask, dtype=torch.bool)
        index = keep.nonzero().flatten()
        pick = index.tolist()
        return SourceRows(
            features={read: values[index] for read, values in self.features.items()},
            ids=[self.ids[i] for i in pick],
            texts=[self.texts[i] for i in pick],
            sources=[self.sources[i] for i in pick],
            domains=[self.domains[i] for i in pick],
            labels=self.labels[index],
            splits=[self.splits[i] for i in pick],
        )

    def where(
        self,
        *,
        split: str | None = None,
        source: str | None = None,
        domain: str | None = None,
        label: int | None = None,
    ) -> list[bool]:
        """A row mask: rows of ``split``, ``source``, ``domain`` and ``label`` (``None``: any)."""
        return [
            (split is None or self.splits[i] == split)
            and (source is None or self.sources[i] == source)
            and (domain is None or self.domains[i] == domain)
            and (label is None or int(self.labels[i]) == label)
            for i in range(len(self))
        ]


def load_source_rows(folder: str | Path, pools: Sequence[str], reads: Sequence[Read], *, seed: int = 0) -> SourceRows:
    """The rows of ``pools`` collected under ``folder`` (``<folder>/<pool>/layer<L>-<position>``) for ``reads``,
    without the :data:`~hf_lsad.data.pools.RESERVED_PROMPTS`."""
    features: dict[Read, list[Tensor]] = {read: [] for read in reads}
    ids, texts, sources, domains, labels = [], [], [], [], []
    for pool in pools:
        stores = {read: load_activations(Path(folder) / pool / f"layer{read[0]}-{read[1]}") for read in reads}
        records = next(iter(stores.values())).records
        for read, store in stores.items():
            if [r["id"] for r in store.records] != [r["id"] for r in records]:
                raise ValueError(f"{folder}/{pool}: the stores of {read} and {reads[0]} hold other rows")
            features[read].append(store.activations.float())
        text_of = {p.id: p.text for p in load_pool(pool)}
        keep = torch.tensor([not is_reserved(text_of[r["id"]]) for r in records])
        for read in stores:
            features[read][-1] = features[read][-1][keep]
        unsafe = is_unsafe_pool(pool)
        for record in (r for r, kept in zip(records, keep.tolist()) if kept):
            ids.append(record["id"])
            texts.append(text_of[record["id"]])
            sources.append(record["source"])
            domains.append("unsafe" if unsafe else BENIGN_DOMAINS[pool])
            labels.append(int(unsafe))
    return SourceRows(
        features={read: torch.cat(parts) for read, parts in features.items()},
        ids=ids,
        texts=texts,
        sources=sources,
        domains=domains,
        labels=torch.tensor(labels),
        splits=[split_of(i, seed) for i in ids],
    )


def threshold_at(
    benign_scores: Tensor, fpr: float, shares: Sequence[float] | None = None, confidence: float | None = None
) -> list[float]:
    """Thresholds at which at most ``fpr`` of the benign rows are flagged (with ``confidence``: at most ``fpr`` of
    fresh rows, with that probability), as a guard sets them: one head's ``[n]`` scores
    (:func:`~hf_lsad.guard.threshold.fpr_threshold`), or several heads' ``[n, heads]`` sharing the budget by
    ``shares`` (:func:`~hf_lsad.guard.threshold.budget_thresholds`; default: equal shares)."""
    if len(benign_scores) == 0:
        raise ValueError("no benign rows to set a threshold on")
    if benign_scores.ndim == 1:
        return [fpr_threshold(benign_scores, fpr, confidence)]
    shares = [1.0] * benign_scores.shape[1] if shares is None else shares
    return budget_thresholds(benign_scores, fpr, shares, confidence=confidence)


def threshold_reference(rows: SourceRows, held_out_domain: str | None = None) -> SourceRows:
    """The rows thresholds are set on: the validation split's chat; when chat itself is the benign domain held out,
    the validation rows of every other benign domain."""
    if held_out_domain != THRESHOLD_DOMAIN:
        return rows.select(rows.where(split="validation", domain=THRESHOLD_DOMAIN))
    return rows.select(
        [s == "validation" and d not in ("unsafe", held_out_domain) for s, d in zip(rows.splits, rows.domains)]
    )


Method = Callable[[SourceRows], Callable[[SourceRows], Tensor]]
"""``fit(training rows) -> score(rows)``: ``[n]`` scores (higher: more likely unsafe), or ``[n, heads]`` for a
guard of several heads (a row is flagged when any head's score exceeds its threshold)."""


def _rate(scores: Tensor, thresholds: list[float]) -> float:
    if not len(scores):
        return float("nan")
    return union_flag_rate(scores.reshape(len(scores), -1), thresholds)


def leave_one_source_out(
    rows: SourceRows,
    method: Method,
    *,
    evaluate_on: str = "validation",
    fprs: Sequence[float] = REPORTED_FPRS,
    sources: Sequence[str] = EVAL_SOURCES,
    domains: Sequence[str] = EVAL_DOMAINS,
    shares: Sequence[float] | None = None,
    confidence: float | None = None,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """TPR of each unsafe source and FPR of each benign domain, each held out of the fit entirely.

    The method is fitted on the ``fit`` split without the held-out group; thresholds are set on the chat rows
    of the ``validation`` split (the held-out group's own rows never set one); rates are measured on the
    held-out group's rows of ``evaluate_on`` (``validation`` to choose, ``test`` to report). A method of several
    heads shares each false-positive budget by ``shares``; ``confidence`` sets the thresholds as a guard with that
    budget confidence does (:func:`threshold_at`).
    """
    fit_rows = rows.where(split="fit")
    threshold_rows = threshold_reference(rows)
    result: dict[str, Any] = {
        "evaluate_on": evaluate_on,
        "fprs": list(fprs),
        "confidence": confidence,
        "sources": {},
        "domains": {},
    }
    for source in sources:
        if progress:
            progress(f"hold out source {source}")
        train = rows.select([f and s != source for f, s in zip(fit_rows, rows.sources)])
        score = method(train)
        held_out = rows.select(rows.where(split=evaluate_on, source=source))
        benign = score(threshold_rows)
        positives = score(held_out)
        result["sources"][source] = {
            "rows": len(held_out),
            **{f"tpr@{fpr:g}": _rate(positives, threshold_at(benign, fpr, shares, confidence)) for fpr in fprs},
        }
    for domain in domains:
        if progress:
            progress(f"hold out domain {domain}")
        train = rows.select([f and d != domain for f, d in zip(fit_rows, rows.domains)])
        score = method(train)
        reference = threshold_reference(rows, domain)
        held_out = rows.select(rows.where(split=evaluate_on, domain=domain))
        benign, negatives = score(reference), score(held_out)
        result["domains"][domain] = {
            "rows": len(held_out),
            **{f"fpr@{fpr:g}": _rate(negatives, threshold_at(benign, fpr, shares, confidence)) for fpr in fprs},
        }
    for fpr in fprs:
        tprs = [entry[f"tpr@{fpr:g}"] for entry in result["sources"].values()]
        worst_source = min(result["sources"], key=lambda s: result["sources"][s][f"tpr@{fpr:g}"])
        fps = [entry[f"fpr@{fpr:g}"] for entry in result["domains"].values()]
        result[f"summary@{fpr:g}"] = {
            "median_tpr": statistics.median(tprs),
            "worst_tpr": min(tprs),
            "worst_source": worst_source,
            "median_domain_fpr": statistics.median(fps),
            "worst_domain_fpr": max(fps),
        }
    return result
