"""SafetyGuard: an SAE, a fitted detector and a threshold, saved as JSON + safetensors.

A guard folder (locally or in a Hub repo, optionally under a subfolder)::

    config.json            format version, library versions, hook point, method,
                           threshold and target FPR, detector settings, and for a
                           calibrated guard its per-cluster affine calibration
    detector.safetensors   the detector's tensors (centroids, masks, ...)
    sae/config.json        the SAE's shape (a folder loadable on its own)
    sae/sae.safetensors    the SAE's weights
    threshold.safetensors  the sorted held-out safe scores the threshold was set on
                           (reports' conformal p-values; absent in guards saved before them)
    README.md              model card (:mod:`hf_lsad.model_card`; always on the Hub, optional locally)

Loading is strict (see :mod:`hf_lsad.serialization`, :mod:`hf_lsad.config_validation`):
nothing but JSON and safetensors is read, every key must be known and of its type and
range, and every tensor must be there with its shape. ``config.json`` also records the
SHA-256 of each tensor file and the settings the threshold was set for, checked on load
(:mod:`hf_lsad.guard_integrity`).
"""

from __future__ import annotations

import itertools
import json
import math
import os
import tempfile
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch
from huggingface_hub import CommitInfo, ModelCard
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from .calibration import AffineCalibration
from .checks import check_activations
from .detectors import Detector, detector_class
from .explain import FeatureContribution, explain_scores
from .hook_point import HookPoint
from .hub import resolve_pretrained_dir, upload_pretrained_dir
from .model_card import DEFAULT_LICENSE, guard_model_card
from .config_validation import check_guard_header
from .guard_integrity import INTEGRITY_KEY, canonical_json, integrity_record, settings_record, verify_integrity
from .prompt_inputs import InputProfile
from .running_guard import RunningConfig
from .sae import SAE_WEIGHTS, SparseAutoencoder
from .threshold import conformal_p_values, sorted_holdout
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
THRESHOLD_SCORES = "threshold.safetensors"

