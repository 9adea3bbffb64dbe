"""Masks over SAE features: which features a cluster is scored on (paper, section "Masks").

- :func:`top_k_mask`: the frequency mask of FreqMask-KM, the ``k`` most frequently
  active features (global: pooled frequencies; local: one cluster's), ties to the
  lower index.
- :func:`straight_through_mask`: the learned binary mask of LearnedMask-LoRA, hard in
  the forward pass with the gradient of its sigmoid in the backward pass.
"""

from __future__ import annotations

import torch
from torch import Tensor


def top_k_mask(frequency: Tensor, k: int) -> Tensor:
    """Indices of the k largest frequencies, ties to the lower index, sorted ascending."""
    order = torch.sort(frequency, descending=True, stable=True).indices
    return order[:k].sort().values


def straight_through_mask(logits: Tensor) -> Tensor:
    """``1[logits > 0]`` in the forward pass, the gradient of ``sigmoid(logits)`` in the backward pass."""
    soft = torch.sigmoid(logits)
    return soft + ((logits > 0).to(soft.dtype) - soft).detach()
