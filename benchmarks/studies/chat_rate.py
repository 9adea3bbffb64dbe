"""How much unseen chat the shipped configuration flags, measured on more chat than the threshold was set on.

The guard's thresholds are set on the validation split's chat rows (1,338) and the report measures the test split's
chat rows (1,266); each is a sample of about 1,300 rows, so either can sit in a lucky or unlucky tail. This study
measures the same rule on chat rows that are neither: the fit split's chat, cross-fitted. The fit split's chat rows
are cut into ``folds`` parts by a hash of their id; for each part the supervised head is fitted on every fit row
but that part's, its threshold set on validation chat exactly as the release does, and the part's rows (unseen by
that head) are scored. Every fit chat row is scored once, by a head that never saw it: about 3,800 rows of unseen
chat, the rate the rule gives on chat it did not fit or threshold on, with no test row involved.

The supervised head is measured alone, at the whole budget (the anomaly head was fitted on the fit split's benign
rows, so its scores there are not out of sample); the shipped guard gives it 0.9 of the budget.
"""

from __future__ import annotations

import hashlib
import statistics
from dataclasses import dataclass, field
from typing import Any

import torch
from scipy.stats import binomtest

from hf_lsad.data import GUARD_POOLS
from hf_lsad.evaluation.sources import load_source_rows, threshold_at, threshold_reference
from hf_lsad.guard.heads.training import fit_head

from .two_heads import probe_config


@dataclass
class Settings:
    folder: str = "artifacts/smollm2"
    """Where the collected stores are (``<folder>/<pool>/layer<L>-<position>``)."""
    pools: list[str] = field(default_factory=lambda: list(GUARD_POOLS))
    """Pools whose rows take part."""
    reads: list[list[Any]] = field(
        default_factory=lambda: [[16, "prompt_mean"], [20, "prompt_mean"], [24, "prompt_mean"]]
    )
    """The supervised head's reads (by default the three reads shipped before ``heads/two_heads_deep_reads4``; the
    experiments of the shipped guard set its four)."""
    inverse_regularisation: float = 1.0
    """The supervised head's ``C`` (the shipped one)."""
    kind: str = "logistic"
    """The supervised head's kind: ``logistic`` or ``mlp`` (:class:`hf_lsad.guard.heads.ProbeConfig`)."""
    mlp_units: int = 128
    """An ``mlp`` head's hidden ReLU units."""
    mlp_alpha: float = 1e-3
    """An ``mlp`` head's L2 penalty."""
    mlp_members: int = 1
    """An ``mlp`` head's fits whose logits are averaged (``ProbeConfig.mlp_members``)."""
    folds: int = 5
    """Parts the fit split's chat rows are cut into."""
    fprs: list[float] = field(default_factory=lambda: [0.05, 0.01])
    """Target false-positive rates, each set on validation chat."""
    confidences: list[float | None] = field(default_factory=lambda: [None, 0.95])
    """Threshold rules: ``None``, the quantile of validation chat; ``c``, the rule of a budget with confidence ``c``
    (:func:`hf_lsad.guard.threshold.allowed_flags`)."""
    seed: int = 0
    """Seed of the row splits."""


def fold_of(row_id: str, folds: int) -> int:
    """A row's part, from a hash of its id (independent of the fit/validation/test hash, which has its own salt)."""
    return int(hashlib.sha256(f"chat-fold:{row_id}".encode()).hexdigest(), 16) % folds


def run(settings: Settings) -> dict[str, Any]:
    config = probe_config(settings)
    rows = load_source_rows(settings.folder, settings.pools, config.reads, seed=settings.seed)
    fit = rows.select(rows.where(split="fit"))
    validation_chat = threshold_reference(rows)
    fold = [fold_of(i, settings.folds) if d == "chat" else -1 for i, d in zip(fit.ids, fit.domains)]

    rules = [(fpr, confidence) for fpr in settings.fprs for confidence in settings.confidences]
    flagged = {rule: 0 for rule in rules}
    per_fold = []
    for k in range(settings.folds):
        print(f"  fold {k + 1} of {settings.folds}", flush=True)
        train = fit.select([f != k for f in fold])
        head = fit_head("harm", train.features, train.labels, train.sources, config)
        held_out = fit.select([f == k for f in fold])
        with torch.no_grad():
            benign, scores = head(validation_chat.features), head(held_out.features)
        entry: dict[str, Any] = {"rows": len(held_out)}
        for fpr, confidence in rules:
            threshold = threshold_at(benign, fpr, confidence=confidence)[0]
            count = int((scores > threshold).sum())
            flagged[fpr, confidence] += count
            entry[rule_name(fpr, confidence)] = {
                "flagged": count,
                "validation_chat_rate": float((benign > threshold).double().mean()),
            }
        per_fold.append(entry)
    rows_scored = sum(entry["rows"] for entry in per_fold)
    summary = {}
    for fpr, confidence in rules:
        count = flagged[fpr, confidence]
        summary[rule_name(fpr, confidence)] = {
            "unseen_chat_rows": rows_scored,
            "flagged": count,
            "rate": count / rows_scored,
            "wilson_95": [float(end) for end in binomtest(count, rows_scored).proportion_ci(method="wilson")],
            "validation_chat_rate_median": statistics.median(
                entry[rule_name(fpr, confidence)]["validation_chat_rate"] for entry in per_fold
            ),
        }
        print(f"{rule_name(fpr, confidence)}: {count} of {rows_scored} unseen chat rows, {count / rows_scored:.4f}")
    return {"validation_chat_rows": len(validation_chat), "folds": per_fold, "summary": summary}


def rule_name(fpr: float, confidence: float | None) -> str:
    return f"@{fpr:g}" + (f", confidence {confidence:g}" if confidence is not None else "")
