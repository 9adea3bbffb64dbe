"""A guard that scores the response while it is written (position ``response_running``).

Fitting. The detector is fitted on activations at every ``stride``-th consumed
response token of the model's greedy responses to safe prompts (all positions of the
*fit* sequences; the split is by sequence, so no sequence is on both sides).

Per-sequence false-stop rule. During generation each consumed response token ``t``
gets a score ``s_t``; a row is stopped at the first ``t`` where the last ``m``
(``patience``) scores all exceed the threshold. So a response is stopped iff its
*sequence statistic*

    S = max_t min(s_{t-m+1}, ..., s_t)          (over windows of m consecutive tokens;
                                                 a response shorter than m: the min over all of it)

exceeds the threshold. The threshold is set on held-out safe *sequences* by the same
safe-quantile rule as every other guard (:func:`hf_lsad.guard.calibration.fpr_threshold`),
applied to their statistics ``S``: the fraction of held-out safe responses that would be
stopped is at most ``target_fpr`` (a per-sequence rate, not a per-token one), and on
fresh safe responses at most ``target_fpr + sqrt(log(2/delta) / 2n)`` with probability
``1 - delta``, for responses of the length the threshold was set at
(``max_new_tokens``; longer responses have more windows and stop more often).

A row shorter than ``m`` scored tokens is never stopped while it runs (there is no full
window), but its report uses the same statistic, so ``report.flagged == (S > threshold)``
for every row and the report of a stopped row carries the step it was stopped at.

Collection and fitting are in :mod:`hf_lsad.guard.running_fit`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class RunningConfig:
    """Settings of a ``response_running`` guard (saved in its ``config.json`` under ``running``)."""

    patience: int = 1
    """m: consecutive flagged tokens that stop a row."""
    stride: int = 1
    """k: the detector was fitted on every k-th response token."""
    max_new_tokens: int = 64
    """Response length the per-sequence threshold was set at."""
    n_holdout_sequences: int = 0
    """Held-out safe responses the threshold was set on."""

    def __post_init__(self) -> None:
        if self.patience < 1 or self.stride < 1:
            raise ValueError(f"patience and stride must be >= 1, got {self.patience}, {self.stride}")


def sequence_statistic(scores: Tensor, patience: int) -> tuple[Tensor, Tensor]:
    """``(S, t*)`` per row of ``scores`` ``[batch, steps]`` (``nan`` where a row was not scored).

    ``S`` is the module docstring's statistic over each row's scored tokens (which are
    consecutive from the first step), ``t*`` the index of the last token of the window
    that attains it (``-1`` and ``S = -inf`` for a row with no scored token).
    """
    batch, _steps = scores.shape
    stat = torch.full((batch,), float("-inf"))
    at = torch.full((batch,), -1, dtype=torch.long)
    for row in range(batch):
        s = scores[row]
        s = s[~torch.isnan(s)]
        if len(s) == 0:
            continue
        m = min(patience, len(s))
        windows = s.unfold(0, m, 1).min(dim=1).values
        best = int(windows.argmax())
        stat[row], at[row] = windows[best], best + m - 1
    return stat, at
