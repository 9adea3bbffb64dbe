"""What every detector is: a config, a fit on safe activations, a score and a cluster per row.

A detector is an ``nn.Module`` whose tensors are buffers whose shapes follow
from its config, its fitted state and the activation/SAE widths, so that a
saved detector can be rebuilt empty and loaded strictly. A new method is a new
file with a :class:`Detector` subclass decorated with :func:`register_detector`.

The contract callers rely on, declared here rather than probed with ``getattr``:

- class attributes ``method``, ``config_class``, ``uses_sae``, ``supervised`` and
  ``state_class`` (the dataclass of values only known after fitting, or ``None``);
- :attr:`Detector.n_clusters`: the number of clusters a row can be assigned to
  (``0`` for a method without clusters), which per-cluster calibration reads;
- :meth:`Detector.fit_split`: the one fit entry point (safe rows, and unsafe rows
  for a supervised method);
- ``config`` is never rewritten: what fitting learns that is not a tensor goes to
  ``state``, saved next to the config.
"""

from __future__ import annotations

import dataclasses
import itertools
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple

import torch
from torch import Tensor, nn

from ..core.serialization import config_from_dict, config_to_dict
from ..data.store import DEFAULT_BATCH_SIZE, RowSource
from ..sae.model import SparseAutoencoder


@dataclass
class DetectorConfig:
    """Base class of detector configs; subclasses add their settings as fields."""


class DetectorOutput(NamedTuple):
    """What a detector's forward returns for a batch."""

    scores: Tensor
    """Anomaly score per row, ``[batch]`` float: higher means less like the safe data."""
    clusters: Tensor
    """Assigned cluster per row, ``[batch]`` long; ``-1`` for methods without clusters."""


class ScoreTerms(NamedTuple):
    """All terms of a batch's scores (:meth:`Detector.score_terms`), ``[batch, width]`` each (width: masked
    features)."""

    features: Tensor
    activations: Tensor
    contributions: Tensor
    typical: Tensor
    scores: Tensor
    """``[batch]``, the scores the terms sum to (as ``forward`` computes them)."""
    clusters: Tensor


