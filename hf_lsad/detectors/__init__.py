"""Detector registry. Importing a method's module registers it: one line per method."""

from .base import DETECTORS, Detector, DetectorConfig, DetectorOutput, detector_class, register_detector
from .cvdd import CVDD, CVDDConfig
from .deep_svdd import DeepSVDD, DeepSVDDConfig
from .freqmask import FreqMaskConfig, FreqMaskKM
from .gmm import GaussianMixtureDetector, GMMConfig
from .knn import KNNConfig, KNNDistance, KNNState
from .learned_mask import LearnedMaskConfig, LearnedMaskLoRA, LearnedMaskState
from .linear_probe import LinearProbe, LinearProbeConfig
from .mahalanobis import Mahalanobis, MahalanobisConfig
from .ocsvm import OCSVMConfig, OCSVMState, OneClassSVMDetector

__all__ = [
    "CVDD",
    "DETECTORS",
    "CVDDConfig",
    "DeepSVDD",
    "DeepSVDDConfig",
    "Detector",
    "DetectorConfig",
    "DetectorOutput",
    "FreqMaskConfig",
    "FreqMaskKM",
    "GMMConfig",
    "GaussianMixtureDetector",
    "KNNConfig",
    "KNNDistance",
    "KNNState",
    "LearnedMaskConfig",
    "LearnedMaskLoRA",
    "LearnedMaskState",
    "LinearProbe",
    "LinearProbeConfig",
    "Mahalanobis",
    "MahalanobisConfig",
    "OCSVMConfig",
    "OCSVMState",
    "OneClassSVMDetector",
    "detector_class",
    "register_detector",
]
