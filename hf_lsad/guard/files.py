"""A guard on disk: its folder's files, written, read back and uploaded (:class:`hf_lsad.guard.SafetyGuard`
delegates ``save_pretrained``, ``from_pretrained`` and ``push_to_hub`` here).

A guard folder (locally or in a Hub repo, optionally under a subfolder)::

    config.json            format version, library versions, hook point, method,
                           threshold and target FPR, detector settings, and for a
                           calibrated guard its per-cluster affine calibration
    detector.safetensors   the detector's tensors (centroids, masks, ...)
    sae/config.json        the SAE's shape (a folder loadable on its own)
    sae/sae.safetensors    the SAE's weights
    threshold.safetensors  the sorted held-out safe scores the threshold was set on
                           (reports' conformal p-values; absent in guards saved before them)
    heads/<name>.safetensors  each supervised head's tensors (its config is in config.json's
                           ``heads`` list, beside the ``budget`` that sets every head's threshold;
                           absent in single-head guards)
    fingerprint.safetensors  every head's scores on fixed probe prompts through the model the
                           thresholds were set through, and the prompts' token ids (config.json's
                           ``fingerprint`` names the heads; absent where none was recorded); where
                           kept, the bundled benign rows nearest the thresholds with their verdicts
                           (``boundary_*`` tensors; their counts in ``fingerprint.boundary``)
    README.md              model card (:mod:`hf_lsad.guard.card`; always on the Hub, optional locally)

Loading is strict (see :mod:`hf_lsad.core.serialization`, :mod:`hf_lsad.core.validation`):
nothing but JSON and safetensors is read, every key must be known and of its type and
range, and every tensor must be there with its shape. ``config.json`` also records the
SHA-256 of each tensor file and the settings the threshold was set for, checked on load
(:mod:`hf_lsad.core.integrity`).
"""

from __future__ import annotations

import dataclasses
import json
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import Tensor

from ..core.hub import upload_pretrained_dir
from ..core.integrity import INTEGRITY_KEY, canonical_json, integrity_record, settings_record, verify_integrity
from ..core.prompt_inputs import InputProfile
from ..core.serialization import (
    FORMAT_VERSION,
    GuardFormatError,
    check_readable,
    config_from_dict,
    config_to_dict,
    config_to_replace,
    load_module,
    read_json,
    save_module,
    staged_folder,
    write_json,
)
from ..core.validation import check_guard_header
from ..detectors.base import Detector, detector_class
from ..sae.model import SAE_CONFIG, SAE_WEIGHTS, SparseAutoencoder
from ..version import library_versions
from .calibration import AffineCalibration
from .heads import ProbeConfig, SupervisedHead, SupervisedHeadConfig
from .running import RunningConfig
from .types import BoundaryRows, BudgetConfig, GuardConfig, ModelFingerprint

if TYPE_CHECKING:
    from huggingface_hub import CommitInfo, ModelCard

GUARD_CONFIG = "config.json"
MODEL_CARD = "README.md"
DETECTOR_WEIGHTS = "detector.safetensors"
THRESHOLD_SCORES = "threshold.safetensors"
FINGERPRINT = "fingerprint.safetensors"
"""Every head's scores on the probe prompts, and the prompts' token ids (:mod:`hf_lsad.guard.fingerprint`)."""

DEFAULT_GUARD = Path(__file__).parent.parent / "guards" / "smollm2-135m-instruct"
"""The bundled two-headed guard for SmolLM2-135M-Instruct; ``SafetyGuard.from_pretrained("default")`` loads it."""
PAPER_GUARD = Path(__file__).parent.parent / "guards" / "smollm2-135m-instruct-paper"
"""The bundled paper-only guard (its anomaly head alone, with the paper's per-cluster calibration), for reproducing
the paper; ``SafetyGuard.from_pretrained("paper")`` loads it."""
BUNDLED_GUARDS = {"default": DEFAULT_GUARD, "paper": PAPER_GUARD}
"""Names that load a bundled guard."""
SAE_SUBFOLDER = "sae"
HEADS_SUBFOLDER = "heads"


