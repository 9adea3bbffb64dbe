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

The fit streams (:meth:`FreqMaskKM.fit_rows`): activations are read and encoded
in batches, k-means trains on a bounded sample of codes, and centroids,
frequencies and covariances accumulate over passes, so a fit never holds the
``n x d_sae`` code matrix. :meth:`FreqMaskKM.fit` is the same fit over a tensor.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Literal, get_args

import torch
from torch import Tensor
from tqdm.auto import tqdm

from ..core.fit_checks import MIN_CLUSTER_ROWS, check_cluster_sizes
from ..core.validation import NON_NEGATIVE, POSITIVE, check_ranges, ranged
from ..data.store import DEFAULT_BATCH_SIZE, RowSource, TensorRows, row_batches
from ..sae.model import SparseAutoencoder
from .base import Detector, DetectorConfig, DetectorOutput, ScoreTerms, register_detector
from .clustering import KMeansConfig, assign_clusters, cluster_space, fit_kmeans, training_sample
from .masks import top_k_mask
from .scores import check_precision_size, l1, l2, mahalanobis, ridge_precision

ScoreMetric = Literal["l1", "l2", "mahalanobis"]
MaskScope = Literal["global", "local"]
SCORE_METRICS = get_args(ScoreMetric)
MASK_SCOPES = get_args(MaskScope)


@dataclass
class FreqMaskConfig(DetectorConfig):
    """Settings of FreqMask-KM."""

    kmeans: KMeansConfig = field(default_factory=KMeansConfig)
    """Clustering of the safe codes (K, metric and faiss settings)."""

    mask_size: int = ranged(POSITIVE, 100)
    """k: number of most frequently active SAE features kept by the mask."""

    mask_scope: MaskScope = "global"
    """``global`` (one mask from pooled frequencies) or ``local`` (one mask per cluster)."""

    score_metric: ScoreMetric = "l1"
    """Distance to the assigned centroid: ``l1``, ``l2`` or ``mahalanobis``."""

    use_mask: bool = True
    """False scores on all SAE features (the no-mask ablation)."""

    ridge: float = ranged(NON_NEGATIVE, 1e-3)
    """Ridge added to each cluster covariance before inversion (``mahalanobis`` only)."""

    def __post_init__(self) -> None:
        check_ranges(self)
        if self.mask_scope not in MASK_SCOPES:
            raise ValueError(f"mask_scope must be one of {MASK_SCOPES}, got {self.mask_scope!r}")
        if self.score_metric not in SCORE_METRICS:
            raise ValueError(f"score_metric must be one of {SCORE_METRICS}, got {self.score_metric!r}")
        if self.ridge <= 0 and self.score_metric == "mahalanobis":
            raise ValueError(f"ridge must be > 0 for Mahalanobis scoring, got {self.ridge}")


