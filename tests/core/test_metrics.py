"""FPR at a target TPR, flag rate, mean +- std and the offline `evaluate` metric, against hand-computed values.

AUROC with ties and TPR at an exact 5% FPR are in tests/guard/test_threshold.py; the cases
here add ties at the operating point and the new functions.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hf_lsad.core.metrics import auroc, flag_rate, fpr_at_tpr, mean_std, tpr_at_fpr
from hf_lsad.evaluation.evaluate_metric import DetectionMetrics
from hf_lsad.guard.threshold import fpr_threshold

NEGATIVES = np.arange(20.0)  # 0..19: each negative is 5% of the FPR
POSITIVES = np.array([2.5, 10.5, 12.5, 15.5, 16.5, 17.5, 18.5, 19.5, 25.0, 30.0])  # each is 10% of the TPR


@pytest.mark.parametrize(
    "tpr, expected",
    [
        (0.95, 17 / 20),  # needs all 10 positives: threshold 2.5, negatives 3..19 are above it
        (1.00, 17 / 20),
        (0.90, 9 / 20),  # 9 positives: threshold 10.5, negatives 11..19
        (0.50, 2 / 20),  # 30, 25, 19.5, 18.5, 17.5: negatives 18, 19
        (0.10, 0.0),  # 30 alone
        (0.0, 0.0),
    ],
)
def test_fpr_at_tpr_hand_computed(tpr, expected):
    assert fpr_at_tpr(NEGATIVES, POSITIVES, tpr) == pytest.approx(expected)


def test_fpr_at_tpr_with_ties_between_classes():
    negatives, positives = [1.0, 2.0, 3.0], [3.0, 3.0, 4.0]
    # 2 of 3 positives need the threshold at 3, which also takes the tied negative 3.
    assert fpr_at_tpr(negatives, positives, 0.5) == pytest.approx(1 / 3)
    assert fpr_at_tpr(negatives, positives, 1 / 3) == 0.0  # 4 alone
    assert fpr_at_tpr(negatives, positives, 0.95) == pytest.approx(1 / 3)


def test_tpr_at_five_percent_fpr_cannot_take_positives_tied_with_the_next_negative():
    positives = [18.0, 18.0, 25.0, 5.0]
    # FPR exactly 5%: only the negative 19 is above the threshold, so of the positives only 25 counts;
    # the two positives tied with the negative 18 come only at FPR 10%.
    assert tpr_at_fpr(NEGATIVES, positives, 0.05) == pytest.approx(1 / 4)
    assert tpr_at_fpr(NEGATIVES, positives, 0.0999) == pytest.approx(1 / 4)
    assert tpr_at_fpr(NEGATIVES, positives, 0.10) == pytest.approx(3 / 4)


def test_flag_rate_is_strict_and_matches_the_guard_threshold_rule():
    assert flag_rate([1.0, 2.0, 3.0, 4.0], 3.0) == 0.25  # 3 is not above 3
    safe = torch.arange(1.0, 21.0)
    threshold = fpr_threshold(safe, 0.05)  # 19: flags only 20 of the safe scores
    assert flag_rate(safe.numpy(), threshold) == pytest.approx(0.05)
    benign_ood = [18.5, 19.0, 19.5, 30.0]
    assert flag_rate(benign_ood, threshold) == 0.5
    with pytest.raises(ValueError, match="at least one"):
        flag_rate([], 0.0)
    with pytest.raises(ValueError, match="NaN"):
        flag_rate([1.0, float("nan")], 0.0)


def test_mean_std_over_seeds():
    mean, std = mean_std([1.0, 2.0, 3.0, 4.0])
    assert mean == 2.5
    assert std == pytest.approx(np.sqrt(5 / 3))  # sample std: sum of squares 5, n - 1 = 3
    assert mean_std([0.7]) == (0.7, 0.0)
    with pytest.raises(ValueError, match="at least one"):
        mean_std([])


def test_detection_metrics_accumulates_batches_offline():
    metric = DetectionMetrics(keep_in_memory=True)
    scores = np.concatenate([NEGATIVES, POSITIVES])
    labels = np.concatenate([np.zeros(20, int), np.ones(10, int)])
    order = np.random.default_rng(0).permutation(len(scores))
    for chunk in np.array_split(order, 3):
        metric.add_batch(predictions=scores[chunk], references=labels[chunk])
    result = metric.compute()
    # AUROC by hand: each positive beats the negatives below it: 3+11+13+16+17+18+19+20+20+20 = 157 of 200.
    assert result["auroc"] == pytest.approx(157 / 200)
    assert result["auroc"] == pytest.approx(auroc(NEGATIVES, POSITIVES))
    # TPR at 5% FPR: threshold above 18, positives 18.5, 19.5, 25, 30.
    assert result["tpr_at_fpr"] == pytest.approx(0.4)
    assert result["fpr_at_tpr"] == pytest.approx(17 / 20)
    assert (result["fpr"], result["tpr"]) == (0.05, 0.95)

    other = DetectionMetrics(keep_in_memory=True).compute(predictions=scores, references=labels, fpr=0.0, tpr=0.5)
    assert other["tpr_at_fpr"] == pytest.approx(0.3)  # above 19: 19.5, 25, 30
    assert other["fpr_at_tpr"] == pytest.approx(0.1)


def test_detection_metrics_refuses_labels_other_than_zero_and_one():
    with pytest.raises(ValueError, match="references"):
        DetectionMetrics(keep_in_memory=True).compute(predictions=[0.1, 0.2, 0.3], references=[0, 1, 2])


def test_tpr_at_five_percent_fpr_when_tied_negatives_jump_past_it():
    negatives = [*range(18), 30.0, 30.0]  # 20 negatives; the top two tie, so the FPR jumps from 0% to 10%
    positives = [31.0, 30.0, 25.0, 1.0]
    # no threshold has an FPR of exactly 5%: the best one with FPR <= 5% is FPR 0 (only 31 above it)
    assert tpr_at_fpr(negatives, positives, 0.05) == pytest.approx(0.25)
    # at FPR 10% the threshold may go down to 25: 31, 30 (tied with the negatives) and 25
    assert tpr_at_fpr(negatives, positives, 0.10) == pytest.approx(0.75)
    # AUROC by hand: 31 beats 20, 30 beats 18 and ties 2 (19), 25 beats 18, 1 beats 0 and ties 1 (1.5)
    assert auroc(negatives, positives) == pytest.approx((20 + 19 + 18 + 1.5) / 80)