DEFAULT_GUARD = Path(__file__).parent / "guards" / "smollm2-135m-instruct"
"""The bundled guard for SmolLM2-135M-Instruct; ``SafetyGuard.from_pretrained("default")`` loads it."""
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
    p_value: float | None = None
    """Conformal p-value of the score against the held-out safe scores (:func:`hf_lsad.threshold.conformal_p_values`):
    ``0.008`` reads "more unusual than 99.2% of safe prompts". ``None`` for a guard saved without them."""
    error: str | None = None
    """Why this row could not be scored (e.g. a NaN activation), ``None`` when it was.

    A row that could not be scored fails closed: ``flagged`` is ``True``, ``score`` (and a
    calibrated ``probability``) ``nan`` and ``cluster`` ``-1``."""

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
        self.holdout_scores: Tensor | None = None
        """Sorted held-out safe scores the threshold was set on (:meth:`set_holdout_scores`), for p-values."""
        self.running: RunningConfig | None = None
        """For a ``response_running`` guard: patience and how its threshold was set (:mod:`hf_lsad.running_guard`)."""
        if config.hook.position == "response_running":
            self.running = RunningConfig()
        self.inputs: InputProfile | None = None
        """How the fitting prompts were formatted and their longest length: ``generate`` warns on inputs that differ
        (:mod:`hf_lsad.prompt_inputs`). ``None`` for guards fitted from stores that did not record it."""

    def set_holdout_scores(self, holdout_scores: Tensor | None) -> None:
        """Keep the held-out safe scores (``config.n_holdout`` of them) so that reports carry p-values."""
        if holdout_scores is not None:
            holdout_scores = sorted_holdout(holdout_scores)
            if len(holdout_scores) != self.config.n_holdout:
                raise ValueError(f"{len(holdout_scores)} held-out scores, the config says n_holdout={self.config.n_holdout}")
        self.holdout_scores = holdout_scores

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
        """Score ``[batch, hidden_size]`` activations (any float dtype, any device: moved to the guard's)."""
        return self._score(activations)[0]

    @torch.no_grad()
    def _score(self, activations: Tensor) -> tuple[GuardOutput, Tensor | None]:
        """The output and, for a calibrated guard, the probabilities it flagged by (computed once)."""
        check_activations(activations, self.config.hook.hidden_size)
        scores, clusters = self.detector(self._on_guard(activations), self.sae)
        if self.calibration is None:
            return GuardOutput(scores, clusters, scores > self.config.threshold), None
        probabilities = self.calibration.probabilities(scores, clusters)
        return GuardOutput(scores, clusters, probabilities > self.calibration.threshold), probabilities

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
        threshold = self.calibration.threshold if self.calibration is not None else self.config.threshold
        failed = SafetyReport(
            score=math.nan,
            threshold=threshold,
            flagged=True,
            cluster=-1,
            probability=math.nan if self.calibration is not None else None,
            error="the activation holds NaN or inf, so the row could not be scored; flagged (fail closed)",
        )
        return [next(scored) if ok else failed for ok in finite.tolist()]

    def _reports(self, activations: Tensor, *, explain: bool, top_k: int) -> list[SafetyReport]:
        output, probabilities = self._score(activations)
        if probabilities is None:
            threshold, probabilities = self.config.threshold, [None] * len(output.scores)
        else:
            threshold, probabilities = self.calibration.threshold, probabilities.tolist()
        if self.holdout_scores is None:
            p_values = [None] * len(output.scores)
        else:
            p_values = conformal_p_values(output.scores, self.holdout_scores).tolist()
        features = self.explain(activations, top_k=top_k) if explain else [None] * len(output.scores)
        rows = zip(
            output.scores.tolist(), output.clusters.tolist(), output.flagged.tolist(), probabilities, p_values, features
        )
        return [
            SafetyReport(score=s, threshold=threshold, flagged=f, cluster=c, probability=p, p_value=v, features=e)
            for s, c, f, p, v, e in rows
        ]

    @torch.no_grad()
    def explain(self, activations: Tensor, *, top_k: int | None = 10) -> list[tuple[FeatureContribution, ...]]:
        """Per row, the SAE features behind its score, largest contribution first (``top_k=None``: all terms).

        See :func:`hf_lsad.explain.explain_scores` for what a contribution is; detectors
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
        save_module(self.detector, path / DETECTOR_WEIGHTS)
        if self.holdout_scores is not None:
            save_file({"holdout_scores": self.holdout_scores.contiguous()}, str(path / THRESHOLD_SCORES))
        if self.sae is not None:
            self.sae.save_pretrained(path / SAE_SUBFOLDER)
        config = {
            "format_version": FORMAT_VERSION,
            "versions": library_versions("hf_lsad", "torch", "faiss"),
            "guard": config_to_dict(self.config),
            "detector": self.detector.settings_dict(),
            "d_sae": self.sae.config.d_sae if self.sae is not None else None,
        }
        if self.calibration is not None:  # only calibrated guards carry the key
            config["calibration"] = config_to_dict(self.calibration)
        if self.running is not None:  # likewise only response_running guards carry their running settings
            config["running"] = config_to_dict(self.running)
        if self.inputs is not None:
            config["inputs"] = config_to_dict(self.inputs)
        # Round-trip through JSON so the record holds exactly what a loader will read back.
        config = json.loads(canonical_json(config))
        settings = settings_record(config, config_to_dict(self.sae.config) if self.sae is not None else None)
        config[INTEGRITY_KEY] = integrity_record(path, self._tensor_files(), settings)
        write_json(path / GUARD_CONFIG, config)

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
        """Load a guard from a local folder, a Hub repo, or ``"default"`` (:data:`DEFAULT_GUARD`).

        ``hub_kwargs`` (``revision``, ``subfolder``, ``token``, ``cache_dir``,
        ``local_files_only``, ``force_download``) behave as in transformers.

        Everything is checked before the guard is returned (README, "A guard on disk"):
        the folder's tree (:func:`~hf_lsad.guard_integrity.check_guard_tree`), every key's
        type and range, unknown keys at every level, every tensor's presence, shape and
        finiteness, each tensor file's SHA-256 and the settings the threshold was set for
        (:func:`~hf_lsad.guard_integrity.verify_integrity`).

        Raises:
            hf_lsad.GuardFormatError: a missing, malformed or inconsistent file or key.
            hf_lsad.GuardMismatchError: files or settings changed since the guard was saved.
            hf_lsad.UnsafeGuardFileError: pickle files, or links leaving the folder.
        """
        if str(name_or_path) == "default":
            name_or_path = DEFAULT_GUARD
        return cls._load(resolve_pretrained_dir(name_or_path, **hub_kwargs))

    @classmethod
    def _load(cls, path: Path, *, require_integrity: bool = True) -> SafetyGuard:
        """Load the guard folder ``path``; ``require_integrity=False`` only for :func:`upgrade_guard_folder`."""
        raw = read_json(path / GUARD_CONFIG)
        source = str(path / GUARD_CONFIG)
        check_guard_header(raw, source=source, format_version=FORMAT_VERSION)
        config = config_from_dict(GuardConfig, raw["guard"], source=f"{source}:guard")
        try:
            method = detector_class(config.method)
        except ValueError as err:
            raise GuardFormatError(f"{source}:guard: key 'method': {err}") from None
        if (raw["d_sae"] is not None) != method.uses_sae:
            raise GuardFormatError(
                f"{source}: key 'd_sae' is {raw['d_sae']!r}, but {config.method} "
                f"{'reads' if method.uses_sae else 'does not read'} SAE codes"
            )
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
        try:
            guard = cls(config, detector, sae).eval()
        except ValueError as err:
            raise GuardFormatError(f"{source}: {err}") from err
        if (path / THRESHOLD_SCORES).exists():
            guard.set_holdout_scores(_read_holdout_scores(path / THRESHOLD_SCORES, config.n_holdout))
        if config.hook.position == "response_running":
            if "running" not in raw:
                raise GuardFormatError(f"{source}: a response_running guard needs the config key 'running'")
            guard.running = config_from_dict(RunningConfig, raw["running"], source=f"{source}:running")
        elif "running" in raw:
            raise GuardFormatError(f"{source}: config key 'running' on a {config.hook.position} guard")
        if "inputs" in raw:
            guard.inputs = config_from_dict(InputProfile, raw["inputs"], source=f"{source}:inputs")
        if "calibration" in raw:
            calibration = config_from_dict(AffineCalibration, raw["calibration"], source=f"{source}:calibration")
            try:
                guard.set_calibration(calibration)
            except ValueError as err:
                raise GuardFormatError(f"{source}: {err}") from err
        if require_integrity:
            sae_config = config_to_dict(sae.config) if sae is not None else None
            verify_integrity(path, raw, sae_config, guard._tensor_files(), source=source)
        return guard

    def _tensor_files(self) -> list[str]:
        """The tensor files of this guard's folder, relative to it."""
        files = [DETECTOR_WEIGHTS] + ([f"{SAE_SUBFOLDER}/{SAE_WEIGHTS}"] if self.sae is not None else [])
        return files + ([THRESHOLD_SCORES] if self.holdout_scores is not None else [])


