"""FreqMask-KM (paper, Algorithm 1) and its local, metric and no-mask variants.

Fit on safe SAE codes ``z``: k-means into K clusters, centroids ``mu_c`` (member
means), activation frequencies ``f`` (pooled) and ``f_c`` (per cluster), and a
top-k frequency mask, global (``m = top_k(f)``, shared by all clusters) or
local (``m_c = top_k(f_c)``, "Local FreqMask-KM"). A new code is assigned to
its nearest centroid and scored by its distance to that centroid on the mask:

- ``l1``: ``||m_c * (z - mu_c)||_1`` (the paper's FreqMask-KM),
- ``l2``: ``||m_c * (z - mu_c)||_2``,
- ``mahalanobis``: ``sqrt(d^T (S_c + ridge I)^-1 d)`` with ``d`` the masked
  difference and ``S_c`` the cluster's covariance on the masked features.

Ties in the frequency ranking go to the lower feature index.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor
from tqdm.auto import tqdm

from ..clustering import KMeansConfig, assign_clusters, cluster_space, fit_kmeans
from ..sae import SparseAutoencoder
from .base import Detector, DetectorConfig, DetectorOutput, register_detector

SCORE_METRICS = ("l1", "l2", "mahalanobis")
MASK_SCOPES = ("global", "local")
MAX_MAHALANOBIS_ELEMENTS = 2**28
"""Refuse per-cluster precision matrices larger than this (1 GiB in float32)."""


@dataclass
class FreqMaskConfig(DetectorConfig):
    """Settings of FreqMask-KM."""

    kmeans: KMeansConfig = field(default_factory=KMeansConfig)
    """Clustering of the safe codes (K, metric and faiss settings)."""

    mask_size: int = 100
    """k: number of most frequently active SAE features kept by the mask."""

    mask_scope: str = "global"
    """``global`` (one mask from pooled frequencies) or ``local`` (one mask per cluster)."""

    score_metric: str = "l1"
    """Distance to the assigned centroid: ``l1``, ``l2`` or ``mahalanobis``."""

    use_mask: bool = True
    """False scores on all SAE features (the no-mask ablation)."""

    ridge: float = 1e-3
    """Ridge added to each cluster covariance before inversion (``mahalanobis`` only)."""

    def __post_init__(self) -> None:
        if self.mask_scope not in MASK_SCOPES:
            raise ValueError(f"mask_scope must be one of {MASK_SCOPES}, got {self.mask_scope!r}")
        if self.score_metric not in SCORE_METRICS:
            raise ValueError(f"score_metric must be one of {SCORE_METRICS}, got {self.score_metric!r}")
        if self.mask_size < 1:
            raise ValueError(f"mask_size must be >= 1, got {self.mask_size}")
        if self.ridge <= 0 and self.score_metric == "mahalanobis":
            raise ValueError(f"ridge must be > 0 for Mahalanobis scoring, got {self.ridge}")


@register_detector
class FreqMaskKM(Detector):
    """Clusters of safe SAE codes, a frequency mask, distance to the nearest centroid."""

    method = "freqmask-km"
    config_class = FreqMaskConfig

    def __init__(self, config: FreqMaskConfig, d_in: int, d_sae: int | None) -> None:
        super().__init__(config, d_in, d_sae)
        n_clusters = config.kmeans.n_clusters
        width = config.mask_size if config.use_mask else d_sae
        if config.use_mask and config.mask_size > d_sae:
            raise ValueError(f"mask_size={config.mask_size} exceeds the SAE width d_sae={d_sae}")
        if config.score_metric == "mahalanobis" and n_clusters * width * width > MAX_MAHALANOBIS_ELEMENTS:
            raise ValueError(
                f"Mahalanobis on {width} features x {n_clusters} clusters needs "
                f"{n_clusters * width * width:,} precision entries; use a mask (use_mask=True, smaller mask_size)"
            )
        self.register_buffer("centroids", torch.zeros(n_clusters, d_sae))
        self.register_buffer("cluster_frequency", torch.zeros(n_clusters, d_sae))
        self.register_buffer("cluster_sizes", torch.zeros(n_clusters, dtype=torch.long))
        if config.use_mask:
            self.register_buffer("mask_indices", torch.zeros(n_clusters, width, dtype=torch.long))
        if config.score_metric == "mahalanobis":
            self.register_buffer("precision", torch.zeros(n_clusters, width, width))

    @torch.no_grad()
    def fit(self, activations: Tensor, sae: SparseAutoencoder | None, *, progress: bool = True) -> None:
        config = self.config
        codes = _encode(sae, activations)
        space = cluster_space(codes, config.kmeans.metric)
        members = assign_clusters(space, fit_kmeans(space, config.kmeans), config.kmeans.metric)

        sizes = torch.bincount(members, minlength=config.kmeans.n_clusters)
        one_hot = torch.nn.functional.one_hot(members, len(sizes)).float()
        per_cluster = sizes.clamp_min(1).unsqueeze(1).float()
        self.cluster_sizes.copy_(sizes)
        self.centroids.copy_(one_hot.T @ codes / per_cluster)
        self.cluster_frequency.copy_(one_hot.T @ (codes > 0).float() / per_cluster)

        if config.use_mask:
            pooled = (codes > 0).float().mean(0)
            if config.mask_scope == "global":
                self.mask_indices.copy_(_top_k(pooled, config.mask_size).expand_as(self.mask_indices))
            else:
                for c in range(len(sizes)):
                    # An empty cluster has no frequencies of its own: it keeps the global mask.
                    frequency = self.cluster_frequency[c] if sizes[c] > 0 else pooled
                    self.mask_indices[c] = _top_k(frequency, config.mask_size)

        if config.score_metric == "mahalanobis":
            eye = torch.eye(self.precision.shape[-1], device=codes.device)
            for c in tqdm(range(len(sizes)), desc="cluster covariances", disable=not progress):
                diff = self._masked_difference(codes[members == c], torch.full_like(members[members == c], c))
                covariance = diff.T @ diff / max(len(diff), 1) + config.ridge * eye
                self.precision[c] = torch.cholesky_inverse(torch.linalg.cholesky(covariance))

    def forward(self, activations: Tensor, sae: SparseAutoencoder | None) -> DetectorOutput:
        codes = _encode(sae, activations)
        metric = self.config.kmeans.metric
        # Hamming assigns binarised codes to per-cluster frequencies; l1/l2 assign codes to centroids.
        assign_to = self.cluster_frequency if metric == "hamming" else self.centroids
        clusters = assign_clusters(cluster_space(codes, metric), assign_to, metric)
        diff = self._masked_difference(codes, clusters)
        if self.config.score_metric == "l1":
            scores = diff.abs().sum(-1)
        elif self.config.score_metric == "l2":
            scores = diff.norm(dim=-1)
        else:
            scores = torch.einsum("bi,bij,bj->b", diff, self.precision[clusters], diff).clamp_min(0).sqrt()
        return DetectorOutput(scores, clusters)

    def _masked_difference(self, codes: Tensor, clusters: Tensor) -> Tensor:
        diff = codes - self.centroids[clusters]
        return diff.gather(1, self.mask_indices[clusters]) if self.config.use_mask else diff


def _encode(sae: SparseAutoencoder | None, activations: Tensor) -> Tensor:
    if sae is None:
        raise ValueError("FreqMask-KM scores SAE codes: the guard has no SAE")
    return sae.encode(activations)


def _top_k(frequency: Tensor, k: int) -> Tensor:
    """Indices of the k largest frequencies, ties to the lower index, sorted ascending."""
    order = torch.sort(frequency, descending=True, stable=True).indices
    return order[:k].sort().values
