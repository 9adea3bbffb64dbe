"""The heads a guard decides with besides the paper's anomaly head (in :mod:`hf_lsad.guard.guard`): supervised heads
(:mod:`hf_lsad.guard.heads.probe`) and how one is fitted from labelled prompts (:mod:`hf_lsad.guard.heads.training`)."""

from .probe import LogisticProbe, ProbeConfig, SupervisedHead, SupervisedHeadConfig, balanced_weights, check_head_name

__all__ = [
    "LogisticProbe",
    "ProbeConfig",
    "SupervisedHead",
    "SupervisedHeadConfig",
    "balanced_weights",
    "check_head_name",
]
