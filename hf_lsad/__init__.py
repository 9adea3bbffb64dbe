"""hf-lsad: safety guards that read the residual stream of Hugging Face causal LMs.

A guard has named heads on one forward pass: the paper's anomaly head, fitted on safe prompts only (SAE codes,
k-means, sparse masks), and supervised heads fitted on unsafe and benign prompts.

The names below are imported on first use (PEP 562), so ``import hf_lsad`` and the
``hf-lsad`` command stay fast and the detector layer never pulls in transformers.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .version import __version__

_EXPORTS = {
    "ActivationStore": "data.store",
    "AdapterWarning": "errors",
    "DETECTORS": "detectors",
    "Detector": "detectors",
    "FreqMaskConfig": "detectors",
    "FreqMaskKM": "detectors",
    "GuardConfig": "guard",
    "GuardFormatError": "errors",
    "GuardMismatchError": "errors",
    "InputError": "errors",
    "MissingColumnError": "errors",
    "ModelMismatchError": "errors",
    "ScoreShiftWarning": "errors",
    "UnsafeGuardFileError": "errors",
    "DegenerateFitWarning": "errors",
    "GuardedGenerateBeamDecoderOnlyOutput": "generation.model",
    "GuardedGenerateDecoderOnlyOutput": "generation.model",
    "GuardedGenerateOutput": "generation.model",
    "GuardedModelForCausalLM": "generation.model",
    "HookPoint": "core.hook_point",
    "SAEConfig": "sae",
    "SAETrainConfig": "sae",
    "SafetyGuard": "guard",
    "SafetyReport": "guard",
    "SmallSampleWarning": "errors",
    "ReteachWarning": "errors",
    "ThresholdsResetWarning": "errors",
    "SparseAutoencoder": "sae",
    "SupervisedHead": "guard.heads",
    "add_head": "guard.heads.training",
    "collect_activations": "capture",
    "encode_prompts": "capture",
    "load_model": "capture.pretrained",
    "load_sae": "sae.formats",
    "fit_budget_on_prompts": "guard.heads.budget",
    "fit_guard": "guard",
    "generate_with_activations": "capture",
    "register_detector": "detectors",
    "teach_traffic": "guard.heads.training",
    "train_sae": "sae",
}

__all__ = [
    "DETECTORS",
    "ActivationStore",
    "AdapterWarning",
    "DegenerateFitWarning",
    "Detector",
    "FreqMaskConfig",
    "FreqMaskKM",
    "GuardConfig",
    "GuardFormatError",
    "GuardMismatchError",
    "GuardedGenerateBeamDecoderOnlyOutput",
    "GuardedGenerateDecoderOnlyOutput",
    "GuardedGenerateOutput",
    "GuardedModelForCausalLM",
    "HookPoint",
    "InputError",
    "MissingColumnError",
    "ModelMismatchError",
    "ReteachWarning",
    "SAEConfig",
    "SAETrainConfig",
    "SafetyGuard",
    "SafetyReport",
    "ScoreShiftWarning",
    "SmallSampleWarning",
    "SparseAutoencoder",
    "SupervisedHead",
    "ThresholdsResetWarning",
    "UnsafeGuardFileError",
    "__version__",
    "add_head",
    "collect_activations",
    "encode_prompts",
    "fit_budget_on_prompts",
    "fit_guard",
    "generate_with_activations",
    "load_model",
    "load_sae",
    "register_detector",
    "teach_traffic",
    "train_sae",
]


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'hf_lsad' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    globals()[name] = value
    return value


if TYPE_CHECKING:
    from .capture import collect_activations, encode_prompts, generate_with_activations
    from .capture.pretrained import load_model
    from .core.hook_point import HookPoint
    from .data.store import ActivationStore
    from .detectors import DETECTORS, Detector, FreqMaskConfig, FreqMaskKM, register_detector
    from .errors import (
        AdapterWarning,
        DegenerateFitWarning,
        GuardFormatError,
        GuardMismatchError,
        InputError,
        MissingColumnError,
        ModelMismatchError,
        ReteachWarning,
        ScoreShiftWarning,
        SmallSampleWarning,
        ThresholdsResetWarning,
        UnsafeGuardFileError,
    )
    from .generation import (
        GuardedGenerateBeamDecoderOnlyOutput,
        GuardedGenerateDecoderOnlyOutput,
        GuardedGenerateOutput,
        GuardedModelForCausalLM,
    )
    from .guard import GuardConfig, SafetyGuard, SafetyReport, fit_guard
    from .guard.heads import SupervisedHead
    from .guard.heads.budget import fit_budget_on_prompts
    from .guard.heads.training import add_head, teach_traffic
    from .sae import SAEConfig, SAETrainConfig, SparseAutoencoder, load_sae, train_sae
