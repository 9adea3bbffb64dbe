"""Fitting a guard on safe activations: 0.8/0.2 split, detector fit, threshold on the held-out part."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from .calibration import fpr_threshold
from .capture import HookPoint
from .detectors import DetectorConfig, detector_class
from .guard import GuardConfig, SafetyGuard
from .sae import SparseAutoencoder
from .validation import check_activations


class SafeSplit(NamedTuple):
    fit: Tensor
    """Row indices the detector is fitted on."""
    holdout: Tensor
    """Row indices held out for the threshold (and as evaluation negatives)."""


class FitResult(NamedTuple):
    guard: SafetyGuard
    split: SafeSplit
    holdout_scores: Tensor
    """Scores of the held-out safe rows, the ones the threshold was set on."""


def split_safe(n: int, holdout_fraction: float = 0.2, seed: int = 0) -> SafeSplit:
    """A seeded random split of ``n`` safe rows (the paper's 0.8/0.2)."""
    if not 0.0 < holdout_fraction < 1.0:
        raise ValueError(f"holdout_fraction must be in (0, 1), got {holdout_fraction}")
    n_holdout = round(n * holdout_fraction)
    if n_holdout < 1 or n - n_holdout < 1:
        raise ValueError(f"cannot split {n} safe rows with holdout_fraction={holdout_fraction}")
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    return SafeSplit(fit=order[n_holdout:].sort().values, holdout=order[:n_holdout].sort().values)


def fit_guard(
    safe_activations: Tensor,
    hook: HookPoint,
    method: str,
    detector_config: DetectorConfig,
    sae: SparseAutoencoder | None,
    *,
    target_fpr: float = 0.05,
    holdout_fraction: float = 0.2,
    seed: int = 0,
    progress: bool = True,
) -> FitResult:
    """Fit ``method`` on the safe split, then set the threshold at ``target_fpr`` on the held-out safe rows."""
    check_activations(safe_activations, hook.hidden_size, name="safe activations")
    split = split_safe(len(safe_activations), holdout_fraction, seed)
    data = safe_activations.float()
    detector = detector_class(method)(detector_config, hook.hidden_size, sae.config.d_sae if sae else None)
    detector.to(data.device)
    detector.fit(data[split.fit], sae, progress=progress)
    with torch.no_grad():
        holdout_scores = detector(data[split.holdout], sae).scores
    config = GuardConfig(
        hook=hook,
        method=method,
        threshold=fpr_threshold(holdout_scores, target_fpr),
        target_fpr=target_fpr,
        n_fit=len(split.fit),
        n_holdout=len(split.holdout),
        seed=seed,
    )
    return FitResult(SafetyGuard(config, detector, sae).eval(), split, holdout_scores)
