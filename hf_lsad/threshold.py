"""Turning scores into decisions: the threshold at a target safe false-positive rate.

The threshold is the safe-quantile rule of the paper (appendix G, Proposition
"safe quantile"): on held-out safe scores ``s'_1..s'_m`` with empirical CDF
``F_m``, ``tau_q = inf{t : F_m(t) >= 1 - q}``, and an input is flagged when
``s > tau_q`` (strict). Then the flagged fraction of those safe scores is at
most ``q``, and on fresh safe data at most ``q + sqrt(log(2/delta) / 2m)`` with
probability ``1 - delta`` (DKW).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def fpr_threshold(safe_scores: Tensor, target_fpr: float) -> float:
    """``tau_q = inf{t : F_m(t) >= 1 - q}`` over held-out safe scores, for ``q = target_fpr``."""
    if not 0.0 < target_fpr < 1.0:
        raise ValueError(f"target_fpr must be in (0, 1), got {target_fpr}")
    scores = safe_scores.detach().flatten().double().sort().values
    if len(scores) == 0:
        raise ValueError("need at least one held-out safe score to set a threshold")
    if not torch.isfinite(scores).all():
        raise ValueError("held-out safe scores contain NaN or inf")
    # F_m(s_(i)) = i/m, so the infimum is the order statistic s_(ceil(m(1-q))).
    rank = math.ceil(len(scores) * (1.0 - target_fpr) - 1e-9)
    return scores[max(rank, 1) - 1].item()
