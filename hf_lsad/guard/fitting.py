"""Fitting a guard on safe activations: 0.8/0.2 split, detector fit, threshold on the held-out part.

The safe activations are a tensor or an activation store read in batches
(:class:`~hf_lsad.data.store.ActivationStore`), so a FreqMask-KM guard can be fitted
on more rows than fit in memory.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from ..core.checks import check_activations
from ..core.hook_point import HookPoint
from ..core.prompt_inputs import InputProfile
from ..core.splits import SafeSplit, split_safe
from ..data.store import DEFAULT_BATCH_SIZE, ActivationStore, RowSource, TensorRows, row_batches
from ..detectors import DetectorConfig, detector_class
from ..sae.model import SparseAutoencoder
from .guard import GuardConfig, SafetyGuard
from .threshold import fpr_threshold


class FitResult(NamedTuple):
    """A fitted guard and the safe rows it was fitted and thresholded on."""

    guard: SafetyGuard
    split: SafeSplit
    holdout_scores: Tensor
    """Scores of the held-out safe rows, the ones the threshold was set on."""


def fit_guard(
    safe_activations: Tensor | ActivationStore,
    hook: HookPoint,
    method: str,
    detector_config: DetectorConfig,
    sae: SparseAutoencoder | None,
    *,
    unsafe: Tensor | None = None,
    target_fpr: float = 0.05,
    holdout_fraction: float = 0.2,
    seed: int = 0,
    progress: bool = True,
    batch_size: int = DEFAULT_BATCH_SIZE,
    device: str | torch.device | None = None,
    inputs: InputProfile | None = None,
) -> FitResult:
    """Fit ``method`` on the safe split, then set the threshold at ``target_fpr`` on the held-out safe rows.

    ``safe_activations`` is an ``[n, hidden_size]`` tensor or an :class:`~hf_lsad.data.store.ActivationStore`.
    FreqMask-KM streams from either (:meth:`~hf_lsad.detectors.FreqMaskKM.fit_rows`), reading
    ``batch_size`` rows at a time; other methods get their fit split as one tensor. The detector
    lives on ``device`` (default: the tensor's device, the CPU for a store), where ``sae`` must
    be too. The held-out rows are scored ``batch_size`` at a time. A supervised method (the linear
    probe reference) is also fitted on the ``unsafe`` activations; the others refuse them.
    The guard keeps ``inputs`` (default: the store's record of how its prompts were formatted),
    so that ``generate`` warns about inputs unlike them (:mod:`hf_lsad.core.prompt_inputs`).
    """
    if sae is not None:
        sae.check_reads(hook)
    if isinstance(safe_activations, ActivationStore):
        if safe_activations.width != hook.hidden_size:
            raise ValueError(
                f"safe activations have width {safe_activations.width}, expected hidden size {hook.hidden_size}"
            )
        source: RowSource = safe_activations
        device = torch.device(device or "cpu")
        inputs = inputs or safe_activations.inputs
    else:
        check_activations(safe_activations, hook.hidden_size, name="safe activations")
        source = TensorRows(safe_activations)
        device = torch.device(device or safe_activations.device)
    split = split_safe(len(source), holdout_fraction, seed)
    detector = detector_class(method)(detector_config, hook.hidden_size, sae.config.d_sae if sae else None)
    detector.to(device)
    if detector.supervised or unsafe is not None:
        safe_fit = source.take(split.fit).to(device)
        detector.fit_split(safe_fit, sae, unsafe=None if unsafe is None else unsafe.to(device), progress=progress)
    else:
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
    guard = SafetyGuard(config, detector, sae).eval()
    guard.set_holdout_scores(holdout_scores)  # reports then carry conformal p-values
    guard.inputs = inputs
    return FitResult(guard, split, holdout_scores)