@register_detector
class FreqMaskKM(Detector):
    """Clusters of safe SAE codes, a frequency mask, distance to the nearest centroid."""

    method = "freqmask-km"
    config_class = FreqMaskConfig
    config: FreqMaskConfig
    d_sae: int  # the base class refuses None for a method that reads SAE codes

    centroids: Tensor  # [n_clusters, d_sae] member means of the safe codes
    cluster_frequency: Tensor  # [n_clusters, d_sae] share of members on which each feature is active
    cluster_sizes: Tensor  # [n_clusters] long
    mask_indices: Tensor  # [n_clusters, mask_size] long (use_mask only)
    precision: Tensor  # [n_clusters, width, width] (mahalanobis only)

    @property
    def n_clusters(self) -> int:
        return self.config.kmeans.n_clusters

    def __init__(self, config: FreqMaskConfig, d_in: int, d_sae: int | None) -> None:
        super().__init__(config, d_in, d_sae)
        d_sae = self.d_sae
        n_clusters = config.kmeans.n_clusters
        width = config.mask_size if config.use_mask else d_sae
        if config.use_mask and config.mask_size > d_sae:
            raise ValueError(f"mask_size={config.mask_size} exceeds the SAE width d_sae={d_sae}")
        if config.score_metric == "mahalanobis":
            check_precision_size(n_clusters, width, "features (use a mask: use_mask=True, smaller mask_size)")
        self.register_buffer("centroids", torch.zeros(n_clusters, d_sae))
        self.register_buffer("cluster_frequency", torch.zeros(n_clusters, d_sae))
        self.register_buffer("cluster_sizes", torch.zeros(n_clusters, dtype=torch.long))
        if config.use_mask:
            self.register_buffer("mask_indices", torch.zeros(n_clusters, width, dtype=torch.long))
        if config.score_metric == "mahalanobis":
            self.register_buffer("precision", torch.zeros(n_clusters, width, width))

    @torch.no_grad()
    def fit(
        self,
        activations: Tensor,
        sae: SparseAutoencoder | None,
        *,
        progress: bool = True,
        batch_size: int = DEFAULT_BATCH_SIZE,
    ) -> None:
        """Fit on in-memory safe activations ``[n, d_in]``: :meth:`fit_rows` over the tensor."""
        self.fit_rows(TensorRows(activations), sae, progress=progress, batch_size=batch_size)

    @torch.no_grad()
    def fit_rows(
        self,
        source: RowSource,
        sae: SparseAutoencoder | None,
        *,
        rows: Tensor | None = None,
        progress: bool = True,
        batch_size: int = DEFAULT_BATCH_SIZE,
    ) -> None:
        """Fit on the safe rows ``rows`` (ascending; default all) of ``source``, streaming.

        Rows are read ``batch_size`` at a time, moved to the detector's device and
        encoded there by ``sae`` (which must live on that device). Nothing of size
        ``n x d_sae`` is ever held:

        1. k-means (faiss, on the CPU) trains on the dense codes of the
           :func:`~hf_lsad.detectors.clustering.training_sample` only;
        2. one pass over all rows assigns each to its nearest k-means centroid and
           accumulates cluster sizes, per-cluster sums of codes (float64) and counts
           of active features, which give the centroids (member means), the
           frequencies and the masks;
        3. ``mahalanobis`` only: a second pass accumulates each cluster's
           second moments on its masked features, which the masks of step 2 select.

        The result is deterministic for a seed and a ``batch_size``; another batch
        size changes the float64 sums only in their rounding.
        """
        config = self.config
        metric, n_clusters = config.kmeans.metric, config.kmeans.n_clusters
        device = self.centroids.device
        rows = torch.arange(len(source)) if rows is None else rows.cpu()
        if len(rows) < n_clusters:
            raise ValueError(f"k-means needs at least n_clusters={n_clusters} points, got {len(rows)}")

        sample = rows[training_sample(len(rows), config.kmeans)]
        space = torch.empty(len(sample), self.d_sae)
        for start, batch in _batches(source, sample, batch_size, "encode k-means sample", progress):
            space[start : start + len(batch)] = cluster_space(_encode(sae, batch.to(device)), metric).cpu()
        kmeans_centroids = fit_kmeans(space, config.kmeans).to(device)
        del space

        members = torch.empty(len(rows), dtype=torch.long, device=device)
        code_sums = torch.zeros(n_clusters, self.d_sae, dtype=torch.float64, device=device)
        active_counts = torch.zeros_like(code_sums)
        for start, batch in _batches(source, rows, batch_size, "assign and accumulate", progress):
            codes = _encode(sae, batch.to(device))
            clusters = assign_clusters(cluster_space(codes, metric), kmeans_centroids, metric)
            members[start : start + len(batch)] = clusters
            _accumulate(code_sums, active_counts, clusters, codes, scatter=not codes.is_cuda)

        sizes = torch.bincount(members, minlength=n_clusters)
        width = config.mask_size if config.use_mask else self.d_sae
        if config.score_metric == "mahalanobis":
            check_cluster_sizes(
                sizes.tolist(),
                min_rows=max(MIN_CLUSTER_ROWS, width + 1),
                why=f"a {width}-feature covariance needs more rows than features",
            )
        else:
            check_cluster_sizes(sizes.tolist(), min_rows=MIN_CLUSTER_ROWS, why="centroids and frequencies need rows")
        per_cluster = sizes.clamp_min(1).unsqueeze(1).double()
        self.cluster_sizes.copy_(sizes)
        self.centroids.copy_(code_sums / per_cluster)
        self.cluster_frequency.copy_(active_counts / per_cluster)

        if config.use_mask:
            pooled = active_counts.sum(0) / len(rows)
            if config.mask_scope == "global":
                self.mask_indices.copy_(top_k_mask(pooled, config.mask_size).expand_as(self.mask_indices))
            else:
                for c in range(n_clusters):
                    # An empty cluster has no frequencies of its own: it keeps the global mask.
                    frequency = self.cluster_frequency[c] if sizes[c] > 0 else pooled
                    self.mask_indices[c] = top_k_mask(frequency, config.mask_size)

        if config.score_metric == "mahalanobis":
            self._fit_precision(source, sae, rows, members, sizes, batch_size, progress)

    def _fit_precision(
        self,
        source: RowSource,
        sae: SparseAutoencoder | None,
        rows: Tensor,
        members: Tensor,
        sizes: Tensor,
        batch_size: int,
        progress: bool,
    ) -> None:
        """Per-cluster ``(S_c + ridge I)^-1`` from a pass over the rows, on the fitted centroids and masks."""
        width = self.precision.shape[-1]
        moments = torch.zeros(len(sizes), width, width, dtype=torch.float64, device=members.device)
        for start, batch in _batches(source, rows, batch_size, "cluster covariances", progress):
            clusters = members[start : start + len(batch)]
            diff = self._masked_difference(_encode(sae, batch.to(members.device)), clusters)
            for c in clusters.unique().tolist():
                part = diff[clusters == c]
                moments[c] += (part.T @ part).double()
        covariance = moments / sizes.clamp_min(1).double().view(-1, 1, 1)
        self.precision.copy_(ridge_precision(covariance, self.config.ridge))

    def forward(self, activations: Tensor, sae: SparseAutoencoder | None) -> DetectorOutput:
        codes = _encode(sae, activations)
        metric = self.config.kmeans.metric
        # Hamming assigns binarised codes to per-cluster frequencies; l1/l2 assign codes to centroids.
        assign_to = self.cluster_frequency if metric == "hamming" else self.centroids
        clusters = assign_clusters(cluster_space(codes, metric), assign_to, metric)
        diff = self._masked_difference(codes, clusters)
        if self.config.score_metric == "l1":
            scores = l1(diff)
        elif self.config.score_metric == "l2":
            scores = l2(diff)
        else:
            scores = mahalanobis(diff, self.precision[clusters])
        return DetectorOutput(scores, clusters)

    @torch.no_grad()
    def score_terms(self, activations: Tensor, sae: SparseAutoencoder | None) -> ScoreTerms:
        """The score of each row split into one term per masked feature (:mod:`hf_lsad.guard.explain`).

        The terms sum to ``forward``'s score: ``|d_i|`` (l1), ``d_i^2 / s`` (l2),
        ``d_i (P_c d)_i / s`` (mahalanobis), with ``d`` the masked difference to the centroid.
        """
        codes = _encode(sae, activations)
        metric = self.config.kmeans.metric
        assign_to = self.cluster_frequency if metric == "hamming" else self.centroids
        clusters = assign_clusters(cluster_space(codes, metric), assign_to, metric)
        diff = self._masked_difference(codes, clusters)
        if self.config.use_mask:
            features = self.mask_indices[clusters]
        else:
            features = torch.arange(self.d_sae, device=codes.device).expand(len(codes), -1)
        activation = codes.gather(1, features)
        typical = self.centroids[clusters].gather(1, features)
        if self.config.score_metric == "l1":
            contributions = diff.abs()
            scores = contributions.sum(-1)
        elif self.config.score_metric == "l2":
            scores = diff.norm(dim=-1)
            contributions = diff.square() / scores.clamp_min(torch.finfo(scores.dtype).tiny).unsqueeze(1)
        else:
            weighted = torch.einsum("bij,bj->bi", self.precision[clusters], diff)
            scores = (diff * weighted).sum(-1).clamp_min(0).sqrt()
            contributions = diff * weighted / scores.clamp_min(torch.finfo(scores.dtype).tiny).unsqueeze(1)
        return ScoreTerms(features, activation, contributions, typical, scores, clusters)

    def _masked_difference(self, codes: Tensor, clusters: Tensor) -> Tensor:
        diff = codes - self.centroids[clusters]
        return diff.gather(1, self.mask_indices[clusters]) if self.config.use_mask else diff


