"""hf-lsad: unsupervised safety detectors on the residual stream of Hugging Face causal LMs."""

__version__ = "0.1.0"

from .capture import HookPoint, collect_activations, generate_with_activations  # noqa: E402
from .errors import GuardFormatError, GuardMismatchError, InputError, ModelMismatchError, UnsafeGuardFileError  # noqa: E402
from .detectors import DETECTORS, Detector, FreqMaskConfig, FreqMaskKM, register_detector  # noqa: E402
from .fitting import fit_guard  # noqa: E402
from .guard import GuardConfig, SafetyGuard, SafetyReport  # noqa: E402
from .modeling import GuardedGenerateDecoderOnlyOutput, GuardedModelForCausalLM  # noqa: E402
from .sae import SAEConfig, SAETrainConfig, SparseAutoencoder, train_sae  # noqa: E402
from .store import ActivationStore  # noqa: E402

__all__ = [
    "ActivationStore",
    "DETECTORS",
    "Detector",
    "FreqMaskConfig",
    "FreqMaskKM",
    "GuardConfig",
    "GuardFormatError",
    "GuardMismatchError",
    "GuardedGenerateDecoderOnlyOutput",
    "GuardedModelForCausalLM",
    "HookPoint",
    "InputError",
    "ModelMismatchError",
    "SAEConfig",
    "SAETrainConfig",
    "SafetyGuard",
    "SafetyReport",
    "SparseAutoencoder",
    "UnsafeGuardFileError",
    "collect_activations",
    "fit_guard",
    "generate_with_activations",
    "register_detector",
    "train_sae",
]
