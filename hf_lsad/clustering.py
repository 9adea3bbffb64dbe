"""k-means on SAE codes with faiss, and nearest-centroid assignment in torch.

Three metrics (paper, section "Clustering"):

- ``l2``: faiss k-means on the codes ``z``.
- ``l1``: Lloyd iterations whose assignment step uses the L1 distance
  (a faiss ``METRIC_L1`` index); centroids are still member means.
- ``hamming``: k-means on the binarised codes ``b = 1[z > 0]``. For binary
  vectors the squared L2 distance *is* the Hamming distance; the centroids
  are per-cluster activation frequencies, and a new code is assigned by
  squared L2 between its ``b`` and those frequencies.

Every faiss setting that changes the result is a field of :class:`KMeansConfig`
and is saved with the guard. k-means trains on at most
``max_points_per_centroid * n_clusters`` points: :func:`training_sample` picks
them (seeded), so a fit only ever encodes and holds that sample densely, and
faiss, handed exactly that many points, does not subsample again. The default
is large enough to train on every point at the sizes this package used to fit
in memory; at the paper's scale (200k rows, K=100) pass faiss's own default,
256, to train on a 25.6k-row sample.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

import faiss
import numpy as np
import torch
from torch import Tensor

ClusterMetric = Literal["l2", "l1", "hamming"]
CLUSTER_METRICS = get_args(ClusterMetric)


@dataclass
class KMeansConfig:
    """faiss k-means settings, all explicit so a fit can be reproduced."""

    n_clusters: int = 50
    """Number of clusters K."""

    metric: ClusterMetric = "l2"
    """Clustering metric: ``l2``, ``l1`` or ``hamming`` (on binarised codes)."""

    niter: int = 25
    """Lloyd iterations per run."""

    nredo: int = 1
    """Independent runs; the one with the lowest objective is kept."""

    seed: int = 1234
    """faiss random seed (initial centroids and subsampling)."""

    max_points_per_centroid: int = 100_000
    """k-means trains on at most this many points per centroid (:func:`training_sample`)."""

    min_points_per_centroid: int = 1
    """faiss warns below this many points per centroid."""

    def __post_init__(self) -> None:
        if self.metric not in CLUSTER_METRICS:
            raise ValueError(f"unknown clustering metric {self.metric!r}; choose one of {CLUSTER_METRICS}")
        if self.n_clusters < 1:
            raise ValueError(f"n_clusters must be >= 1, got {self.n_clusters}")


def cluster_space(codes: Tensor, metric: str) -> Tensor:
    """The vectors k-means sees: the codes, or their binarised support for ``hamming``."""
    return (codes > 0).to(codes.dtype) if metric == "hamming" else codes


def training_sample(n: int, config: KMeansConfig) -> Tensor:
    """Positions (ascending) of the points k-means trains on, out of ``n``.

    All ``n`` when ``n <= max_points_per_centroid * n_clusters``, otherwise that many,
    drawn without replacement with a generator seeded by ``config.seed``.
    """
    cap = config.max_points_per_centroid * config.n_clusters
    if n <= cap:
        return torch.arange(n)
    return torch.randperm(n, generator=torch.Generator().manual_seed(config.seed))[:cap].sort().values


def fit_kmeans(vectors: Tensor, config: KMeansConfig) -> Tensor:
    """Run faiss k-means on ``vectors`` (already in :func:`cluster_space`); return ``[K, d]`` centroids."""
    n, d = vectors.shape
    if n < config.n_clusters:
        raise ValueError(f"k-means needs at least n_clusters={config.n_clusters} points, got {n}")
    params = faiss.ClusteringParameters()
    params.niter = config.niter
    params.nredo = config.nredo
    params.seed = config.seed
    params.max_points_per_centroid = config.max_points_per_centroid
    params.min_points_per_centroid = config.min_points_per_centroid
    params.verbose = False
    clustering = faiss.Clustering(d, config.n_clusters, params)
    index = faiss.IndexFlat(d, faiss.METRIC_L1) if config.metric == "l1" else faiss.IndexFlatL2(d)
    clustering.train(np.ascontiguousarray(vectors.detach().cpu().numpy(), dtype=np.float32), index)
    centroids = faiss.vector_float_to_array(clustering.centroids).reshape(config.n_clusters, d)
    return torch.from_numpy(centroids.copy()).to(vectors.device)


def assign_clusters(vectors: Tensor, centroids: Tensor, metric: str) -> Tensor:
    """Index of the nearest centroid for each row (``[n]`` long), under ``metric``."""
    if metric == "l1":
        distances = torch.cdist(vectors, centroids, p=1.0)
    else:  # squared L2 (Hamming on binary vectors); ||c||^2 - 2<x, c> drops the constant ||x||^2
        distances = centroids.pow(2).sum(-1) - 2.0 * vectors @ centroids.T
    return distances.argmin(-1)
