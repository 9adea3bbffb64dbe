"""Scores of a difference vector: the one ridge inversion and the distances built on it."""

from __future__ import annotations

import pytest
import torch

from hf_lsad.detectors.scores import (
    check_precision_size,
    l1,
    l2,
    mahalanobis,
    ridge_precision,
    ridge_whitening,
    scaled_norm,
    whitened_norm,
)


def covariance(d: int, seed: int) -> torch.Tensor:
    x = torch.randn(50, d, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return x.T @ x / 50


def test_precision_and_whitening_give_the_same_mahalanobis_distance():
    cov, diff = covariance(5, 0), torch.randn(7, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    precision, whitening = ridge_precision(cov, 1e-3), ridge_whitening(cov, 1e-3)
    expected = torch.einsum(
        "bi,ij,bj->b", diff, torch.linalg.inv(cov + 1e-3 * torch.eye(5, dtype=torch.float64)), diff
    ).sqrt()
    torch.testing.assert_close(mahalanobis(diff, precision.expand(7, 5, 5)), expected)
    torch.testing.assert_close(whitened_norm(diff, whitening), expected)


def test_ridge_inversion_is_batched_and_refuses_a_singular_covariance():
    batch = torch.stack([covariance(4, 2), covariance(4, 3)])
    assert ridge_precision(batch, 1e-2).shape == (2, 4, 4)
    with pytest.raises(ValueError, match="not positive definite"):
        ridge_precision(-torch.eye(3), 1e-3)


def test_norms():
    diff = torch.tensor([[3.0, -4.0]])
    assert l1(diff).item() == 7.0 and l2(diff).item() == 5.0
    assert scaled_norm(diff, torch.tensor([[3.0, 4.0]])).item() == pytest.approx(2**0.5)


def test_precision_size_limit():
    check_precision_size(10, 100, "features")
    with pytest.raises(ValueError, match="precision entries"):
        check_precision_size(100, 4096, "features")
