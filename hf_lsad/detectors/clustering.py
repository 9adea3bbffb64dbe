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

Device. k-means runs on a GPU when faiss's GPU API is there (a ``faiss-gpu`` build:
``faiss.StandardGpuResources`` exists and ``faiss.get_num_gpus() > 0``), else on the CPU
(:func:`kmeans_device`). ``use_kmeans_device("cpu")`` / ``("gpu")`` pins it for the fits
run inside it (``hf-lsad fit --kmeans-device``); asking for ``gpu`` where faiss has no GPU
is an error, never a quiet CPU run. The device is not a :class:`KMeansConfig` field: it
changes the centroids only by float rounding, and a guard fitted on either loads anywhere.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Literal, get_args

import faiss
import numpy as np
import torch
from torch import Tensor

from ..core.validation import NON_NEGATIVE, POSITIVE, check_ranges, ranged

ClusterMetric = Literal["l2", "l1", "hamming"]
CLUSTER_METRICS = get_args(ClusterMetric)
KMeansDevice = Literal["auto", "cpu", "gpu"]
KMEANS_DEVICES = get_args(KMeansDevice)

_KMEANS_DEVICE: ContextVar[str] = ContextVar("hf_lsad_kmeans_device", default="auto")


@dataclass
class KMeansConfig:
    """faiss k-means settings, all explicit so a fit can be reproduced."""

    n_clusters: int = ranged(POSITIVE, 50)
    """Number of clusters K."""

    metric: ClusterMetric = "l2"
    """Clustering metric: ``l2``, ``l1`` or ``hamming`` (on binarised codes)."""

    niter: int = ranged(POSITIVE, 25)
    """Lloyd iterations per run."""

    nredo: int = ranged(POSITIVE, 1)
    """Independent runs; the one with the lowest objective is kept."""

    seed: int = 1234
    """faiss random seed (initial centroids and subsampling)."""

    max_points_per_centroid: int = ranged(POSITIVE, 100_000)
    """k-means trains on at most this many points per centroid (:func:`training_sample`)."""

    min_points_per_centroid: int = ranged(NON_NEGATIVE, 1)
    """faiss warns below this many points per centroid."""

    def __post_init__(self) -> None:
        check_ranges(self)
        if self.metric not in CLUSTER_METRICS:
            raise ValueError(f"unknown clustering metric {self.metric!r}; choose one of {CLUSTER_METRICS}")


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
    index: faiss.Index = faiss.IndexFlat(d, faiss.METRIC_L1) if config.metric == "l1" else faiss.IndexFlatL2(d)
    if kmeans_device(_KMEANS_DEVICE.get()) == "gpu":
        # the assignment step (the cost of k-means) on GPU 0; faiss's GPU flat index has L2 and L1
        resources = faiss.StandardGpuResources()
        index = faiss.index_cpu_to_gpu(resources, 0, index)
    clustering.train(np.ascontiguousarray(vectors.detach().cpu().numpy(), dtype=np.float32), index)
    centroids = faiss.vector_float_to_array(clustering.centroids).reshape(config.n_clusters, d)
    return torch.from_numpy(centroids.copy()).to(vectors.device)


def faiss_gpu_count() -> int:
    """GPUs faiss can run on: 0 for a build without the GPU API (``faiss-cpu``) or a machine without GPUs."""
    if not hasattr(faiss, "StandardGpuResources") or not hasattr(faiss, "get_num_gpus"):
        return 0
    return int(faiss.get_num_gpus())


def kmeans_device(requested: str = "auto") -> str:
    """``"gpu"`` or ``"cpu"``: where k-means runs for ``requested`` (``auto``: the GPU when faiss has one).

    Raises:
        ValueError: ``requested`` is not one of :data:`KMEANS_DEVICES`.
        RuntimeError: ``gpu`` was requested but faiss has no GPU API or sees no GPU.
    """
    if requested not in KMEANS_DEVICES:
        raise ValueError(f"unknown k-means device {requested!r}; choose one of {KMEANS_DEVICES}")
    gpus = faiss_gpu_count()
    if requested == "gpu" and gpus == 0:
        api = hasattr(faiss, "StandardGpuResources")
        build = "sees no GPU" if api else "has no GPU API (a faiss-cpu build: install faiss-gpu)"
        raise RuntimeError(f"GPU k-means was requested but faiss {getattr(faiss, '__version__', '')} {build}")
    return "gpu" if requested == "gpu" or (requested == "auto" and gpus > 0) else "cpu"


@contextmanager
def use_kmeans_device(device: str) -> Iterator[str]:
    """Run the k-means of fits inside the block on ``device`` (``auto``, ``cpu``, ``gpu``); yields the one chosen.

    Checked on entry (:func:`kmeans_device`), so a ``gpu`` request without faiss GPUs fails before any fit.
    """
    chosen = kmeans_device(device)
    token = _KMEANS_DEVICE.set(device)
    try:
        yield chosen
    finally:
        _KMEANS_DEVICE.reset(token)


def assign_clusters(vectors: Tensor, centroids: Tensor, metric: str) -> Tensor:
    """Index of the nearest centroid for each row (``[n]`` long), under ``metric``."""
    if metric == "l1":
        distances = torch.cdist(vectors, centroids, p=1.0)
    else:  # squared L2 (Hamming on binary vectors); ||c||^2 - 2<x, c> drops the constant ||x||^2
        distances = centroids.pow(2).sum(-1) - 2.0 * vectors @ centroids.T
    return distances.argmin(-1)