class GuardParts(NamedTuple):
    """What a guard folder holds, as plain parts: :meth:`hf_lsad.guard.SafetyGuard.from_pretrained` assembles
    them into a guard, :meth:`~hf_lsad.guard.SafetyGuard.save_pretrained` writes a guard's parts."""

    config: GuardConfig
    detector: Detector
    sae: SparseAutoencoder | None
    holdout_scores: Tensor | None
    """Sorted held-out safe scores the threshold was set on (``None`` in guards saved before them)."""
    calibration: AffineCalibration | None
    running: RunningConfig | None
    inputs: InputProfile | None
    heads: tuple[SupervisedHead, ...] = ()
    """Supervised heads, in order (empty for a single-head guard)."""
    budget: BudgetConfig | None = None
    """Every head's threshold and share of the false-positive budget (``None`` without supervised heads)."""
    fingerprint: ModelFingerprint | None = None
    """Every head's scores on the probe prompts through the model the thresholds were set through (``None``: none
    recorded)."""


def save_guard_files(guard: GuardParts, path: Path) -> None:
    """Write a guard's tensor files and ``config.json`` (with its integrity record) to ``path``.

    The files are written in a folder of their own inside ``path`` first, then moved into place, ``config.json``
    last (:func:`~hf_lsad.core.serialization.staged_folder`): a save that fails while writing (a full disk, an
    interrupt) leaves the guard that was in ``path`` as it was, which matters most where ``hf-lsad add-head`` and
    ``set-budget`` save a guard over its own folder.

    Saved over another guard, the files of that guard this one does not have are removed (as transformers removes
    stale weight shards): a head it lacks, held-out scores, an SAE, and the model card, which described the other
    guard. A card stays when the guard saved is the one it describes (the same ``config.json``, whose integrity
    record holds every tensor file's SHA-256), and files hf-lsad does not write are never touched.
    """
    previous = check_guard_destination(path)
    with staged_folder(path, GUARD_CONFIG) as staging:
        config = _write_guard_files(guard, staging)
    # the same guard re-saved by a newer library keeps its card
    same_guard = previous is not None and _without_versions(previous) == _without_versions(config)
    _remove_stale_files(path, guard, same_guard=same_guard)


def _write_guard_files(guard: GuardParts, path: Path) -> dict[str, Any]:
    """Write every file of ``guard`` to the empty folder ``path``; returns the ``config.json`` written."""
    save_module(guard.detector, path / DETECTOR_WEIGHTS)
    if guard.holdout_scores is not None:
        save_file({"holdout_scores": guard.holdout_scores.contiguous()}, str(path / THRESHOLD_SCORES))
    if guard.sae is not None:
        guard.sae.save_pretrained(path / SAE_SUBFOLDER)
    config = {
        "format_version": FORMAT_VERSION,
        "versions": library_versions("hf_lsad", "torch", "faiss"),
        "guard": config_to_dict(guard.config),
        "detector": guard.detector.settings_dict(),
        "d_sae": guard.sae.config.d_sae if guard.sae is not None else None,
    }
    if guard.calibration is not None:  # only calibrated guards carry the key
        config["calibration"] = config_to_dict(guard.calibration)
    if guard.running is not None:  # likewise only response_running guards carry their running settings
        config["running"] = config_to_dict(guard.running)
    if guard.inputs is not None:
        config["inputs"] = config_to_dict(guard.inputs)
    if guard.heads:
        (path / HEADS_SUBFOLDER).mkdir(exist_ok=True)
        for head in guard.heads:
            save_module(head.probe, path / head_weights(head.name))
        config["heads"] = [config_to_dict(head.config) for head in guard.heads]
        config["budget"] = config_to_dict(guard.budget)
    if guard.fingerprint is not None:
        fingerprint = guard.fingerprint
        tensors = {"input_ids": fingerprint.input_ids, "attention_mask": fingerprint.attention_mask}
        entry: dict[str, Any] = {"heads": list(fingerprint.heads)}
        if fingerprint.boundary is not None:
            boundary = fingerprint.boundary
            tensors |= {
                "boundary_input_ids": boundary.input_ids,
                "boundary_attention_mask": boundary.attention_mask,
                "boundary_flagged": boundary.flagged,
            }
            entry["boundary"] = {
                "n_rows": boundary.n_rows,
                "flagged_rows": boundary.flagged_rows,
                "rows": boundary.rows,
            }
        save_file({**tensors, "scores": fingerprint.scores}, str(path / FINGERPRINT))
        config["fingerprint"] = entry
    # Round-trip through JSON so the record holds exactly what a loader will read back.
    config = json.loads(canonical_json(config))
    settings = settings_record(config, config_to_dict(guard.sae.config) if guard.sae is not None else None)
    config[INTEGRITY_KEY] = integrity_record(path, guard_tensor_files(guard), settings)
    write_json(path / GUARD_CONFIG, config)
    return config


