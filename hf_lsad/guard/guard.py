"""SafetyGuard: an SAE, a fitted detector and a threshold, saved as JSON + safetensors.

Its folder on disk (the files, strict loading, the integrity record) is :mod:`hf_lsad.guard.files`;
:meth:`SafetyGuard.save_pretrained`, :meth:`SafetyGuard.from_pretrained` and
:meth:`SafetyGuard.push_to_hub` delegate there.
"""

from __future__ import annotations

import itertools
import math
import os
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from huggingface_hub import CommitInfo, ModelCard
from torch import Tensor, nn

from ..core.checks import check_activations
from ..core.hub import resolve_pretrained_dir
from ..core.prompt_inputs import InputProfile
from ..detectors import Detector
from ..errors import GuardFormatError
from ..sae.model import SparseAutoencoder
from .calibration import AffineCalibration
from .card import DEFAULT_LICENSE, guard_model_card
from .explain import explain_scores
from .files import (
    DEFAULT_GUARD,
    MODEL_CARD,
    GuardParts,
    load_guard_folder,
    save_guard_files,
    upload_guard,
    verify_guard_folder,
)
from .running import RunningConfig
from .threshold import conformal_p_values, sorted_holdout
from .types import FeatureContribution, GuardConfig, GuardOutput, SafetyReport

