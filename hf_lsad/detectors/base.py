"""What every detector is: a config, a fit on safe activations, a score per row.

A detector is an ``nn.Module`` whose tensors are buffers whose shapes follow
from its config and the activation/SAE widths, so that a saved detector can be
rebuilt empty and loaded strictly. A new method is a new file with a
:class:`Detector` subclass decorated with :func:`register_detector`.
"""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar, NamedTuple

import torch
from torch import Tensor, nn

from ..sae import SparseAutoencoder
from ..store import DEFAULT_BATCH_SIZE, RowSource


@dataclass
class DetectorConfig:
    """Base class of detector configs; subclasses add their settings as fields."""


class DetectorOutput(NamedTuple):
    scores: Tensor
    """Anomaly score per row, ``[batch]`` float: higher means less like the safe data."""
    clusters: Tensor
    """Assigned cluster per row, ``[batch]`` long; ``-1`` for methods without clusters."""


class Detector(nn.Module, ABC):
    """Base class: ``fit`` on safe activations only, then ``forward`` scores rows."""

    method: ClassVar[str]
    """Registry name, saved in the guard's config."""

    config_class: ClassVar[type[DetectorConfig]]
    """The dataclass holding this method's settings."""

    uses_sae: ClassVar[bool] = True
    """Whether the method reads SAE codes (and so needs an SAE in its guard)."""

    supervised: ClassVar[bool] = False
    """True only for reference methods that need unsafe labels to fit."""

    def __init__(self, config: DetectorConfig, d_in: int, d_sae: int | None) -> None:
        super().__init__()
        if not isinstance(config, self.config_class):
            raise TypeError(f"{type(self).__name__} needs a {self.config_class.__name__}, got {type(config).__name__}")
        if self.uses_sae and d_sae is None:
            raise ValueError(f"{self.method} reads SAE codes: pass an SAE")
        self.config = config
        self.d_in = d_in
        self.d_sae = d_sae

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