class Detector(nn.Module, ABC):
    """Base class: ``fit`` on safe activations only, then ``forward`` scores rows."""

    method: ClassVar[str]
    """Registry name, saved in the guard's config."""

    config_class: ClassVar[type[DetectorConfig]]
    """The dataclass holding this method's settings."""

    uses_sae: ClassVar[bool] = True
    """Whether the method reads SAE codes (and so needs an SAE in its guard)."""

    supervised: ClassVar[bool] = False
    """True only for reference methods that need unsafe labels to fit (:meth:`fit_supervised`)."""

    state_class: ClassVar[type[Any] | None] = None
    """Dataclass of the non-tensor values fitting learns (sizes of buffers, per-cluster choices), or ``None``."""

    def __init__(self, config: DetectorConfig, d_in: int, d_sae: int | None, state: Any = None) -> None:
        super().__init__()
        if not isinstance(config, self.config_class):
            raise TypeError(f"{type(self).__name__} needs a {self.config_class.__name__}, got {type(config).__name__}")
        if self.uses_sae and d_sae is None:
            raise ValueError(f"{self.method} reads SAE codes: pass an SAE")
        if state is not None and (self.state_class is None or not isinstance(state, self.state_class)):
            raise TypeError(
                f"{type(self).__name__} takes a {getattr(self.state_class, '__name__', 'no')} state, got {state!r}"
            )
        self.config = config
        """The settings passed in; fitting never replaces them."""
        self.state = state if state is not None or self.state_class is None else self.state_class()
        """What fitting learned that is not a tensor (an instance of ``state_class``; ``None`` without one)."""
        self.d_in = d_in
        self.d_sae = d_sae

    def extra_repr(self) -> str:
        reads = f"d_in={self.d_in}" + (f", d_sae={self.d_sae}" if self.d_sae is not None else "")
        return f"method={self.method!r}, {reads}, {self.config}"

    @property
    def n_clusters(self) -> int:
        """Clusters a row can be assigned to (``forward`` returns values in ``[0, n_clusters)``); 0 without clusters."""
        return 0

    def fit_split(
        self, safe: Tensor, sae: SparseAutoencoder | None, *, unsafe: Tensor | None = None, progress: bool = True
    ) -> None:
        """Fit on ``safe`` activations, and ``unsafe`` ones for a supervised method: the call callers make."""
        if self.supervised:
            if unsafe is None:
                raise ValueError(f"{self.method} is a SUPERVISED reference: it needs unsafe activations to fit")
            self.fit_supervised(safe, unsafe, sae, progress=progress)
        elif unsafe is not None:
            raise ValueError(f"{self.method} is fitted on safe activations only; it takes no unsafe ones")
        else:
            self.fit(safe, sae, progress=progress)

    @abstractmethod
    def fit(self, activations: Tensor, sae: SparseAutoencoder | None, *, progress: bool = True) -> None:
        """Fit on safe activations ``[n, d_in]`` (float32, finite)."""

    def fit_rows(
        self,
        source: RowSource,
        sae: SparseAutoencoder | None,
        *,
        rows: Tensor | None = None,
        progress: bool = True,
        batch_size: int = DEFAULT_BATCH_SIZE,
    ) -> None:
        """Fit on the safe rows ``rows`` (ascending; default all) of ``source``.

        This default reads them into one tensor on the detector's device and calls
        :meth:`fit` (``batch_size`` is unused); methods that can stream override it.
        """
        rows = torch.arange(len(source)) if rows is None else rows
        state = next(itertools.chain(self.buffers(), self.parameters()), None)
        self.fit(source.take(rows).to(state.device if state is not None else "cpu"), sae, progress=progress)

    def fit_supervised(
        self, safe: Tensor, unsafe: Tensor, sae: SparseAutoencoder | None, *, progress: bool = True
    ) -> None:
        """Fit on safe (label 0) and unsafe (label 1) activations: supervised methods only."""
        raise TypeError(f"{self.method} is not supervised: fit it on safe activations with fit()")

    def settings_dict(self) -> dict[str, Any]:
        """The config and the fitted state as one JSON-ready dict (the ``detector`` entry of a guard's config.json)."""
        return config_to_dict(self.config) | (config_to_dict(self.state) if self.state_class is not None else {})

    @classmethod
    def from_settings(cls, data: dict[str, Any], d_in: int, d_sae: int | None, *, source: str) -> Detector:
        """An empty detector from :meth:`settings_dict` output: the state's keys are split off the config's."""
        names = {f.name for f in dataclasses.fields(cls.state_class)} if cls.state_class is not None else set()
        config = config_from_dict(cls.config_class, {k: v for k, v in data.items() if k not in names}, source=source)
        if cls.state_class is None:
            return cls(config, d_in, d_sae)
        state = config_from_dict(
            cls.state_class, {k: v for k, v in data.items() if k in names}, source=f"{source} (state)"
        )
        return cls(config, d_in, d_sae, state)

    def score_terms(self, activations: Tensor, sae: SparseAutoencoder | None) -> ScoreTerms:
        """Each row's score split into one term per SAE feature, summing to ``forward``'s score.

        What explanations read (:mod:`hf_lsad.guard.explain`); methods whose score is not a sum over
        SAE features do not override it.
        """
        raise NotImplementedError(
            f"{self.method} does not score SAE features; explanations need a detector that does (FreqMask-KM)"
        )

    @abstractmethod
    def forward(self, activations: Tensor, sae: SparseAutoencoder | None) -> DetectorOutput:
        """Score activations ``[batch, d_in]``; each row's score depends on that row alone.

        Inputs are not re-checked here: :class:`~hf_lsad.guard.SafetyGuard` checks width and
        finiteness once per call, and stores are checked when loaded."""


DETECTORS: dict[str, type[Detector]] = {}


def register_detector(cls: type[Detector]) -> type[Detector]:
    """Class decorator: make ``cls`` loadable by its ``method`` name."""
    if cls.method in DETECTORS:
        raise ValueError(f"detector method {cls.method!r} is already registered")
    DETECTORS[cls.method] = cls
    return cls


def detector_class(method: str) -> type[Detector]:
    """The registered class for ``method``; ``ValueError`` naming the known methods otherwise."""
    try:
        return DETECTORS[method]
    except KeyError:
        raise ValueError(f"unknown detector method {method!r}; registered: {sorted(DETECTORS)}") from None
