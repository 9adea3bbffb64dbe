"""Settings (:class:`LearnedMaskConfig`) and fitted state (:class:`LearnedMaskState`) of LearnedMask-LoRA.

The detector is :class:`hf_lsad.detectors.learned_mask.detector.LearnedMaskLoRA`; its training stages are in
:mod:`hf_lsad.detectors.learned_mask.training`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, get_args

from ..base import DetectorConfig
from ..clustering import KMeansConfig

LAMBDA_SWEEP = (1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 1e-1)
"""The paper's per-cluster sparsity sweep for Stage 1."""

MaskType = Literal["binary", "continuous"]
ResidualScore = Literal["whitened_l2", "mahalanobis"]
MASK_TYPES = get_args(MaskType)
SCORE_METRICS = get_args(ResidualScore)
BASE_SAE, MASK_ONLY, MASK_AND_LORA = 0, 1, 2
"""Values of ``cluster_stages``: what a cluster was fitted with."""


@dataclass
class LearnedMaskConfig(DetectorConfig):
    """Settings of LearnedMask-LoRA."""

    kmeans: KMeansConfig = field(default_factory=lambda: KMeansConfig(n_clusters=100))
    """Clustering of the safe codes (the paper uses K=100, L2)."""

    mask_type: MaskType = "binary"
    """``binary`` (hard mask, straight-through gradient) or ``continuous`` (sigmoid mask, ablation)."""

    lambdas: list[float] = field(default_factory=lambda: list(LAMBDA_SWEEP))
    """Stage-1 sparsity weights swept per cluster."""

    lambda_tolerance: float = 0.05
    """Relative slack on held-out reconstruction error when picking the sparsest ``lambda``."""

    validation_fraction: float = 0.2
    """Share of a cluster's members held out to select ``lambda``."""

    logit_init: float = 0.5
    """Initial mask logit of every feature (sigmoid 0.62, hard mask all on)."""

    stage1_steps: int = 300
    """Full-batch Adam steps per Stage-1 mask."""

    stage1_lr: float = 0.05
    """Adam learning rate on the mask logits."""

    min_cluster_size: int = 50
    """Clusters with fewer fit members keep the base SAE (paper: 50)."""

    stage1_only: bool = False
    """Skip Stage 2 (the paper's setting for Qwen 1.5B and GPT-oss)."""

    lora_min_cluster_size: int = 50
    """Clusters with fewer fit members get no LoRA adapter (paper: 20 to 500 by model)."""

    lora_ranks: list[int] = field(default_factory=lambda: [2, 4, 8])
    """LoRA ranks of the small, medium and large third of the Stage-2 clusters by size."""

    lora_epochs: int = 30
    """Passes over a cluster's members in Stage 2."""

    lora_lr: float = 1e-3
    """Adam learning rate of the adapters."""

    lora_sparsity: float = 1e-3
    """Weight of the L1 penalty on the adapters' outputs."""

    lora_batch_size: int = 32
    """Members per Stage-2 step."""

    score_metric: ResidualScore = "whitened_l2"
    """``whitened_l2`` (default) or ``mahalanobis`` (ablation) on the reconstruction residual."""

    shrinkage: float = 0.3
    """alpha: weight of the pooled residual variance in the whitening."""

    ridge: float = 1.0
    """Ridge added to each residual covariance before inversion (``mahalanobis`` only)."""

    seed: int = 0
    """Seed of the validation splits, LoRA initialisation and Stage-2 shuffling."""

    def __post_init__(self) -> None:
        if self.mask_type not in MASK_TYPES:
            raise ValueError(f"mask_type must be one of {MASK_TYPES}, got {self.mask_type!r}")
        if self.score_metric not in SCORE_METRICS:
            raise ValueError(f"score_metric must be one of {SCORE_METRICS}, got {self.score_metric!r}")
        if not self.lambdas or any(lam < 0 for lam in self.lambdas):
            raise ValueError(f"lambdas must be a non-empty list of non-negative weights, got {self.lambdas}")
        if not 0.0 < self.validation_fraction < 1.0:
            raise ValueError(f"validation_fraction must be in (0, 1), got {self.validation_fraction}")
        if self.lambda_tolerance < 0:
            raise ValueError(f"lambda_tolerance must be >= 0, got {self.lambda_tolerance}")
        if self.min_cluster_size < 2:
            raise ValueError(
                f"min_cluster_size must be >= 2 (a mask needs a validation member), got {self.min_cluster_size}"
            )
        if self.lora_min_cluster_size < 1:
            raise ValueError(f"lora_min_cluster_size must be >= 1, got {self.lora_min_cluster_size}")
        if len(self.lora_ranks) != 3 or any(r < 1 for r in self.lora_ranks):
            raise ValueError(f"lora_ranks must be three positive ranks (small, medium, large), got {self.lora_ranks}")
        for name in ("stage1_steps", "lora_epochs", "lora_batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("stage1_lr", "lora_lr"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.lora_sparsity < 0:
            raise ValueError(f"lora_sparsity must be >= 0, got {self.lora_sparsity}")
        if not 0.0 <= self.shrinkage <= 1.0:
            raise ValueError(f"shrinkage must be in [0, 1], got {self.shrinkage}")
        if self.score_metric == "mahalanobis" and self.ridge <= 0:
            raise ValueError(f"ridge must be > 0 for Mahalanobis scoring, got {self.ridge}")


@dataclass
class LearnedMaskState:
    """What :meth:`LearnedMaskLoRA.fit` chose per cluster (empty lists: not fitted)."""

    cluster_stages: list[int] = field(default_factory=list)
    """Per cluster: 0 base SAE (too small), 1 mask only, 2 mask and LoRA."""

    cluster_ranks: list[int] = field(default_factory=list)
    """Per cluster: LoRA rank (0 without an adapter)."""

    cluster_lambdas: list[float] = field(default_factory=list)
    """Per cluster: selected Stage-1 ``lambda`` (0.0 for base-SAE clusters)."""

    def check(self, config: LearnedMaskConfig) -> None:
        """``ValueError`` unless this state fits ``config`` (one entry per cluster, known stages, ranks in range)."""
        k = config.kmeans.n_clusters
        fitted = (self.cluster_stages, self.cluster_ranks, self.cluster_lambdas)
        if any(fitted) and any(len(values) != k for values in fitted):
            raise ValueError(f"cluster_stages, cluster_ranks and cluster_lambdas need one entry per cluster ({k})")
        if any(s not in (BASE_SAE, MASK_ONLY, MASK_AND_LORA) for s in self.cluster_stages):
            raise ValueError(f"cluster_stages must hold 0, 1 or 2, got {self.cluster_stages}")
        if any(r < 0 or r > max(config.lora_ranks) for r in self.cluster_ranks):
            raise ValueError(f"cluster_ranks must be in [0, {max(config.lora_ranks)}], got {self.cluster_ranks}")
