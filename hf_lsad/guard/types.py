"""A guard's plain records: :class:`GuardConfig` (``config.json``'s ``guard`` block), :class:`GuardOutput`
(what :meth:`hf_lsad.guard.SafetyGuard.forward` returns) and :class:`SafetyReport` (the verdict on one sequence)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from torch import Tensor

from ..core.hook_point import HookPoint
from ..core.validation import NON_NEGATIVE, OPEN_UNIT, POSITIVE, check_ranges, ranged


@dataclass
class GuardConfig:
    """Everything about a guard that is not a tensor."""

    hook: HookPoint
    """Where the guard reads the model."""

    method: str
    """Registered detector method (``freqmask-km``, ...)."""

    threshold: float
    """Scores strictly above this are flagged."""

    target_fpr: float = ranged(OPEN_UNIT)
    """Safe false-positive rate the threshold was set for on held-out safe data."""

    n_fit: int = ranged(POSITIVE)
    """Safe activations the detector was fitted on."""

    n_holdout: int = ranged(POSITIVE)
    """Held-out safe activations the threshold was set on."""

    seed: int = ranged(NON_NEGATIVE)
    """Seed of the fit/held-out split."""

    def __post_init__(self) -> None:
        check_ranges(self)


class FeatureContribution(NamedTuple):
    """One SAE feature's part in a score."""

    feature: int
    """Index of the SAE feature (column of the SAE's encoder)."""
    activation: float
    """The row's activation of the feature (its SAE code)."""
    contribution: float
    """The feature's term of the score (module docstring); the terms over all masked features sum to the score."""
    typical: float
    """The assigned cluster's typical activation of the feature (centroid value)."""


class GuardOutput(NamedTuple):
    scores: Tensor
    """Anomaly score per row, ``[batch]``."""
    clusters: Tensor
    """Assigned cluster per row (``-1`` for methods without clusters)."""
    flagged: Tensor
    """``scores > threshold``, ``[batch]`` bool."""


class SafetyReport(NamedTuple):
    """The verdict on one sequence."""

    score: float
    threshold: float
    """The score threshold; for a calibrated guard, the probability threshold that ``flagged`` used."""
    flagged: bool
    cluster: int
    probability: float | None
    """Calibrated probability of being unsafe; ``None`` for an uncalibrated guard."""
    p_value: float | None = None
    """Conformal p-value of the score against the held-out safe scores
    (:func:`hf_lsad.guard.threshold.conformal_p_values`):
    ``0.008`` reads "more unusual than 99.2% of safe prompts". ``None`` for a guard saved without them."""
    error: str | None = None
    """Why this row could not be scored (e.g. a NaN activation), ``None`` when it was.

    A row that could not be scored fails closed: ``flagged`` is ``True``, ``score`` (and a
    calibrated ``probability``) ``nan`` and ``cluster`` ``-1``."""

    step: int | None = None
    """Guarded generation only: the step at which the row was flagged (0: at the prefill, before any
    new token; ``t``: after ``t`` new tokens), ``None`` if it was not flagged or not scored during generation."""
    stopped: bool = False
    """Whether guarded generation ended the row when it was flagged (``on_flag="stop"``)."""
    features: tuple[FeatureContribution, ...] | None = None
    """With ``explain=True``: the SAE features with the largest contributions to ``score``
    (:mod:`hf_lsad.guard.explain`)."""

    def describe(self) -> str:
        """One line a person can read, comparing the quantity that decided the verdict with its threshold.

        Calibrated: ``ok: P(unsafe) 0.127 <= 0.7013 (score 49.62, cluster 17, p-value 0.375)``;
        uncalibrated: ``FLAGGED: score 301.2 > 230.5 (cluster 3, p-value 0.002)``."""
        verdict = "FLAGGED" if self.flagged else "ok"
        if self.error is not None:
            return f"{verdict}: not scored ({self.error})"
        sign = ">" if self.flagged else "<="
        p_value = f", p-value {self.p_value:.3g}" if self.p_value is not None else ""
        if self.probability is not None:
            return (
                f"{verdict}: P(unsafe) {self.probability:.3f} {sign} {self.threshold:.4g} "
                f"(score {self.score:.4g}, cluster {self.cluster}{p_value})"
            )
        return f"{verdict}: score {self.score:.4g} {sign} {self.threshold:.4g} (cluster {self.cluster}{p_value})"
