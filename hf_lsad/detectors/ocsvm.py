"""One-Class SVM baseline (paper, appendix "Activation-space baselines").

The safe raw activations are standardized (per-dimension mean and standard
deviation of the fit split, zero std -> 1), and :class:`sklearn.svm.OneClassSVM`
solves the one-class dual (libsvm) with an RBF ``exp(-gamma ||x - y||^2)`` or
linear ``<x, y>`` kernel. ``nu`` upper-bounds the fraction of training
outliers and lower-bounds the fraction of support vectors. A row scores the
negative decision function ``-(sum_i alpha_i K(sv_i, x) + b)``, computed in
torch (float64) from the stored support vectors, dual coefficients and
intercept; higher means further outside the safe region.

Large fits: the libsvm solver costs between ``O(n^2)`` and ``O(n^3)`` in the
number of rows, so by default at most ``max_samples`` (10,000) safe rows are
used, drawn uniformly without replacement with ``seed`` (``max_samples=None``
uses every row). The paper does not say whether it subsampled.

Buffers whose size is only known after fitting: the number of support vectors
is the detector's fitted state (:class:`OCSVMState`, ``n_support``, saved with
the config), never written into the config. The detector is built with buffers
of that size, so a saved detector is rebuilt from its JSON with the right shapes
and loaded strictly like any other; a detector with ``n_support=0`` is unfitted
and refuses to score.

The paper maps scores to ``[0, 1]`` (percentile or sigmoid); those maps are
strictly increasing and change neither AUROC nor the rows flagged at a
safe-FPR threshold, so they are not implemented.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

import numpy as np
import torch
from torch import Tensor

from ..core.checks import check_activations
from ..sae.model import SparseAutoencoder
from .base import Detector, DetectorConfig, DetectorOutput, register_detector
from .gmm import fit_standardizer

Kernel = Literal["rbf", "linear"]
KERNELS = get_args(Kernel)
SCORE_CHUNK = 4096
"""Rows scored at once (the kernel matrix is ``chunk x n_support`` float64)."""


@dataclass
class OCSVMConfig(DetectorConfig):
    """Settings of the One-Class SVM baseline."""

    kernel: Kernel = "rbf"
    """``rbf`` or ``linear``. Default ``rbf``: selected on all six models of the paper."""

    nu: float = 0.1
    """Upper bound on the training-outlier fraction, lower bound on the support-vector
    fraction, in ``(0, 1]``. Default 0.1: selected on 4 of the paper's 6 models
    (sweep ``{0.01, 0.05, 0.1, 0.2}``)."""

    gamma: float = 1e-2
    """RBF bandwidth on standardized activations (ignored by ``linear``). Default ``1e-2``:
    selected on 4 of the paper's 6 models (sweep ``1e-4 .. 1``)."""

    tol: float = 1e-3
    """libsvm stopping tolerance (scikit-learn's default)."""

    max_samples: int | None = 10_000
    """Fit on at most this many safe rows, a seeded uniform subsample (``None``: all rows)."""

    seed: int = 0
    """Seed of that subsample (libsvm itself is deterministic)."""

    cache_size: float = 500.0
    """libsvm kernel cache in MB (speed only)."""

    def __post_init__(self) -> None:
        if self.kernel not in KERNELS:
            raise ValueError(f"kernel must be one of {KERNELS}, got {self.kernel!r}")
        if not 0.0 < self.nu <= 1.0:
            raise ValueError(f"nu must be in (0, 1], got {self.nu}")
        if not (isinstance(self.gamma, (int, float)) and self.gamma > 0):
            raise ValueError(f"gamma must be a positive number, got {self.gamma!r}")
        if self.max_samples is not None and self.max_samples < 2:
            raise ValueError(f"max_samples must be >= 2 or None, got {self.max_samples}")


@dataclass
class OCSVMState:
    """What :meth:`OneClassSVMDetector.fit` learned that sizes the buffers."""

    n_support: int = 0
    """Number of support vectors (0: not fitted)."""

    def __post_init__(self) -> None:
        if self.n_support < 0:
            raise ValueError(f"n_support must be >= 0, got {self.n_support}")


