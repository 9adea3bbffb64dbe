"""Anomaly scores of a difference vector: L1, L2, Mahalanobis and the whitened residual norm.

A detector reduces each input to a difference ``d`` (an SAE code minus its
centroid on the mask, a reconstruction residual minus its cluster mean, an
activation minus the safe mean) and scores its size here. The Mahalanobis
scores share one ridge-regularised inversion, :func:`ridge_cholesky`, of
``S + ridge I``; detectors keep its result as a precision matrix
(:func:`ridge_precision`, scored by :func:`mahalanobis`) or as a whitening
matrix ``L^-1`` (:func:`ridge_whitening`, scored by :func:`whitened_norm`);
:func:`scaled_norm` is the diagonal case (LearnedMask-LoRA's whitened residual).
Each keeps the dtype it is given, so a detector decides its own precision.
"""

from __future__ import annotations

import torch
from torch import Tensor

MAX_MAHALANOBIS_ELEMENTS = 2**28
"""Refuse per-cluster precision matrices larger than this (1 GiB in float32)."""


def check_precision_size(n_clusters: int, width: int, what: str) -> None:
    """``ValueError`` if ``n_clusters`` precision matrices of ``width`` exceed :data:`MAX_MAHALANOBIS_ELEMENTS`."""
    entries = n_clusters * width * width
    if entries > MAX_MAHALANOBIS_ELEMENTS:
        raise ValueError(f"Mahalanobis on {width} {what} x {n_clusters} clusters needs {entries:,} precision entries")


def l1(diff: Tensor) -> Tensor:
    """``||d||_1`` per row."""
    return diff.abs().sum(-1)


def l2(diff: Tensor) -> Tensor:
    """``||d||_2`` per row."""
    return diff.norm(dim=-1)


def ridge_cholesky(covariance: Tensor, ridge: float) -> Tensor:
    """Lower Cholesky factor ``L`` of ``covariance + ridge I`` (batched over leading dimensions).

    ``ValueError`` when that is not positive definite (raise ``ridge``).
    """
    eye = torch.eye(covariance.shape[-1], dtype=covariance.dtype, device=covariance.device)
    cholesky, info = torch.linalg.cholesky_ex(covariance + ridge * eye)
    if (info != 0).any():
        raise ValueError(f"covariance + ridge={ridge} is not positive definite; increase ridge")
    return cholesky


def ridge_precision(covariance: Tensor, ridge: float) -> Tensor:
    """``(covariance + ridge I)^-1`` from :func:`ridge_cholesky`."""
    return torch.cholesky_inverse(ridge_cholesky(covariance, ridge))


def ridge_whitening(covariance: Tensor, ridge: float) -> Tensor:
    """``L^-1`` with ``L L^T = covariance + ridge I``, so that ``||L^-1 d||_2`` is the Mahalanobis distance."""
    cholesky = ridge_cholesky(covariance, ridge)
    eye = torch.eye(covariance.shape[-1], dtype=covariance.dtype, device=covariance.device)
    return torch.linalg.solve_triangular(cholesky, eye, upper=False)


def mahalanobis(diff: Tensor, precision: Tensor) -> Tensor:
    """``sqrt(d^T P d)`` per row, with one precision matrix per row (``[batch, w, w]``)."""
    return torch.einsum("bi,bij,bj->b", diff, precision, diff).clamp_min(0).sqrt()


def whitened_norm(diff: Tensor, whitening: Tensor) -> Tensor:
    """``||W d||_2`` per row, ``W`` a ``[d, d]`` whitening matrix (:func:`ridge_whitening`)."""
    return (diff @ whitening.T).norm(dim=-1)


def scaled_norm(diff: Tensor, scale: Tensor) -> Tensor:
    """``||d / s||_2`` per row: the residual whitened by a per-dimension scale (diagonal whitening)."""
    return (diff / scale).norm(dim=-1)
