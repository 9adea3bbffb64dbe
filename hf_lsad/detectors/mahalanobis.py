"""Global Mahalanobis baseline (paper, appendix "Activation-space baselines").

One Gaussian on the raw residual-stream activations of the safe fit split:
mean ``mu`` and covariance ``Sigma`` (maximum likelihood, divisor ``n``), with a
ridge ``lambda I`` added before inversion. A row ``x`` scores
``sqrt((x - mu)^T (Sigma + lambda I)^-1 (x - mu))``.

The paper accumulates the covariance on "the full training pool"; a detector
here only ever sees safe rows, so mean and covariance both come from them.

The paper maps the distance to ``[0, 1]`` (percentile interpolation or a
sigmoid of standardized distances). Both maps are strictly increasing, so they
change neither AUROC nor TPR at a fixed FPR nor which rows a threshold set at a
target safe FPR flags; they are not implemented and the score is the distance.

Numerics: the covariance is formed and factorised in float64 and the
whitening matrix ``W = L^-1`` (``Sigma + lambda I = L L^T``) is stored in
float64, since residual streams have a few very large dimensions and the
selected ridge (``1e-5``) makes the precision ill-conditioned. The score is
``||W (x - mu)||_2``, computed in float64 and returned as float32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..core.checks import check_activations
from ..sae.model import SparseAutoencoder
from .base import Detector, DetectorConfig, DetectorOutput, register_detector
from .scores import ridge_whitening, whitened_norm


@dataclass
class MahalanobisConfig(DetectorConfig):
    """Settings of the global Mahalanobis baseline."""

    ridge: float = 1e-5
    """lambda added to the covariance diagonal before inversion. Default ``1e-5``:
    selected on all six models of the paper (sweep ``1e-5 .. 1e-1``)."""

    def __post_init__(self) -> None:
        if not self.ridge > 0:
            raise ValueError(f"ridge must be > 0, got {self.ridge}")


@register_detector
class Mahalanobis(Detector):
    """Distance to the safe mean under the ridge-regularised safe covariance (raw activations)."""

    method = "mahalanobis"
    config_class = MahalanobisConfig
    uses_sae = False
    config: MahalanobisConfig

    mean: Tensor  # [d_in] float64
    whitening: Tensor  # [d_in, d_in] float64

    def __init__(self, config: MahalanobisConfig, d_in: int, d_sae: int | None = None) -> None:
        super().__init__(config, d_in, d_sae)
        self.register_buffer("mean", torch.zeros(d_in, dtype=torch.float64))
        # Lower-triangular L^-1 with L L^T = Sigma + ridge I.
        self.register_buffer("whitening", torch.zeros(d_in, d_in, dtype=torch.float64))

    @torch.no_grad()
    def fit(self, activations: Tensor, sae: SparseAutoencoder | None = None, *, progress: bool = True) -> None:
        check_activations(activations, self.d_in, name="safe activations")
        if len(activations) < 2:
            raise ValueError(f"Mahalanobis needs at least 2 safe rows to estimate a covariance, got {len(activations)}")
        x = activations.double()
        mean = x.mean(0)
        centred = x - mean
        whitening = ridge_whitening(centred.T @ centred / len(x), self.config.ridge)
        self.mean.copy_(mean)
        self.whitening.copy_(whitening)

    @torch.no_grad()
    def forward(self, activations: Tensor, sae: SparseAutoencoder | None = None) -> DetectorOutput:
        scores = whitened_norm(activations.double() - self.mean, self.whitening).float()
        return DetectorOutput(scores, torch.full_like(scores, -1, dtype=torch.long))