@register_detector
class OneClassSVMDetector(Detector):
    """Negative one-class SVM decision function on standardized safe activations."""

    method = "ocsvm"
    config_class = OCSVMConfig
    uses_sae = False
    state_class = OCSVMState
    config: OCSVMConfig
    state: OCSVMState

    input_mean: Tensor  # [d_in] float64, the fit split's mean
    input_scale: Tensor  # [d_in] float64, its standard deviation
    intercept: Tensor  # [1] float64
    support_vectors: Tensor  # [n_support, d_in] float64, standardized
    dual_coef: Tensor  # [n_support] float64

    def __init__(
        self, config: OCSVMConfig, d_in: int, d_sae: int | None = None, state: OCSVMState | None = None
    ) -> None:
        super().__init__(config, d_in, d_sae, state)
        self.register_buffer("input_mean", torch.zeros(d_in, dtype=torch.float64))
        self.register_buffer("input_scale", torch.ones(d_in, dtype=torch.float64))
        self.register_buffer("intercept", torch.zeros(1, dtype=torch.float64))
        self._allocate(self.state.n_support)

    def _allocate(self, n_support: int) -> None:
        device = self.input_mean.device
        self.register_buffer("support_vectors", torch.zeros(n_support, self.d_in, dtype=torch.float64, device=device))
        self.register_buffer("dual_coef", torch.zeros(n_support, dtype=torch.float64, device=device))

    @torch.no_grad()
    def fit(self, activations: Tensor, sae: SparseAutoencoder | None = None, *, progress: bool = True) -> None:
        check_activations(activations, self.d_in, name="safe activations")
        config = self.config
        if len(activations) < 2:
            raise ValueError(f"One-Class SVM needs at least 2 safe rows, got {len(activations)}")
        rows = activations.detach()
        if config.max_samples is not None and len(rows) > config.max_samples:
            generator = torch.Generator().manual_seed(config.seed)
            keep = torch.randperm(len(rows), generator=generator)[: config.max_samples].sort().values
            rows = rows[keep.to(rows.device)]
        mean, scale = fit_standardizer(rows)
        x = ((rows.double().cpu() - mean) / scale).numpy()
        from sklearn.svm import OneClassSVM  # sklearn takes seconds to import: only fits pay for it

        svm = OneClassSVM(
            kernel=config.kernel, nu=config.nu, gamma=config.gamma, tol=config.tol, cache_size=config.cache_size
        ).fit(x)
        n_support = len(svm.support_)
        self.state = OCSVMState(n_support=n_support)
        self._allocate(n_support)
        device = self.input_mean.device
        self.input_mean.copy_(mean)
        self.input_scale.copy_(scale)
        self.support_vectors.copy_(torch.from_numpy(np.asarray(svm.support_vectors_, dtype=np.float64)))
        self.dual_coef.copy_(torch.from_numpy(np.asarray(svm.dual_coef_, dtype=np.float64).ravel()))
        self.intercept.copy_(torch.from_numpy(np.asarray(svm.intercept_, dtype=np.float64).ravel()).to(device))

    def decision_function(self, activations: Tensor) -> Tensor:
        """``sum_i alpha_i K(sv_i, x) + b`` per row (float64), as ``OneClassSVM.decision_function``."""
        if self.state.n_support == 0:
            raise RuntimeError("this One-Class SVM is not fitted (n_support=0): call fit first")
        parts = []
        support_norms = self.support_vectors.pow(2).sum(-1)  # once per call, not per chunk
        for chunk in activations.split(SCORE_CHUNK):
            x = (chunk.double() - self.input_mean) / self.input_scale
            products = x @ self.support_vectors.T
            if self.config.kernel == "rbf":
                squared = x.pow(2).sum(-1, keepdim=True) + support_norms - 2.0 * products
                kernel = torch.exp(-self.config.gamma * squared.clamp_min(0.0))
            else:
                kernel = products
            parts.append(kernel @ self.dual_coef + self.intercept)
        return torch.cat(parts)

    @torch.no_grad()
    def forward(self, activations: Tensor, sae: SparseAutoencoder | None = None) -> DetectorOutput:
        scores = -self.decision_function(activations).float()
        return DetectorOutput(scores, torch.full_like(scores, -1, dtype=torch.long))
