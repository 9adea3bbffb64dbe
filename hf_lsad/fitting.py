"""Fitting a guard on safe activations: 0.8/0.2 split, detector fit, threshold on the held-out part.

The safe activations are a tensor or an activation store read in batches
(:class:`~hf_lsad.store.ActivationStore`), so a FreqMask-KM guard can be fitted
on more rows than fit in memory.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from .calibration import fpr_threshold
from .capture import HookPoint
from .detectors import DetectorConfig, detector_class
from .guard import GuardConfig, SafetyGuard
from .sae import SparseAutoencoder
from .store import DEFAULT_BATCH_SIZE, ActivationStore, RowSource, TensorRows, row_batches
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
    safe_activations: Tensor | ActivationStore,
    hook: HookPoint,
    method: str,
    detector_config: DetectorConfig,
    sae: SparseAutoencoder | None,
    *,
    target_fpr: float = 0.05,
    holdout_fraction: float = 0.2,
    seed: int = 0,
    progress: bool = True,
    batch_size: int = DEFAULT_BATCH_SIZE,
    device: str | torch.device | None = None,
) -> FitResult:
    """Fit ``method`` on the safe split, then set the threshold at ``target_fpr`` on the held-out safe rows.

    ``safe_activations`` is an ``[n, hidden_size]`` tensor or an :class:`~hf_lsad.store.ActivationStore`.
    FreqMask-KM streams from either (:meth:`~hf_lsad.detectors.FreqMaskKM.fit_rows`), reading
    ``batch_size`` rows at a time; other methods get their fit split as one tensor. The detector
    lives on ``device`` (default: the tensor's device, the CPU for a store), where ``sae`` must
    be too. The held-out rows are scored ``batch_size`` at a time.
    """
    if isinstance(safe_activations, ActivationStore):
        if safe_activations.width != hook.hidden_size:
            raise ValueError(
                f"safe activations have width {safe_activations.width}, expected hidden size {hook.hidden_size}"
            )
        source: RowSource = safe_activations
        device = torch.device(device or "cpu")
    else:
        check_activations(safe_activations, hook.hidden_size, name="safe activations")
        source = TensorRows(safe_activations)
        device = torch.device(device or safe_activations.device)
    split = split_safe(len(source), holdout_fraction, seed)
    detector = detector_class(method)(detector_config, hook.hidden_size, sae.config.d_sae if sae else None)
    detector.to(device)
    detector.fit_rows(source, sae, rows=split.fit, progress=progress, batch_size=batch_size)
    with torch.no_grad():
        holdout_scores = torch.cat(
            [detector(batch.to(device), sae).scores for batch in row_batches(source, split.holdout, batch_size)]
        )
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
