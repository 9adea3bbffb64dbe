"""The one seeded split: guard hold-outs, evaluation cuts and a guard's held-out rows agree."""

from __future__ import annotations

import pytest
import torch

from hf_lsad.core.splits import holdout_rows, seeded_cut, split_safe


def test_split_safe_is_the_seeded_cut_and_holdout_rows_finds_it_again():
    split = split_safe(101, 0.2, seed=3)
    holdout, fit = seeded_cut(101, [0.2], seed=3)
    assert torch.equal(split.holdout, holdout) and torch.equal(split.fit, fit)
    assert torch.equal(holdout_rows(len(split.fit), len(split.holdout), 3), split.holdout)
    assert sorted(torch.cat([split.fit, split.holdout]).tolist()) == list(range(101))


def test_bad_splits_are_errors():
    with pytest.raises(ValueError, match="holdout_fraction"):
        split_safe(10, 1.0)
    with pytest.raises(ValueError, match="a part is empty"):
        seeded_cut(3, [0.1, 0.1], seed=0)
