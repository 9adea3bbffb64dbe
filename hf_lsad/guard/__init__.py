"""The guard: a detector with its SAE, threshold and calibration, its reports, its folder format and card,
explanations, and the fits that make one (:func:`fit_guard`, running guards)."""

from .files import DEFAULT_GUARD, DETECTOR_WEIGHTS, GUARD_CONFIG, MODEL_CARD, SAE_SUBFOLDER, THRESHOLD_SCORES
from .fitting import FitResult, fit_guard
from .guard import SafetyGuard, upgrade_guard_folder
from .types import FeatureContribution, GuardConfig, GuardOutput, SafetyReport

__all__ = [
    "DEFAULT_GUARD",
    "DETECTOR_WEIGHTS",
    "GUARD_CONFIG",
    "MODEL_CARD",
    "SAE_SUBFOLDER",
    "THRESHOLD_SCORES",
    "FeatureContribution",
    "FitResult",
    "GuardConfig",
    "GuardOutput",
    "SafetyGuard",
    "SafetyReport",
    "fit_guard",
    "upgrade_guard_folder",
]
