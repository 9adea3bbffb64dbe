"""LearnedMask-LoRA (paper, section "Learned masks"): its config, its training (masks, then per-cluster LoRA
through peft) and the detector that scores with them."""

from .config import (
    BASE_SAE,
    LAMBDA_SWEEP,
    MASK_AND_LORA,
    MASK_ONLY,
    MASK_TYPES,
    SCORE_METRICS,
    LearnedMaskConfig,
    LearnedMaskState,
    MaskType,
    ResidualScore,
)
from .detector import LearnedMaskLoRA

__all__ = [
    "BASE_SAE",
    "LAMBDA_SWEEP",
    "MASK_AND_LORA",
    "MASK_ONLY",
    "MASK_TYPES",
    "SCORE_METRICS",
    "LearnedMaskConfig",
    "LearnedMaskLoRA",
    "LearnedMaskState",
    "MaskType",
    "ResidualScore",
]
