"""Detection metrics on score arrays: unsafe rows are positives, safe rows negatives.

Small exact functions (AUROC with ties counted one half, TPR at a target FPR,
FPR at a target TPR, flag rate at a threshold, mean and std over seeds) and
:class:`DetectionMetrics`, the same numbers as an offline ``evaluate`` metric.
"""

from __future__ import annotations

from collections.abc import Sequence

import datasets
import evaluate
import numpy as np
from sklearn.metrics import roc_auc_score, roc_curve


def _labelled(negatives: np.ndarray, positives: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    negatives, positives = np.asarray(negatives, float).ravel(), np.asarray(positives, float).ravel()
    if len(negatives) == 0 or len(positives) == 0:
        raise ValueError("need at least one negative and one positive score")
    labels = np.concatenate([np.zeros(len(negatives)), np.ones(len(positives))])
    return labels, np.concatenate([negatives, positives])


def auroc(negatives: np.ndarray, positives: np.ndarray) -> float:
    """Area under the ROC curve; ties count one half."""
    labels, scores = _labelled(negatives, positives)
    return float(roc_auc_score(labels, scores))


def tpr_at_fpr(negatives: np.ndarray, positives: np.ndarray, fpr: float = 0.05) -> float:
    """True-positive rate at the ROC operating point whose false-positive rate is ``fpr``.

    On the step ROC curve this is the largest TPR among thresholds whose FPR
    does not exceed ``fpr`` (the paper's TPR@5%FPR).
    """
    labels, scores = _labelled(negatives, positives)
    fprs, tprs, _ = roc_curve(labels, scores, drop_intermediate=False)
    return float(tprs[fprs <= fpr + 1e-12].max())


def fpr_at_tpr(negatives: np.ndarray, positives: np.ndarray, tpr: float = 0.95) -> float:
    """False-positive rate at the ROC operating point whose true-positive rate reaches ``tpr``.

    On the step ROC curve this is the smallest FPR among thresholds whose TPR
    is at least ``tpr`` (the usual FPR@95%TPR).
    """
    if not 0.0 <= tpr <= 1.0:
        raise ValueError(f"tpr must be in [0, 1], got {tpr}")
    labels, scores = _labelled(negatives, positives)
    fprs, tprs, _ = roc_curve(labels, scores, drop_intermediate=False)
    return float(fprs[tprs >= tpr - 1e-12].min())


def flag_rate(scores: np.ndarray, threshold: float) -> float:
    """Fraction of ``scores`` strictly above ``threshold``: the rows a guard flags.

    On benign out-of-distribution data with the threshold set at 5% held-out
    safe FPR, this is the paper's benign-OOD false-positive rate.
    """
    scores = np.asarray(scores, float).ravel()
    if len(scores) == 0:
        raise ValueError("need at least one score")
    if np.isnan(scores).any():
        raise ValueError("scores contain NaN")
    return float((scores > threshold).mean())


def mean_std(values: Sequence[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (``ddof=1``) of per-seed values; the std of one value is 0."""
    values = np.asarray(values, float).ravel()
    if len(values) == 0:
        raise ValueError("need at least one value")
    return float(values.mean()), (float(values.std(ddof=1)) if len(values) > 1 else 0.0)


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
            features=datasets.Features({"predictions": datasets.Value("float64"), "references": datasets.Value("int32")}),
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