GUARD_CONFIG_KEYS = {"guard", "detector"}
"""Keys every guard's ``config.json`` holds: what tells it from a model's or an SAE's."""


def check_guard_destination(path: Path, *, with_card: bool = False) -> dict[str, Any] | None:
    """The guard ``config.json`` a guard saved in ``path`` would replace (``None``: none there); raises
    :class:`FileExistsError` if it is the ``config.json`` of something else (a model, an SAE), which a guard saved
    there would overwrite, or, ``with_card`` (a save that writes the guard's model card), if ``path`` holds a
    ``README.md`` hf-lsad did not write (a project's own), which the card would overwrite."""
    card = path / MODEL_CARD
    if with_card and card.exists() and not _is_guard_card(card):
        raise FileExistsError(
            f"{card} is not a model card hf-lsad wrote: the guard's card saved there would overwrite it; save the "
            "guard to a folder of its own"
        )
    return config_to_replace(path / GUARD_CONFIG, GUARD_CONFIG_KEYS, "a guard")


def _without_versions(config: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in config.items() if key != "versions"}


def _remove_stale_files(path: Path, guard: GuardParts, *, same_guard: bool) -> None:
    """Remove what an earlier guard saved in ``path`` that ``guard`` does not have (see :func:`save_guard_files`)."""
    kept = set(guard_tensor_files(guard))
    written = [
        path / THRESHOLD_SCORES,
        path / FINGERPRINT,
        path / SAE_SUBFOLDER / SAE_WEIGHTS,
        *(path / HEADS_SUBFOLDER).glob("*.safetensors"),
    ]
    for file in written:
        if file.is_file() and file.relative_to(path).as_posix() not in kept:
            file.unlink()
    if guard.sae is None and (path / SAE_SUBFOLDER / SAE_CONFIG).is_file():
        (path / SAE_SUBFOLDER / SAE_CONFIG).unlink()
    for folder in (path / SAE_SUBFOLDER, path / HEADS_SUBFOLDER):
        if folder.is_dir() and not any(folder.iterdir()):
            folder.rmdir()
    if not same_guard and _is_guard_card(path / MODEL_CARD):
        (path / MODEL_CARD).unlink()


def _is_guard_card(file: Path) -> bool:
    """Whether ``file`` is a model card hf-lsad wrote (its metadata names the library); a README of the user's own
    is left alone."""
    import yaml
    from huggingface_hub import ModelCard

    if not file.is_file():
        return False
    try:
        return ModelCard.load(file).data.library_name == "hf-lsad"
    except (ValueError, yaml.YAMLError):  # not a card huggingface_hub can read: not one hf-lsad wrote
        return False


