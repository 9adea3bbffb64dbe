"""Threshold at a target FPR and detection metrics, against hand-computed values."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from hf_lsad.core.metrics import auroc, tpr_at_fpr
from hf_lsad.guard.threshold import (
    allowed_flags,
    budget_thresholds,
    conformal_p_values,
    fpr_threshold,
    sorted_holdout,
)


@pytest.mark.parametrize(
    "scores, fpr, expected",
    [
        (list(range(1, 21)), 0.05, 19.0),  # F(19) = 0.95 >= 0.95: flags only 20, FPR 1/20
        (list(range(1, 21)), 0.10, 18.0),
        (list(range(1, 11)), 0.05, 10.0),  # m=10: ceil(9.5) = 10th order statistic, flags nothing
        ([3.0, 1.0, 2.0, 2.0], 0.5, 2.0),  # ties: F(2) = 0.75 >= 0.5
        ([5.0], 0.05, 5.0),
    ],
)
def test_fpr_threshold_is_the_safe_quantile(scores, fpr, expected):
    threshold = fpr_threshold(torch.tensor(scores), fpr)
    assert threshold == expected
    assert (torch.tensor(scores) > threshold).float().mean() <= fpr


def test_fpr_threshold_rejects_bad_input():
    with pytest.raises(ValueError, match="target_fpr"):
        fpr_threshold(torch.ones(3), 0.0)
    with pytest.raises(ValueError, match="at least one"):
        fpr_threshold(torch.ones(0), 0.05)
    with pytest.raises(ValueError, match="NaN"):
        fpr_threshold(torch.tensor([1.0, float("nan")]), 0.05)


def test_auroc_hand_computed_with_ties():
    # pairs (neg, pos): 0.1<0.35 ok, 0.4>0.35 no, 0.1<0.8 ok, 0.4<0.8 ok, tie 0.4=0.4 counts 1/2
    assert auroc([0.1, 0.4], [0.35, 0.8, 0.4]) == pytest.approx((1 + 0 + 1 + 1 + 1 + 0.5) / 6)
    assert auroc([0, 0], [1, 1]) == 1.0
    assert auroc([1, 1], [1, 1]) == 0.5


def test_tpr_at_exact_five_percent_fpr():
    negatives = np.arange(20.0)  # FPR steps of 5%
    positives = np.array([18.5, 19.5, 25.0, 30.0, 5.0])
    # threshold between 18 and 19: FPR = 1/20 exactly; positives above 18.5 (incl.): 18.5, 19.5, 25, 30 -> 4/5
    assert tpr_at_fpr(negatives, positives, 0.05) == pytest.approx(0.8)
    # at 0% FPR only scores above 19 count: 19.5, 25, 30 -> 3/5
    assert tpr_at_fpr(negatives, positives, 0.0) == pytest.approx(0.6)


# --- conformal p-values ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "holdout, scores, expected",
    [
        ([1.0, 2.0, 3.0, 4.0], [0.5, 1.0, 2.5, 4.0, 9.0], [5 / 5, 5 / 5, 3 / 5, 2 / 5, 1 / 5]),
        ([2.0, 2.0, 2.0], [2.0, 1.9, 2.1], [4 / 4, 4 / 4, 1 / 4]),  # ties count as at least as unusual
        ([0.0], [-1.0, 0.0, 1.0], [1.0, 1.0, 0.5]),
    ],
)
def test_conformal_p_values_follow_the_formula(holdout, scores, expected):
    p = conformal_p_values(torch.tensor(scores), sorted_holdout(torch.tensor(holdout)))
    assert p.tolist() == pytest.approx(expected, abs=0)


def test_conformal_p_values_equal_brute_force_counts_with_ties():
    generator = torch.Generator().manual_seed(0)
    holdout = torch.randint(0, 20, (301,), generator=generator).float()  # many ties
    scores = torch.cat([holdout[:50], torch.randint(-2, 23, (200,), generator=generator).float()])
    p = conformal_p_values(scores, sorted_holdout(holdout))
    brute = [(1 + int((holdout >= s).sum())) / (len(holdout) + 1) for s in scores.tolist()]
    assert p.tolist() == brute


@pytest.mark.parametrize("q", [0.01, 0.05, 0.2])
def test_flagged_scores_have_p_values_near_the_target_fpr(q):
    holdout = torch.randn(1000, generator=torch.Generator().manual_seed(1))
    threshold = fpr_threshold(holdout, q)
    scores = torch.linspace(-4, 4, 2001)
    p = conformal_p_values(scores, sorted_holdout(holdout))
    bound = (1 + 1000 - math.ceil(1000 * (1 - q))) / 1001
    assert (p[scores > threshold] <= bound + 1e-12).all() and (p[scores <= threshold] > bound - 1e-12).all()


def test_sorted_holdout_rejects_empty_and_nan():
    with pytest.raises(ValueError, match="non-empty"):
        sorted_holdout(torch.tensor([]))
    with pytest.raises(ValueError, match="finite"):
        sorted_holdout(torch.tensor([1.0, float("nan")]))


@pytest.mark.parametrize(
    "rows, fpr, confidence", [(1338, 0.05, 0.95), (1338, 0.01, 0.95), (500, 0.05, 0.9), (59, 0.05, 0.95)]
)
def test_allowed_flags_is_the_binomial_bound(rows, fpr, confidence):
    from scipy.stats import binom

    k = allowed_flags(rows, fpr, confidence)
    assert binom.cdf(k, rows, fpr) <= 1 - confidence < binom.cdf(k + 1, rows, fpr)
    assert allowed_flags(rows, fpr) == math.floor(rows * fpr)


def test_allowed_flags_refuses_too_few_rows_and_bad_confidence():
    with pytest.raises(ValueError, match="need at least 59"):
        allowed_flags(58, 0.05, 0.95)
    with pytest.raises(ValueError, match="confidence"):
        allowed_flags(100, 0.05, 1.0)
    with pytest.raises(ValueError, match="at least one"):
        allowed_flags(0, 0.05)


def test_confidence_bounds_the_rate_on_fresh_rows():
    # Uniform safe scores: a threshold t flags fresh safe rows at the rate 1 - t exactly.
    generator = torch.Generator().manual_seed(0)
    draws, rows, fpr = 2000, 500, 0.05
    over = {None: 0, 0.9: 0}
    for _ in range(draws):
        scores = torch.rand(rows, generator=generator)
        for confidence in over:
            over[confidence] += 1 - fpr_threshold(scores, fpr, confidence) > fpr
    assert over[0.9] / draws <= 0.12  # at most 1 - confidence, up to sampling error
    assert over[None] / draws >= 0.35  # the quantile rule overshoots about half the time


def test_budget_with_confidence_flags_at_most_the_allowed_rows():
    scores = torch.rand(1338, 2, generator=torch.Generator().manual_seed(1))
    for confidence in (None, 0.95):
        thresholds = budget_thresholds(scores, 0.05, [0.1, 0.9], confidence=confidence)
        flagged = int((scores > torch.tensor(thresholds, dtype=torch.float32)).any(1).sum())
        assert flagged <= allowed_flags(1338, 0.05, confidence)
        assert flagged >= allowed_flags(1338, 0.05, confidence) - 2  # the budget is used, not wasted


def test_budget_with_groups_holds_every_group_within_the_target():
    generator = torch.Generator().manual_seed(2)
    # a user's traffic the heads score low, beside chat they score higher: thresholds on the traffic alone flag chat
    traffic, chat = torch.rand(400, 2, generator=generator) * 0.5, torch.rand(1338, 2, generator=generator)
    scores = torch.cat([traffic, chat])
    groups = torch.cat([torch.zeros(400, dtype=torch.long), torch.ones(1338, dtype=torch.long)])
    alone = torch.tensor(budget_thresholds(traffic, 0.05, [0.5, 0.5], confidence=0.95))
    assert float((chat > alone).any(1).double().mean()) > 0.3
    thresholds = torch.tensor(budget_thresholds(scores, 0.05, [0.5, 0.5], confidence=0.95, groups=groups))
    for rows in (traffic, chat):
        flagged = int((rows > thresholds).any(1).sum())
        assert flagged <= allowed_flags(len(rows), 0.05, 0.95)
    assert (
        int((chat > thresholds).any(1).sum()) >= allowed_flags(1338, 0.05, 0.95) - 2
    )  # the binding group's budget is used


def test_budget_with_one_group_is_the_budget_without_groups():
    scores = torch.rand(500, 2, generator=torch.Generator().manual_seed(3))
    one = torch.full((500,), 7, dtype=torch.long)
    assert budget_thresholds(scores, 0.05, [0.2, 0.8], groups=one) == budget_thresholds(scores, 0.05, [0.2, 0.8])


@pytest.mark.parametrize(
    "groups, message",
    [
        (torch.zeros(499, dtype=torch.long), "groups must be"),
        (torch.zeros(500), "groups must be"),
        (torch.zeros(500, dtype=torch.bool), "groups must be"),
        (torch.cat([torch.zeros(490, dtype=torch.long), torch.ones(10, dtype=torch.long)]), "need at least 59"),
    ],
)
def test_budget_refuses_bad_groups(groups, message):
    scores = torch.rand(500, 2, generator=torch.Generator().manual_seed(4))
    with pytest.raises(ValueError, match=message):
        budget_thresholds(scores, 0.05, [0.5, 0.5], confidence=0.95, groups=groups)
