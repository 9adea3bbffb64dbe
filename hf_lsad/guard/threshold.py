"""Turning scores into decisions: the threshold at a target safe false-positive rate.

The threshold is the safe-quantile rule of the paper (appendix G, Proposition
"safe quantile"): on held-out safe scores ``s'_1..s'_m`` with empirical CDF
``F_m``, ``tau_q = inf{t : F_m(t) >= 1 - q}``, and an input is flagged when
``s > tau_q`` (strict). Then the flagged fraction of those safe scores is at
most ``q``, and on fresh safe data at most ``q + sqrt(log(2/delta) / 2m)`` with
probability ``1 - delta`` (DKW).

That bound is about a rate: half the time a fresh sample of safe rows is flagged above ``q``. With a
``confidence`` ``c`` the threshold instead flags at most :func:`allowed_flags` of the ``m`` rows, the largest
``k`` with ``P(Binomial(m, q) <= k) <= 1 - c``. For exchangeable continuous scores the safe rate of a threshold
with ``k`` of ``m`` held-out rows above it is ``Beta(k + 1, m - k)``, and ``P(Beta(k + 1, m - k) <= q) =
P(Binomial(m, q) >= k + 1)``, so on fresh rows of the same distribution the rate is at most ``q`` with
probability at least ``c`` (a training-conditional guarantee, Vovk 2012). On 1,338 rows at ``q = 0.05`` and
``c = 0.95`` that flags 53 rows (4.0%) instead of 66.

The same held-out scores give every input a conformal p-value,
``p(s) = (1 + #{j : s'_j >= s}) / (m + 1)``: the share of safe prompts at least
as unusual as this one. Flagging stays ``s > tau_q``; a flagged score has
``p <= (1 + m - ceil(m (1 - q))) / (m + 1)``, about ``q``, so the p-value states
the same decision in a unit a person can read ("more unusual than 99.2% of
safe prompts").
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor


def allowed_flags(rows: int, target_fpr: float, confidence: float | None = None) -> int:
    """How many of ``rows`` held-out safe rows a threshold at ``target_fpr`` may flag.

    Without ``confidence``: ``floor(rows * target_fpr)``, the safe-quantile rule. With it: the largest ``k`` such
    that ``P(Binomial(rows, target_fpr) <= k) <= 1 - confidence``, so that fresh safe rows are flagged at a rate of
    at most ``target_fpr`` with probability ``confidence`` (see the module docstring).
    """
    if not 0.0 < target_fpr < 1.0:
        raise ValueError(f"target_fpr must be in (0, 1), got {target_fpr}")
    if rows < 1:
        raise ValueError("need at least one held-out safe score to set a threshold")
    if confidence is None:
        return math.floor(rows * target_fpr + 1e-9)
    if not 0.5 <= confidence < 1.0:
        raise ValueError(f"confidence must be in [0.5, 1), got {confidence}")
    from scipy.stats import binom  # over a second to import: only setting thresholds with a confidence needs it

    cdf = binom.cdf(np.arange(rows + 1), rows, target_fpr)  # P(Binomial(rows, q) <= k), ascending in k
    allowed = int(np.searchsorted(cdf, 1.0 - confidence, side="right")) - 1
    if allowed < 0:
        needed = math.ceil(math.log(1.0 - confidence) / math.log1p(-target_fpr))
        raise ValueError(
            f"{rows} held-out safe rows cannot bound the rate at {target_fpr:g} with confidence {confidence:g}: "
            f"need at least {needed}"
        )
    return allowed


def fpr_threshold(safe_scores: Tensor, target_fpr: float, confidence: float | None = None) -> float:
    """``tau_q = inf{t : F_m(t) >= 1 - q}`` over held-out safe scores, for ``q = target_fpr``; with ``confidence``,
    the order statistic that leaves :func:`allowed_flags` rows above it."""
    if not 0.0 < target_fpr < 1.0:
        raise ValueError(f"target_fpr must be in (0, 1), got {target_fpr}")
    scores = safe_scores.detach().flatten().double().sort().values
    if len(scores) == 0:
        raise ValueError("need at least one held-out safe score to set a threshold")
    if not torch.isfinite(scores).all():
        raise ValueError("held-out safe scores contain NaN or inf")
    # F_m(s_(i)) = i/m, so the infimum is the order statistic s_(m - k) with k = floor(mq) rows above it.
    rank = len(scores) - allowed_flags(len(scores), target_fpr, confidence)
    return scores[max(rank, 1) - 1].item()


def conformal_p_values(scores: Tensor, holdout_scores: Tensor) -> Tensor:
    """``(1 + #{held-out >= s}) / (m + 1)`` for each of ``scores``, ``[batch]`` float64.

    ``holdout_scores`` are the ``m`` held-out safe scores the threshold was set on,
    sorted ascending (as :func:`sorted_holdout` returns them); ties count as "at
    least as unusual".
    """
    m = len(holdout_scores)
    if m == 0:
        raise ValueError("need at least one held-out safe score for a p-value")
    reference = holdout_scores.to(device=scores.device, dtype=torch.float64)
    # searchsorted(left) = #{held-out < s}, so #{held-out >= s} = m - that.
    below = torch.searchsorted(reference, scores.detach().double().contiguous(), right=False)
    return (1 + m - below).double() / (m + 1)


def sorted_holdout(holdout_scores: Tensor) -> Tensor:
    """The held-out safe scores as a guard stores them: finite, float32, ascending, on the CPU."""
    scores = holdout_scores.detach().flatten().float().cpu()
    if len(scores) == 0 or not torch.isfinite(scores).all():
        raise ValueError("held-out safe scores must be a non-empty set of finite numbers")
    return scores.sort().values


def budget_thresholds(
    benign_scores: Tensor,
    target_fpr: float,
    shares: Sequence[float],
    *,
    confidence: float | None = None,
    groups: Tensor | None = None,
    iterations: int = 60,
) -> list[float]:
    """Thresholds for several heads that share one false-positive budget on held-out benign rows.

    ``benign_scores`` is ``[n, heads]`` (each head's score of each benign row). Head ``h`` gets the threshold
    :func:`fpr_threshold` gives at ``shares[h] * alpha``, and ``alpha`` is the largest (found by bisection) for
    which the rows flagged by *any* head are at most :func:`allowed_flags` of the ``n`` (``target_fpr`` of them
    without ``confidence``): the union, not each head, meets the target. Heads that flag the same rows leave more
    budget to each other. The thresholds fall as ``alpha`` grows, so the union is one nested family of rules and the
    ``confidence`` guarantee of :func:`allowed_flags` holds for it as for one head.

    ``groups`` (``[n]`` integers, default one group) names several kinds of benign rows, a user's traffic and the
    bundled chat for instance: the union then meets the target in *every* group, each bounded on its own rows (the
    quantiles stay those of all rows pooled, one nested family still). A group too small for the ``confidence`` is
    refused, as too few rows are.
    """
    if benign_scores.ndim != 2 or benign_scores.shape[1] != len(shares):
        raise ValueError(f"expected benign scores [n, {len(shares)}], got {tuple(benign_scores.shape)}")
    if not 0.0 < target_fpr < 1.0:
        raise ValueError(f"target_fpr must be in (0, 1), got {target_fpr}")
    if any(share <= 0 for share in shares):
        raise ValueError(f"every head needs a positive share of the budget, got {list(shares)}")
    scores = benign_scores.double()
    if groups is None:
        groups = torch.zeros(len(scores), dtype=torch.long)
    if groups.shape != (len(scores),) or groups.dtype.is_floating_point or groups.dtype == torch.bool:
        shape = tuple(groups.shape)
        raise ValueError(f"groups must be [n] integers for {len(scores)} rows, got {groups.dtype} {shape}")
    members = [groups == group for group in groups.unique().tolist()]  # [n] masks, one per group
    allowed = [allowed_flags(int(member.sum()), target_fpr, confidence) for member in members]
    total = sum(shares)
    shares = [share / total for share in shares]

    def thresholds(alpha: float) -> list[float]:
        # a quantile at q -> 0 is the largest score: that head flags nothing on these rows
        return [
            fpr_threshold(scores[:, h], min(max(share * alpha, 1e-12), 1.0 - 1e-9)) for h, share in enumerate(shares)
        ]

    def within_budget(alpha: float) -> bool:
        flagged = (scores > torch.tensor(thresholds(alpha), dtype=torch.float64)).any(1)  # [n]
        return all(int(flagged[member].sum()) <= limit for member, limit in zip(members, allowed))

    low, high = 0.0, 1.0 / max(shares)  # within_budget(low): no row is flagged
    for _ in range(iterations):
        middle = (low + high) / 2
        low, high = (middle, high) if within_budget(middle) else (low, middle)
    return thresholds(low)


def union_flag_rate(scores: Tensor, thresholds: Sequence[float]) -> float:
    """The fraction of rows of ``scores`` ``[n, heads]`` that any head flags (a score above its threshold)."""
    return float((scores.double() > torch.tensor(list(thresholds), dtype=torch.float64)).any(1).double().mean())