def load_guard_folder(path: Path) -> tuple[GuardParts, dict[str, Any]]:
    """Read and check every part of the guard folder ``path``; returns the parts and the raw ``config.json``.

    How the parts fit together is checked when they are assembled
    (:meth:`hf_lsad.guard.SafetyGuard.from_parts`), and then the folder's integrity record
    (:func:`verify_guard_folder`).
    """
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
        detector = method.from_settings(
            raw["detector"], config.hook.hidden_size, raw["d_sae"], source=f"{source}:detector"
        )
    except GuardFormatError:
        raise
    except ValueError as err:  # a fitted state that does not fit its config
        raise GuardFormatError(f"{source}:detector: {err}") from err
    load_module(detector, path / DETECTOR_WEIGHTS)
    holdout = (
        read_holdout_scores(path / THRESHOLD_SCORES, config.n_holdout) if (path / THRESHOLD_SCORES).exists() else None
    )
    running = None
    if config.hook.position == "response_running":
        if "running" not in raw:
            raise GuardFormatError(f"{source}: a response_running guard needs the config key 'running'")
        running = config_from_dict(RunningConfig, raw["running"], source=f"{source}:running")
    elif "running" in raw:
        raise GuardFormatError(f"{source}: config key 'running' on a {config.hook.position} guard")
    inputs = InputProfile.from_dict(raw["inputs"], source=f"{source}:inputs") if "inputs" in raw else None
    calibration = None
    if "calibration" in raw:
        calibration = config_from_dict(AffineCalibration, raw["calibration"], source=f"{source}:calibration")
    heads = tuple(read_head(path, head, f"{source}:heads[{i}]") for i, head in enumerate(raw.get("heads", [])))
    names = [head.name for head in heads]
    if len({name.casefold() for name in names}) != len(names):  # in any case: one weights file on macOS and Windows
        raise GuardFormatError(f"{source}: two supervised heads share a name: {names}")
    budget = None
    if heads:  # a budget written before ``confidence`` existed was set by the plain quantile rule
        written = raw["budget"] if not isinstance(raw["budget"], dict) else {"confidence": None, **raw["budget"]}
        budget = config_from_dict(BudgetConfig, written, source=f"{source}:budget")
    fingerprint = read_fingerprint(path, raw["fingerprint"], source) if "fingerprint" in raw else None
    parts = GuardParts(
        config,
        detector.eval(),
        sae.eval() if sae is not None else None,
        holdout,
        calibration,
        running,
        inputs,
        heads,
        budget,
        fingerprint,
    )
    return parts, raw


def read_fingerprint(path: Path, raw: Any, source: str) -> ModelFingerprint:
    """The fingerprint of ``fingerprint.safetensors`` under ``path``, for the heads its ``config.json`` entry ``raw``
    names (whether they are the guard's is checked when the guard is assembled)."""
    if not isinstance(raw, dict) or "heads" not in raw or not set(raw) <= {"heads", "boundary"}:
        raise GuardFormatError(
            f"{source}:fingerprint: expected an object with the key 'heads' (and 'boundary'), got {raw!r}"
        )
    heads = raw["heads"]
    if not isinstance(heads, list) or not all(isinstance(name, str) for name in heads):
        raise GuardFormatError(f"{source}:fingerprint: key 'heads' must be a list of head names, got {heads!r}")
    counts = raw.get("boundary")
    if counts is not None and not (
        isinstance(counts, dict)
        and set(counts) == {"n_rows", "flagged_rows", "rows"}
        and all(type(counts[key]) is int for key in ("n_rows", "flagged_rows"))
        and isinstance(counts["rows"], str)
    ):
        raise GuardFormatError(
            f"{source}:fingerprint: 'boundary' must be an object of the integers 'n_rows' and 'flagged_rows' and the "
            f"text 'rows', got {counts!r}"
        )
    file = path / FINGERPRINT
    check_readable(file)
    try:
        tensors = load_file(str(file))
    except (SafetensorError, OSError) as err:
        raise GuardFormatError(f"{source}: the fingerprint's {file} is missing or unreadable ({err})") from err
    expected = {"input_ids", "attention_mask", "scores"}
    if counts is not None:
        expected |= {"boundary_input_ids", "boundary_attention_mask", "boundary_flagged"}
    if set(tensors) != expected:
        raise GuardFormatError(f"{file}: expected tensors {sorted(expected)}, found {sorted(tensors)}")
    boundary = None
    if counts is not None:
        boundary = BoundaryRows(
            tensors["boundary_input_ids"],
            tensors["boundary_attention_mask"],
            tensors["boundary_flagged"],
            counts["n_rows"],
            counts["flagged_rows"],
            counts["rows"],
        )
    fingerprint = ModelFingerprint(
        tuple(heads), tensors["input_ids"], tensors["attention_mask"], tensors["scores"], boundary
    )
    try:
        fingerprint.check(heads)
    except ValueError as err:
        raise GuardFormatError(f"{file}: {err}") from err
    return fingerprint


def head_weights(name: str) -> str:
    """The tensor file of supervised head ``name``, relative to the guard folder."""
    return f"{HEADS_SUBFOLDER}/{name}.safetensors"


