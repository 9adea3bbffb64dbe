"""SafetyGuard: an SAE, a fitted detector and a threshold, saved as JSON + safetensors.

A guard folder (locally or in a Hub repo, optionally under a subfolder)::

    config.json            format version, library versions, hook point, method,
                           threshold and target FPR, detector settings, and for a
                           calibrated guard its per-cluster affine calibration
    detector.safetensors   the detector's tensors (centroids, masks, ...)
    sae/config.json        the SAE's shape (a folder loadable on its own)
    sae/sae.safetensors    the SAE's weights
    README.md              model card (:mod:`hf_lsad.model_card`; always on the Hub, optional locally)

Loading is strict (see :mod:`hf_lsad.serialization`): nothing but JSON and
safetensors is read, and every key and tensor must be there with its shape.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch
from huggingface_hub import CommitInfo, ModelCard
from torch import Tensor, nn

from .calibration import AffineCalibration
from .checks import check_activations
from .detectors import Detector, detector_class
from .explain import FeatureContribution, explain_scores
from .hook_point import HookPoint
from .hub import resolve_pretrained_dir, upload_pretrained_dir
from .model_card import DEFAULT_LICENSE, guard_model_card
from .running_guard import RunningConfig
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
from .version import library_versions

GUARD_CONFIG = "config.json"
MODEL_CARD = "README.md"
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
    """The score threshold; for a calibrated guard, the probability threshold that ``flagged`` used."""
    flagged: bool
    cluster: int
    probability: float | None
    """Calibrated probability of being unsafe; ``None`` for an uncalibrated guard."""
    step: int | None = None
    """Guarded generation only: the step at which the row was flagged (0: at the prefill, before any
    new token; ``t``: after ``t`` new tokens), ``None`` if it was not flagged or not scored during generation."""
    stopped: bool = False
    """Whether guarded generation ended the row when it was flagged (``on_flag="stop"``)."""
    features: tuple[FeatureContribution, ...] | None = None
    """With ``explain=True``: the SAE features with the largest contributions to ``score`` (:mod:`hf_lsad.explain`)."""


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
        self.calibration: AffineCalibration | None = None
        """Per-cluster affine calibration (:meth:`set_calibration`); when set, rows are flagged by probability."""
        self.running: RunningConfig | None = None
        """For a ``response_running`` guard: patience and how its threshold was set (:mod:`hf_lsad.running_guard`)."""
        if config.hook.position == "response_running":
            self.running = RunningConfig()

    def set_calibration(self, calibration: AffineCalibration | None) -> None:
        """Calibrate the guard (``None`` removes it).

        A calibrated guard reports ``sigmoid(a_c s + b_c)`` and flags rows above ``calibration.threshold``.
        """
        if calibration is not None:
            n_clusters = self.detector.n_clusters
            if calibration.n_clusters != n_clusters:
                raise ValueError(
                    f"calibration has {calibration.n_clusters} clusters, the {self.config.method} detector {n_clusters}"
                )
        self.calibration = calibration

    @property
    def threshold(self) -> float:
        return self.config.threshold

    @torch.no_grad()
    def forward(self, activations: Tensor) -> GuardOutput:
        """Score ``[batch, hidden_size]`` activations (any float dtype, any device of the guard)."""
        return self._score(activations)[0]

    @torch.no_grad()
    def _score(self, activations: Tensor) -> tuple[GuardOutput, Tensor | None]:
        """The output and, for a calibrated guard, the probabilities it flagged by (computed once)."""
        check_activations(activations, self.config.hook.hidden_size)
        scores, clusters = self.detector(activations.float(), self.sae)
        if self.calibration is None:
            return GuardOutput(scores, clusters, scores > self.config.threshold), None
        probabilities = self.calibration.probabilities(scores, clusters)
        return GuardOutput(scores, clusters, probabilities > self.calibration.threshold), probabilities

    def reports(self, activations: Tensor, *, explain: bool = False, top_k: int = 10) -> list[SafetyReport]:
        """One :class:`SafetyReport` per row of ``activations``.

        ``explain=True`` fills :attr:`SafetyReport.features` with the ``top_k`` SAE features
        that contribute most to each score (:meth:`explain`).
        """
        output, probabilities = self._score(activations)
        if probabilities is None:
            threshold, probabilities = self.config.threshold, [None] * len(output.scores)
        else:
            threshold, probabilities = self.calibration.threshold, probabilities.tolist()
        features = self.explain(activations, top_k=top_k) if explain else [None] * len(output.scores)
        rows = zip(output.scores.tolist(), output.clusters.tolist(), output.flagged.tolist(), probabilities, features)
        return [
            SafetyReport(score=s, threshold=threshold, flagged=f, cluster=c, probability=p, features=e)
            for s, c, f, p, e in rows
        ]

    @torch.no_grad()
    def explain(self, activations: Tensor, *, top_k: int | None = 10) -> list[tuple[FeatureContribution, ...]]:
        """Per row, the SAE features behind its score, largest contribution first (``top_k=None``: all terms).

        See :func:`hf_lsad.explain.explain_scores` for what a contribution is; detectors
        that do not score SAE features (e.g. ``mahalanobis`` on raw activations) raise
        ``NotImplementedError``.
        """
        check_activations(activations, self.config.hook.hidden_size)
        return explain_scores(self.detector, self.sae, activations.float(), top_k=top_k)

    def save_pretrained(
        self,
        save_directory: str | os.PathLike,
        *,
        metrics: Mapping[str, Mapping[str, float]] | None = None,
        data: str | None = None,
        datasets: str | list[str] | None = None,
        license: str = DEFAULT_LICENSE,
    ) -> None:
        """Write the guard folder described in the module docstring.

        With ``metrics`` or ``data`` given, also write a ``README.md`` model card
        (:func:`hf_lsad.model_card.guard_model_card`): ``metrics`` maps each unsafe category to
        its measured ``{"auroc": ..., "tpr_at_5fpr": ...}`` (as ``hf-lsad evaluate`` prints),
        ``data`` describes the prompts the guard was fitted on, ``datasets`` and ``license``
        go to the card metadata.
        """
        path = Path(save_directory)
        self._save_files(path)
        if metrics is not None or data is not None:
            self.model_card(metrics=metrics, data=data, datasets=datasets, license=license).save(path / MODEL_CARD)

    def _save_files(self, path: Path) -> None:
        path.mkdir(parents=True, exist_ok=True)
        write_json(
            path / GUARD_CONFIG,
            {
                "format_version": FORMAT_VERSION,
                "versions": library_versions("hf_lsad", "torch", "faiss"),
                "guard": config_to_dict(self.config),
                "detector": self.detector.settings_dict(),
                "d_sae": self.sae.config.d_sae if self.sae is not None else None,
            }
            # Only calibrated guards carry the key, so uncalibrated folders are unchanged.
            | ({"calibration": config_to_dict(self.calibration)} if self.calibration is not None else {})
            # Likewise only response_running guards carry their running settings.
            | ({"running": config_to_dict(self.running)} if self.running is not None else {}),
        )
        save_module(self.detector, path / DETECTOR_WEIGHTS)
        if self.sae is not None:
            self.sae.save_pretrained(path / SAE_SUBFOLDER)

    def model_card(self, **kwargs: Any) -> ModelCard:
        """This guard's :class:`huggingface_hub.ModelCard`; ``kwargs`` as in :func:`hf_lsad.model_card.guard_model_card`."""
        return guard_model_card(self, **kwargs)

    def push_to_hub(
        self,
        repo_id: str,
        *,
        subfolder: str = "",
        commit_message: str = "Upload hf-lsad guard",
        private: bool | None = None,
        token: str | bool | None = None,
        revision: str | None = None,
        create_pr: bool = False,
        metrics: Mapping[str, Mapping[str, float]] | None = None,
        data: str | None = None,
        datasets: str | list[str] | None = None,
        license: str = DEFAULT_LICENSE,
    ) -> CommitInfo:
        """Upload the guard, with its model card, to a Hub repo in one commit (creating the repo if needed).

        Args:
            repo_id: ``"org/name"``, or ``"name"`` for the token owner's namespace.
            subfolder: Folder in the repo for this guard (``""``: the root). Several guards for one
                base model (other layers or methods) can share a repo, one per subfolder.
            commit_message: Commit summary.
            private: Visibility if the repo is created (``None``: the Hub default).
            token: Hub token (``None``: the saved or ``HF_TOKEN`` token).
            revision: Branch to push to (default ``main``; created if missing).
            create_pr: Open a pull request instead of committing to the branch.
            metrics, data, datasets, license: Model card content, as in :meth:`save_pretrained`.
                Without ``metrics`` the card says that none were measured.

        Returns:
            The :class:`huggingface_hub.CommitInfo`; ``.oid`` is the commit sha to pin as
            ``revision`` when loading.

        Files already in the repo folder that this guard does not write are left as they are.
        """
        card = self.model_card(
            metrics=metrics,
            data=data,
            datasets=datasets,
            license=license,
            repo_id=repo_id,
            subfolder=subfolder,
            revision=revision,
        )
        with tempfile.TemporaryDirectory(prefix="hf-lsad-push-") as tmp:
            folder = Path(tmp)
            self._save_files(folder)
            card.save(folder / MODEL_CARD)
            return upload_pretrained_dir(
                folder,
                repo_id,
                subfolder=subfolder,
                commit_message=commit_message,
                revision=revision,
                private=private,
                token=token,
                create_pr=create_pr,
            )

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
        sae = SparseAutoencoder.from_pretrained(path / SAE_SUBFOLDER) if raw["d_sae"] is not None else None
        if sae is not None and sae.config.d_sae != raw["d_sae"]:
            raise GuardFormatError(f"{source}: d_sae {raw['d_sae']} but the SAE has {sae.config.d_sae} features")
        try:
            detector = method.from_settings(raw["detector"], config.hook.hidden_size, raw["d_sae"], source=f"{source}:detector")
        except GuardFormatError:
            raise
        except ValueError as err:  # a fitted state that does not fit its config
            raise GuardFormatError(f"{source}:detector: {err}") from err
        load_module(detector, path / DETECTOR_WEIGHTS)
        guard = cls(config, detector, sae).eval()
        if config.hook.position == "response_running":
            if "running" not in raw:
                raise GuardFormatError(f"{source}: a response_running guard needs the config key 'running'")
            guard.running = config_from_dict(RunningConfig, raw["running"], source=f"{source}:running")
        elif "running" in raw:
            raise GuardFormatError(f"{source}: config key 'running' on a {config.hook.position} guard")
        if "calibration" in raw:
            calibration = config_from_dict(AffineCalibration, raw["calibration"], source=f"{source}:calibration")
            try:
                guard.set_calibration(calibration)
            except ValueError as err:
                raise GuardFormatError(f"{source}: {err}") from err
        return guard
