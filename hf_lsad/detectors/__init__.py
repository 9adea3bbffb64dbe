"""Detector registry. Importing a method's module registers it: one line per method."""

from .base import DETECTORS, Detector, DetectorConfig, DetectorOutput, detector_class, register_detector
from .freqmask import FreqMaskConfig, FreqMaskKM

__all__ = [
    "DETECTORS",
    "Detector",
    "DetectorConfig",
    "DetectorOutput",
    "FreqMaskConfig",
    "FreqMaskKM",
    "detector_class",
    "register_detector",
]
