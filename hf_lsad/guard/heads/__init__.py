"""The heads a guard decides with besides the paper's anomaly head (in :mod:`hf_lsad.guard.guard`): supervised heads
(:mod:`hf_lsad.guard.heads.probe`), how one is fitted (:mod:`hf_lsad.guard.heads.training`), thresholds set on a
user's prompts (:mod:`hf_lsad.guard.heads.budget`), the bundled rows they read and their cache
(:mod:`hf_lsad.guard.heads.bundled`), and what a change does to the bundled traffic
(:mod:`hf_lsad.guard.heads.bundled_checks`)."""

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
    check_name_free,
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
    "check_name_free",
    "make_probe",
]
