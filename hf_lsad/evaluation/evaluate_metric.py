"""Detection metrics as an offline ``evaluate`` metric.

A module of its own because ``evaluate`` and ``datasets`` take seconds to import: only
code that wants an ``evaluate.Metric`` pays for them.
"""

from __future__ import annotations

from collections.abc import Sequence

import datasets
import evaluate  # a dependency only this adapter imports: no command pays its import time
import numpy as np

from ..core.metrics import auroc, fpr_at_tpr, tpr_at_fpr


class DetectionMetrics(evaluate.Metric):
    """AUROC, TPR at a target FPR and FPR at a target TPR, as an ``evaluate`` metric.

    ``evaluate.load("roc_auc")`` fetches its script from the Hub; this metric is
    defined here and works offline. Instantiate it directly::

        metric = DetectionMetrics()
        for scores, labels in batches:
            metric.add_batch(predictions=scores, references=labels)
        metric.compute()  # {"auroc": ..., "tpr_at_fpr": ..., "fpr_at_tpr": ..., "fpr": 0.05, "tpr": 0.95}

    ``predictions`` are anomaly scores (higher = more likely unsafe),
    ``references`` are 1 for unsafe (positive) and 0 for safe rows.
    ``compute(fpr=..., tpr=...)`` changes the operating points.
    """

    def _info(self) -> evaluate.MetricInfo:
        return evaluate.MetricInfo(
            description="Detection metrics for anomaly scores: AUROC, TPR at a target FPR, FPR at a target TPR.",
            citation="",
            inputs_description="predictions: float anomaly scores; references: 1 = unsafe (positive), 0 = safe.",
            features=datasets.Features(
                {"predictions": datasets.Value("float64"), "references": datasets.Value("int32")}
            ),
        )

    def _compute(
        self, predictions: Sequence[float], references: Sequence[int], fpr: float = 0.05, tpr: float = 0.95
    ) -> dict[str, float]:
        scores, labels = np.asarray(predictions, float), np.asarray(references)
        if not np.isin(labels, (0, 1)).all():
            raise ValueError("references must be 0 (safe) or 1 (unsafe)")
        negatives, positives = scores[labels == 0], scores[labels == 1]
        return {
            "auroc": auroc(negatives, positives),
            "tpr_at_fpr": tpr_at_fpr(negatives, positives, fpr),
            "fpr_at_tpr": fpr_at_tpr(negatives, positives, tpr),
            "fpr": fpr,
            "tpr": tpr,
        }