def _read_holdout_scores(file: Path, n_holdout: int) -> Tensor:
    """The sorted held-out scores of ``threshold.safetensors``, checked against the config's ``n_holdout``."""
    try:
        tensors = load_file(str(file))
    except (SafetensorError, OSError) as err:
        raise GuardFormatError(f"{file}: unreadable ({err})") from err
    if set(tensors) != {"holdout_scores"}:
        raise GuardFormatError(f"{file}: expected one tensor 'holdout_scores', found {sorted(tensors)}")
    scores = tensors["holdout_scores"]
    if scores.shape != (n_holdout,) or scores.dtype != torch.float32:
        raise GuardFormatError(f"{file}: holdout_scores is {scores.dtype} {tuple(scores.shape)}, expected float32 ({n_holdout},)")
    if not torch.isfinite(scores).all() or (scores[1:] < scores[:-1]).any():
        raise GuardFormatError(f"{file}: holdout_scores must be finite and sorted ascending")
    return scores


def upgrade_guard_folder(path: str | os.PathLike) -> None:
    """Add the ``integrity`` record to a guard saved by an older hf-lsad, in place (an explicit act of trust).

    The guard is loaded with every other check and re-saved with :meth:`SafetyGuard.save_pretrained`:
    its tensors are written again unchanged, so its scores stay identical. Only for files you
    trust: the record makes whatever they hold now the reference.
    """
    guard = SafetyGuard._load(Path(path), require_integrity=False)
    guard.save_pretrained(path)
