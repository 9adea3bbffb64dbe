"""The heads a guard decides with: the paper's anomaly head (in :mod:`hf_lsad.guard.guard`) and the supervised
head (:mod:`hf_lsad.guard.heads.probe`)."""

from .probe import LogisticProbe, ProbeConfig, balanced_weights

__all__ = ["LogisticProbe", "ProbeConfig", "balanced_weights"]
