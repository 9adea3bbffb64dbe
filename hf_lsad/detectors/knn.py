"""k-nearest-neighbour distance on raw activations: the local score of the chat study.

Not in the paper. FreqMask-KM asks whether a row is typical of its *cluster*; with
chat in the safe pool the clusters are broad, and a harmful request lands in one
where it looks typical (``benchmarks/archive/chat-study/results/chat_study_smollm2_prompt_last.md``).
The most local question is whether the row has close *neighbours* among the safe
rows. Score: the mean cosine distance to the ``k`` nearest safe fit rows, on
activations centred on the fit mean (centring removes the large shared direction
of the residual stream, which otherwise makes every pair of rows look alike)::

    u = normalize(x - mu)
    score(x) = 1 - mean(top_k(B u))      B: [n_bank, d_in], the fit rows centred and normalised

The bank is the fit rows themselves (``max_rows`` bounds its size by a seeded
subsample), so the guard's size grows with the fit split: ``n_bank x d_in`` floats.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from ..core.checks import check_activations
from ..sae.model import SparseAutoencoder
from .base import Detector, DetectorConfig, DetectorOutput, register_detector

SCORE_BATCH = 1024
"""Rows scored against the bank at a time (bounds the ``[batch, n_bank]`` similarity matrix)."""


@dataclass
class KNNConfig(DetectorConfig):
    """Settings of the kNN distance detector."""

    k: int = 10
    """Neighbours averaged; selected on validation in the chat study (``k=10``)."""
    max_rows: int | None = None
    """Keep at most this many fit rows in the bank (a seeded subsample); ``None``: all of them."""
    seed: int = 0
    """Seed of the subsample."""

    def __post_init__(self) -> None:
        if self.k < 1:
            raise ValueError(f"k must be >= 1, got {self.k}")
        if self.max_rows is not None and self.max_rows < self.k:
            raise ValueError(f"max_rows ({self.max_rows}) must be at least k ({self.k})")


@dataclass
class KNNState:
    """What fitting learns that sizes the buffers."""

    n_bank: int = 0
    """Rows in the bank."""


@register_detector
class KNNDistance(Detector):
    """Mean cosine distance to the ``k`` nearest safe rows (centred raw activations)."""

    method = "knn"
    config_class = KNNConfig
    state_class = KNNState
    uses_sae = False
    config: KNNConfig
    state: KNNState

    mean: Tensor  # [d_in], the fit split's mean, subtracted before the cosine
    bank: Tensor  # [n_bank, d_in] centred, unit-norm safe rows

    def __init__(self, config: KNNConfig, d_in: int, d_sae: int | None = None, state: KNNState | None = None) -> None:
        super().__init__(config, d_in, d_sae, state)
        self.register_buffer("mean", torch.zeros(d_in))
        self.register_buffer("bank", torch.zeros(self.state.n_bank, d_in))

    @torch.no_grad()
    def fit(self, activations: Tensor, sae: SparseAutoencoder | None = None, *, progress: bool = True) -> None:
        check_activations(activations, self.d_in, name="safe activations")
        if len(activations) < self.config.k:
            raise ValueError(
                f"kNN with k={self.config.k} needs at least {self.config.k} safe rows, got {len(activations)}"
            )
        x = activations.float()
        if self.config.max_rows is not None and len(x) > self.config.max_rows:
            generator = torch.Generator().manual_seed(self.config.seed)
            keep = torch.randperm(len(x), generator=generator)[: self.config.max_rows].sort().values
            x = x[keep.to(x.device)]
        mean = x.mean(0)
        self.state.n_bank = len(x)
        self.mean = mean
        self.bank = F.normalize(x - mean, dim=1)  # [n_bank, d_in]

    @torch.no_grad()
    def forward(self, activations: Tensor, sae: SparseAutoencoder | None = None) -> DetectorOutput:
        scores = []
        for batch in activations.float().split(SCORE_BATCH):
            unit = F.normalize(batch - self.mean, dim=1)  # [b, d_in]
            nearest = (unit @ self.bank.T).topk(self.config.k, dim=1).values  # [b, k]
            scores.append(1.0 - nearest.mean(1))
        scores_t = torch.cat(scores) if scores else activations.new_zeros(0)
        return DetectorOutput(scores_t, torch.full_like(scores_t, -1, dtype=torch.long))