__all__ = ["GuardConfig", "GuardOutput", "SafetyGuard", "SafetyReport", "upgrade_guard_folder"]


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
        self.holdout_scores: Tensor | None = None
        """Sorted held-out safe scores the threshold was set on (:meth:`set_holdout_scores`), for p-values."""
        self.running: RunningConfig | None = None
        """For a ``response_running`` guard: patience and how its threshold was set (:mod:`hf_lsad.guard.running`)."""
        if config.hook.position == "response_running":
            self.running = RunningConfig()
        self.inputs: InputProfile | None = None
        """How the fitting prompts were formatted and their longest length: ``generate`` warns on inputs that differ
        (:mod:`hf_lsad.core.prompt_inputs`). ``None`` for guards fitted from stores that did not record it."""

    def set_holdout_scores(self, holdout_scores: Tensor | None) -> None:
        """Keep the held-out safe scores (``config.n_holdout`` of them) so that reports carry p-values."""
        if holdout_scores is not None:
            holdout_scores = sorted_holdout(holdout_scores)
            if len(holdout_scores) != self.config.n_holdout:
                raise ValueError(
                    f"{len(holdout_scores)} held-out scores, the config says n_holdout={self.config.n_holdout}"
                )
        self.holdout_scores = holdout_scores

    def set_calibration(self, calibration: AffineCalibration | None) -> None:
        """Calibrate the guard (``None`` removes it).

        A calibrated guard reports ``sigmoid(a_c s + b_c)`` and flags rows above ``calibration.threshold``.
        """
        if calibration is not None:
            if self.running is not None:
                raise ValueError("a response_running guard scores every token; per-cluster calibration is per prompt")
            n_clusters = self.detector.n_clusters
            if calibration.n_clusters != n_clusters:
                raise ValueError(
                    f"calibration has {calibration.n_clusters} clusters, the {self.config.method} detector {n_clusters}"
                )
        self.calibration = calibration

    @property
    def threshold(self) -> float:
        """The threshold that decides: a calibrated guard flags a probability above ``calibration.threshold``,
        any other guard a score above ``config.threshold``. The one place this is decided."""
        return self.calibration.threshold if self.calibration is not None else self.config.threshold

    @torch.no_grad()
    def forward(self, activations: Tensor) -> GuardOutput:
        """Score ``[batch, hidden_size]`` activations (any float dtype, any device: moved to the guard's)."""
        return self._score(activations)[0]

    @torch.no_grad()
    def _score(self, activations: Tensor) -> tuple[GuardOutput, Tensor | None]:
        """The output and, for a calibrated guard, the probabilities it flagged by (computed once)."""
        check_activations(activations, self.config.hook.hidden_size)
        scores, clusters = self.detector(self._on_guard(activations), self.sae)
        probabilities = self.calibration.probabilities(scores, clusters) if self.calibration is not None else None
        decided_by = scores if probabilities is None else probabilities
        return GuardOutput(scores, clusters, decided_by > self.threshold), probabilities

    def reports(self, activations: Tensor, *, explain: bool = False, top_k: int = 10) -> list[SafetyReport]:
        """One :class:`SafetyReport` per row of ``activations``.

        ``explain=True`` fills :attr:`SafetyReport.features` with the ``top_k`` SAE features
        that contribute most to each score (:meth:`explain`).

        Fails closed: a row holding NaN or inf gets a report with ``flagged=True`` and an
        ``error`` saying so (and a ``RuntimeWarning``); the other rows are scored as usual.
        Shape and width errors still raise.
        """
        finite = torch.isfinite(activations).all(1) if activations.ndim == 2 else None
        if finite is None or bool(finite.all()) or activations.shape[1] != self.config.hook.hidden_size:
            return self._reports(activations, explain=explain, top_k=top_k)
        bad = (~finite).nonzero().flatten().tolist()
        warnings.warn(
            f"guard activations of rows {bad} hold NaN or inf: those rows are reported as flagged (fail closed)",
            RuntimeWarning,
            stacklevel=2,
        )
        scored = iter(self._reports(activations[finite], explain=explain, top_k=top_k) if finite.any() else [])
        failed = SafetyReport(
            score=math.nan,
            threshold=self.threshold,
            flagged=True,
            cluster=-1,
            probability=math.nan if self.calibration is not None else None,
            error="the activation holds NaN or inf, so the row could not be scored; flagged (fail closed)",
        )
        return [next(scored) if ok else failed for ok in finite.tolist()]

    def _reports(self, activations: Tensor, *, explain: bool, top_k: int) -> list[SafetyReport]:
        output, probabilities = self._score(activations)
        probabilities = [None] * len(output.scores) if probabilities is None else probabilities.tolist()
        if self.holdout_scores is None:
            p_values = [None] * len(output.scores)
        else:
            p_values = conformal_p_values(output.scores, self.holdout_scores).tolist()
        features = self.explain(activations, top_k=top_k) if explain else [None] * len(output.scores)
        rows = zip(
            output.scores.tolist(), output.clusters.tolist(), output.flagged.tolist(), probabilities, p_values, features
        )
        return [
            SafetyReport(score=s, threshold=self.threshold, flagged=f, cluster=c, probability=p, p_value=v, features=e)
            for s, c, f, p, v, e in rows
        ]

    @torch.no_grad()
    def explain(self, activations: Tensor, *, top_k: int | None = 10) -> list[tuple[FeatureContribution, ...]]:
        """Per row, the SAE features behind its score, largest contribution first (``top_k=None``: all terms).

        See :func:`hf_lsad.guard.explain.explain_scores` for what a contribution is; detectors
        that do not score SAE features (e.g. ``mahalanobis`` on raw activations) raise
        ``NotImplementedError``.
        """
        check_activations(activations, self.config.hook.hidden_size)
        return explain_scores(self.detector, self.sae, self._on_guard(activations), top_k=top_k)

    def _on_guard(self, activations: Tensor) -> Tensor:
        """``activations`` as float32 on the guard's device: a model split over devices (``device_map="auto"``)
        records block L wherever that block lives, not where the guard is."""
        tensor = next(itertools.chain(self.buffers(), self.parameters()), None)
        return activations.to(tensor.device if tensor is not None else activations.device, torch.float32)

    def save_pretrained(
        self,
        save_directory: str | os.PathLike,
        *,
        metrics: Mapping[str, Mapping[str, float]] | None = None,
        data: str | None = None,
        datasets: str | list[str] | None = None,
        license: str = DEFAULT_LICENSE,
    ) -> None:
        """Write the guard folder described in :mod:`hf_lsad.guard.files`.

        With ``metrics`` or ``data`` given, also write a ``README.md`` model card
        (:func:`hf_lsad.guard.card.guard_model_card`): ``metrics`` maps each unsafe category to
        its measured ``{"auroc": ..., "tpr_at_5fpr": ...}`` (as ``hf-lsad evaluate`` prints),
        ``data`` describes the prompts the guard was fitted on, ``datasets`` and ``license``
        go to the card metadata.
        """
        path = Path(save_directory)
        save_guard_files(self.parts(), path)
        if metrics is not None or data is not None:
            self.model_card(metrics=metrics, data=data, datasets=datasets, license=license).save(path / MODEL_CARD)

    def model_card(self, **kwargs: Any) -> ModelCard:
        """This guard's :class:`huggingface_hub.ModelCard`; ``kwargs`` as in
        :func:`hf_lsad.guard.card.guard_model_card`."""
        return guard_model_card(self.parts(), **kwargs)

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
        return upload_guard(
            self.parts(),
            card,
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
        """Load a guard from a local folder, a Hub repo, or ``"default"`` (:data:`DEFAULT_GUARD`).

        ``hub_kwargs`` (``revision``, ``subfolder``, ``token``, ``cache_dir``,
        ``local_files_only``, ``force_download``) behave as in transformers.

        Everything is checked before the guard is returned (docs/guard-format.md):
        the folder's tree (:func:`~hf_lsad.core.integrity.check_guard_tree`), every key's
        type and range, unknown keys at every level, every tensor's presence, shape and
        finiteness, each tensor file's SHA-256 and the settings the threshold was set for
        (:func:`~hf_lsad.core.integrity.verify_integrity`).

        Raises:
            hf_lsad.GuardFormatError: a missing, malformed or inconsistent file or key.
            hf_lsad.GuardMismatchError: files or settings changed since the guard was saved.
            hf_lsad.UnsafeGuardFileError: pickle files, or links leaving the folder.
        """
        if str(name_or_path) == "default":
            name_or_path = DEFAULT_GUARD
        path = resolve_pretrained_dir(name_or_path, **hub_kwargs)
        parts, raw = load_guard_folder(path)
        guard = cls.from_parts(parts, source=str(path))
        verify_guard_folder(path, raw, parts)
        return guard

    @classmethod
    def from_parts(cls, parts: GuardParts, *, source: str = "guard") -> SafetyGuard:
        """Assemble a guard from the parts of its folder (:func:`hf_lsad.guard.files.load_guard_folder`); parts
        that do not fit together (a detector of another method, a calibration of another cluster count) are a
        :class:`~hf_lsad.errors.GuardFormatError` naming ``source``."""
        try:
            guard = cls(parts.config, parts.detector, parts.sae).eval()
            guard.set_holdout_scores(parts.holdout_scores)
            guard.running = parts.running
            guard.inputs = parts.inputs
            guard.set_calibration(parts.calibration)
        except ValueError as err:
            raise GuardFormatError(f"{source}: {err}") from err
        return guard

    def parts(self) -> GuardParts:
        """The guard as the plain parts its folder holds (what :meth:`save_pretrained` writes)."""
        return GuardParts(
            self.config, self.detector, self.sae, self.holdout_scores, self.calibration, self.running, self.inputs
        )


def upgrade_guard_folder(path: str | os.PathLike) -> None:
    """Add the ``integrity`` record to a guard saved by an older hf-lsad, in place (an explicit act of trust).

    The guard is loaded with every other check and re-saved with :meth:`SafetyGuard.save_pretrained`:
    its tensors are written again unchanged, so its scores stay identical. Only for files you
    trust: the record makes whatever they hold now the reference.
    """
    guard = SafetyGuard.from_parts(load_guard_folder(Path(path))[0], source=str(path))
    guard.save_pretrained(path)