def _encode(sae: SparseAutoencoder | None, activations: Tensor) -> Tensor:
    if sae is None:
        raise ValueError("FreqMask-KM scores SAE codes: the guard has no SAE")
    return sae.encode(activations)


def _batches(
    source: RowSource, rows: Tensor, batch_size: int, description: str, progress: bool
) -> Iterator[tuple[int, Tensor]]:
    """``(offset in rows, activations)`` for consecutive batches of ``rows``, with a progress bar."""
    bar = tqdm(total=len(rows), desc=description, unit="row", disable=not progress)
    start = 0
    for batch in row_batches(source, rows, batch_size):
        yield start, batch
        start += len(batch)
        bar.update(len(batch))
    bar.close()


def _accumulate(code_sums: Tensor, active_counts: Tensor, clusters: Tensor, codes: Tensor, *, scatter: bool) -> None:
    """Add each row's codes, and its active features (``> 0``), to its cluster's float64 totals.

    ``scatter`` (the CPU path) adds only the nonzero codes with ``index_add_``, which is
    sequential there and so deterministic; SAE codes are sparse. Otherwise (the CUDA
    path, where a float ``index_add_`` is atomic and its rounding order-dependent) the
    batch is summed by a deterministic one-hot matmul.
    """
    if not scatter:
        one_hot = torch.nn.functional.one_hot(clusters, len(code_sums)).to(codes.dtype).T
        code_sums += (one_hot @ codes).double()
        active_counts += (one_hot @ (codes > 0).to(codes.dtype)).double()
        return
    row, feature = codes.nonzero(as_tuple=True)
    values = codes[row, feature]
    flat = clusters[row] * codes.shape[1] + feature
    code_sums.view(-1).index_add_(0, flat, values.double())
    active_counts.view(-1).index_add_(0, flat, (values > 0).double())
