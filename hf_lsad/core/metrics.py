"""Detection metrics on score arrays: unsafe rows are positives, safe rows negatives.

Small exact functions (AUROC with ties counted one half, TPR at a target FPR,
FPR at a target TPR, flag rate at a threshold, mean and std over seeds) and
:func:`detection_metrics`, the one place that names them: the CLI, the evaluation
grid and the model card all use its keys (:data:`METRICS`).
:class:`hf_lsad.evaluation.evaluate_metric.DetectionMetrics` gives the same numbers as
an offline ``evaluate`` metric (imported only by whoever uses it: ``evaluate`` and
``datasets`` are slow to import).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def _labelled(negatives: np.ndarray, positives: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    negatives, positives = np.asarray(negatives, float).ravel(), np.asarray(positives, float).ravel()
    if len(negatives) == 0 or len(positives) == 0:
        raise ValueError("need at least one negative and one positive score")
    labels = np.concatenate([np.zeros(len(negatives)), np.ones(len(positives))])
    return labels, np.concatenate([negatives, positives])


def auroc(negatives: np.ndarray, positives: np.ndarray) -> float:
    """Area under the ROC curve; ties count one half."""
    from sklearn.metrics import roc_auc_score  # sklearn takes seconds to import: only metric code pays for it

    labels, scores = _labelled(negatives, positives)
    return float(roc_auc_score(labels, scores))


def tpr_at_fpr(negatives: np.ndarray, positives: np.ndarray, fpr: float = 0.05) -> float:
    """True-positive rate at the ROC operating point whose false-positive rate is ``fpr``.

    On the step ROC curve this is the largest TPR among thresholds whose FPR
    does not exceed ``fpr`` (the paper's TPR@5%FPR).
    """
    from sklearn.metrics import roc_curve

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
    from sklearn.metrics import roc_curve

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
    array = np.asarray(values, float).ravel()
    if len(array) == 0:
        raise ValueError("need at least one value")
    return float(array.mean()), (float(array.std(ddof=1)) if len(array) > 1 else 0.0)


METRICS = {
    "auroc": "AUROC",
    "auroc_pooled": "AUROC, safe + benign-OOD negatives",
    "tpr_at_fpr": "TPR at the target FPR",
    "fpr_at_tpr": "FPR at the target TPR",
    "flagged": "Flagged at threshold",
}
"""The metric vocabulary: key -> title. Every per-category metrics dict uses these keys."""


def detection_metrics(
    negatives: np.ndarray,
    positives: np.ndarray,
    *,
    target_fpr: float = 0.05,
    target_tpr: float | None = None,
    flagged: np.ndarray | None = None,
    pooled_negatives: np.ndarray | None = None,
) -> dict[str, float]:
    """The metrics of one unsafe category (``positives``) against safe ``negatives``, keyed by :data:`METRICS`.

    ``auroc`` and ``tpr_at_fpr`` always; ``fpr_at_tpr`` with ``target_tpr``; ``flagged`` (the
    mean of the boolean ``flagged`` array: the share of positives the guard flags) when given;
    ``auroc_pooled`` (negatives plus ``pooled_negatives``, e.g. benign OOD) when given.
    """
    out = {"auroc": auroc(negatives, positives), "tpr_at_fpr": tpr_at_fpr(negatives, positives, target_fpr)}
    if target_tpr is not None:
        out["fpr_at_tpr"] = fpr_at_tpr(negatives, positives, target_tpr)
    if flagged is not None:
        out["flagged"] = float(np.asarray(flagged, dtype=float).mean())
    if pooled_negatives is not None:
        out["auroc_pooled"] = auroc(
            np.concatenate([np.asarray(negatives, float), np.asarray(pooled_negatives, float)]), positives
        )
    return out
