"""Guarded generation: ``GuardedModelForCausalLM`` (generate with reports, screening, stopping), its folder
format and the ``text-generation`` pipeline that carries the reports."""

from .control import StepVerdict
from .model import (
    GUARD_SUBFOLDER,
    GUARDED_CONFIG,
    GuardedGenerateBeamDecoderOnlyOutput,
    GuardedGenerateDecoderOnlyOutput,
    GuardedGenerateOutput,
    GuardedModelForCausalLM,
)

__all__ = [
    "GUARDED_CONFIG",
    "GUARD_SUBFOLDER",
    "GuardedGenerateBeamDecoderOnlyOutput",
    "GuardedGenerateDecoderOnlyOutput",
    "GuardedGenerateOutput",
    "GuardedModelForCausalLM",
    "StepVerdict",
]
