"""Detection metrics on score arrays: unsafe rows are positives, safe rows negatives."""

from __future__ import annotations

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
