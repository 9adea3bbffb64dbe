"""Input checks shared by fitting and scoring, so bad data fails loudly and early."""

from __future__ import annotations

import torch
from torch import Tensor


def check_activations(activations: Tensor, width: int | None = None, *, name: str = "activations") -> None:
    """Raise ``ValueError`` unless ``activations`` is a finite, non-empty ``[n, width]`` tensor."""
    if not isinstance(activations, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(activations).__name__}")
    if activations.ndim != 2:
        raise ValueError(f"{name} must have shape [n, hidden_size], got {tuple(activations.shape)}")
    if activations.shape[0] == 0:
        raise ValueError(f"{name} is empty")
    if width is not None and activations.shape[1] != width:
        raise ValueError(f"{name} have width {activations.shape[1]}, expected hidden size {width}")
    finite = torch.isfinite(activations)
    if not finite.all():
        bad = (~finite).any(1).nonzero().flatten()[:5].tolist()
        raise ValueError(f"{name} contain NaN or inf (rows {bad}{'...' if (~finite).any(1).sum() > 5 else ''})")