PROBE_DEFAULTS_BEFORE_KINDS: dict[str, Any] = {
    f.name: f.default for f in dataclasses.fields(ProbeConfig) if f.name in ("kind", "mlp_units", "mlp_alpha", "seed")
}
"""What a head's ``probe`` settings without ``kind`` (written before the MLP kind existed) mean: :class:`ProbeConfig`'s
defaults, a logistic probe (the MLP's settings are unused by it). Settings that name a kind must hold these keys."""

PROBE_DEFAULTS_BEFORE_MEMBERS: dict[str, Any] = {"mlp_members": 1}
"""What a head's ``probe`` settings without ``mlp_members`` (written before an MLP could average fits) mean: one fit."""


def read_head(path: Path, raw: dict[str, Any], source: str) -> SupervisedHead:
    """A supervised head from its ``config.json`` entry and its tensor file under ``path``."""
    probe = raw.get("probe") if isinstance(raw, dict) else None
    if isinstance(probe, dict):
        before_kinds = PROBE_DEFAULTS_BEFORE_KINDS if "kind" not in probe else {}  # written before MLP heads
        raw = {**raw, "probe": {**before_kinds, **PROBE_DEFAULTS_BEFORE_MEMBERS, **probe}}
    config = config_from_dict(SupervisedHeadConfig, raw, source=source)
    head = SupervisedHead(config)
    file = path / head_weights(config.name)
    if not file.is_file():
        raise GuardFormatError(f"{source}: head {config.name!r} has no weights: {file} is missing")
    load_module(head.probe, file)
    return head.eval()


def verify_guard_folder(path: Path, raw: dict[str, Any], parts: GuardParts) -> None:
    """Check the tensor files' SHA-256 and the settings against the integrity record of ``config.json``."""
    sae_config = config_to_dict(parts.sae.config) if parts.sae is not None else None
    verify_integrity(path, raw, sae_config, guard_tensor_files(parts), source=str(path / GUARD_CONFIG))


def guard_tensor_files(guard: GuardParts) -> list[str]:
    """The tensor files of a guard's folder, relative to it."""
    files = [DETECTOR_WEIGHTS] + ([f"{SAE_SUBFOLDER}/{SAE_WEIGHTS}"] if guard.sae is not None else [])
    files += [head_weights(head.name) for head in guard.heads]
    files += [FINGERPRINT] if guard.fingerprint is not None else []
    return files + ([THRESHOLD_SCORES] if guard.holdout_scores is not None else [])


def read_holdout_scores(file: Path, n_holdout: int) -> Tensor:
    """The sorted held-out scores of ``threshold.safetensors``, checked against the config's ``n_holdout``."""
    check_readable(file)
    try:
        tensors = load_file(str(file))
    except (SafetensorError, OSError) as err:
        raise GuardFormatError(f"{file}: unreadable ({err})") from err
    if set(tensors) != {"holdout_scores"}:
        raise GuardFormatError(f"{file}: expected one tensor 'holdout_scores', found {sorted(tensors)}")
    scores = tensors["holdout_scores"]
    if scores.shape != (n_holdout,) or scores.dtype != torch.float32:
        raise GuardFormatError(
            f"{file}: holdout_scores is {scores.dtype} {tuple(scores.shape)}, expected float32 ({n_holdout},)"
        )
    if not torch.isfinite(scores).all() or (scores[1:] < scores[:-1]).any():
        raise GuardFormatError(f"{file}: holdout_scores must be finite and sorted ascending")
    return scores


def upload_guard(guard: GuardParts, card: ModelCard, repo_id: str, **upload_kwargs: Any) -> CommitInfo:
    """Write ``guard`` and its ``card`` to a temporary folder and upload it in one commit
    (``upload_kwargs`` as in :func:`hf_lsad.core.hub.upload_pretrained_dir`)."""
    with tempfile.TemporaryDirectory(prefix="hf-lsad-push-") as tmp:
        folder = Path(tmp)
        save_guard_files(guard, folder)
        card.save(folder / MODEL_CARD)
        return upload_pretrained_dir(folder, repo_id, **upload_kwargs)
