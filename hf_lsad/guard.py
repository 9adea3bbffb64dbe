"""SafetyGuard: an SAE, a fitted detector and a threshold, saved as JSON + safetensors.

A guard folder (locally or in a Hub repo, optionally under a subfolder)::

    config.json            format version, library versions, hook point, method,
                           threshold and target FPR, detector settings
    detector.safetensors   the detector's tensors (centroids, masks, ...)
    sae/config.json        the SAE's shape (a folder loadable on its own)
    sae/sae.safetensors    the SAE's weights
    README.md              model card (optional)

Loading is strict (see :mod:`hf_lsad.serialization`): nothing but JSON and
safetensors is read, and every key and tensor must be there with its shape.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import faiss
import torch
from torch import Tensor, nn

from . import __version__
from .capture import HookPoint
from .detectors import Detector, detector_class
from .hub import resolve_pretrained_dir
from .sae import SparseAutoencoder
from .serialization import (
    FORMAT_VERSION,
    GuardFormatError,
    config_from_dict,
    config_to_dict,
    load_module,
    read_json,
    save_module,
    write_json,
)
from .validation import check_activations

GUARD_CONFIG = "config.json"
DETECTOR_WEIGHTS = "detector.safetensors"
SAE_SUBFOLDER = "sae"


@dataclass
class GuardConfig:
    """Everything about a guard that is not a tensor."""

    hook: HookPoint
    """Where the guard reads the model."""

    method: str
    """Registered detector method (``freqmask-km``, ...)."""

    threshold: float
    """Scores strictly above this are flagged."""

    target_fpr: float
    """Safe false-positive rate the threshold was set for on held-out safe data."""

    n_fit: int
    """Safe activations the detector was fitted on."""

    n_holdout: int
    """Held-out safe activations the threshold was set on."""

    seed: int
    """Seed of the fit/held-out split."""


class GuardOutput(NamedTuple):
    scores: Tensor
    """Anomaly score per row, ``[batch]``."""
    clusters: Tensor
    """Assigned cluster per row (``-1`` for methods without clusters)."""
    flagged: Tensor
    """``scores > threshold``, ``[batch]`` bool."""


class SafetyReport(NamedTuple):
    """The verdict on one sequence."""

    score: float
    threshold: float
    flagged: bool
    cluster: int
    probability: float | None
    """Calibrated probability of being unsafe; ``None`` for an uncalibrated guard."""


class SafetyGuard(nn.Module):
    """Scores residual-stream activations read at ``config.hook``."""

    def __init__(self, config: GuardConfig, detector: Detector, sae: SparseAutoencoder | None) -> None:
        super().__init__()
        if detector.method != config.method:
            raise ValueError(f"config names method {config.method!r} but the detector is {detector.method!r}")
        if detector.uses_sae and sae is None:
            raise ValueError(f"{config.method} needs an SAE")
        if sae is not None and sae.config.d_in != config.hook.hidden_size:
            raise ValueError(f"SAE reads width {sae.config.d_in}, hook point has hidden size {config.hook.hidden_size}")
        self.config = config
        self.detector = detector
        self.sae = sae

    @property
    def threshold(self) -> float:
        return self.config.threshold

    @torch.no_grad()
    def forward(self, activations: Tensor) -> GuardOutput:
        """Score ``[batch, hidden_size]`` activations (any float dtype, any device of the guard)."""
        check_activations(activations, self.config.hook.hidden_size)
        scores, clusters = self.detector(activations.float(), self.sae)
        return GuardOutput(scores, clusters, scores > self.config.threshold)

    def reports(self, activations: Tensor) -> list[SafetyReport]:
        """One :class:`SafetyReport` per row of ``activations``."""
        output = self(activations)
        return [
            SafetyReport(score=s, threshold=self.config.threshold, flagged=f, cluster=c, probability=None)
            for s, c, f in zip(output.scores.tolist(), output.clusters.tolist(), output.flagged.tolist())
        ]

    def save_pretrained(self, save_directory: str | os.PathLike) -> None:
        """Write the guard folder described in the module docstring."""
        path = Path(save_directory)
        path.mkdir(parents=True, exist_ok=True)
        write_json(
            path / GUARD_CONFIG,
            {
                "format_version": FORMAT_VERSION,
                "versions": {"hf_lsad": __version__, "torch": torch.__version__, "faiss": faiss.__version__},
                "guard": config_to_dict(self.config),
                "detector": config_to_dict(self.detector.config),
                "d_sae": self.sae.config.d_sae if self.sae is not None else None,
            },
        )
        save_module(self.detector, path / DETECTOR_WEIGHTS)
        if self.sae is not None:
            self.sae.save_pretrained(path / SAE_SUBFOLDER)

    @classmethod
    def from_pretrained(cls, name_or_path: str | os.PathLike, **hub_kwargs: Any) -> SafetyGuard:
        """Load a guard from a local folder or a Hub repo.

        ``hub_kwargs`` (``revision``, ``subfolder``, ``token``, ``cache_dir``,
        ``local_files_only``, ``force_download``) behave as in transformers.
        """
        path = resolve_pretrained_dir(name_or_path, **hub_kwargs)
        raw = read_json(path / GUARD_CONFIG)
        source = str(path / GUARD_CONFIG)
        if raw.get("format_version") != FORMAT_VERSION:
            raise GuardFormatError(f"{source}: format_version {raw.get('format_version')!r}, expected {FORMAT_VERSION}")
        for key in ("guard", "detector", "d_sae"):
            if key not in raw:
                raise GuardFormatError(f"{source}: missing config key {key!r}")
        config = config_from_dict(GuardConfig, raw["guard"], source=source)
        method = detector_class(config.method)
        detector_config = config_from_dict(method.config_class, raw["detector"], source=f"{source}:detector")
        sae = SparseAutoencoder.from_pretrained(path / SAE_SUBFOLDER) if raw["d_sae"] is not None else None
        if sae is not None and sae.config.d_sae != raw["d_sae"]:
            raise GuardFormatError(f"{source}: d_sae {raw['d_sae']} but the SAE has {sae.config.d_sae} features")
        detector = method(detector_config, config.hook.hidden_size, raw["d_sae"])
        load_module(detector, path / DETECTOR_WEIGHTS)
        return cls(config, detector, sae).eval()
