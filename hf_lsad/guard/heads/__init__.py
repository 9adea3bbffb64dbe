"""The heads a guard decides with besides the paper's anomaly head (in :mod:`hf_lsad.guard.guard`): supervised heads
(:mod:`hf_lsad.guard.heads.probe`) and how one is fitted from labelled prompts (:mod:`hf_lsad.guard.heads.training`)."""

from .probe import (
    PROBES,
    Balance,
    LogisticProbe,
    MLPProbe,
    Probe,
    ProbeConfig,
    SupervisedHead,
    SupervisedHeadConfig,
    balanced_weights,
    check_head_name,
    make_probe,
)

__all__ = [
    "PROBES",
    "Balance",
    "LogisticProbe",
    "MLPProbe",
    "Probe",
    "ProbeConfig",
    "SupervisedHead",
    "SupervisedHeadConfig",
    "balanced_weights",
    "check_head_name",
    "make_probe",
]
