"""What ties a guard folder to the guard that was saved: file hashes, a settings fingerprint, a bounded tree.

Every ``config.json`` written by :meth:`hf_lsad.SafetyGuard.save_pretrained` holds an
``integrity`` block::

    "integrity": {
      "files": {"detector.safetensors": "<sha256>", "sae/sae.safetensors": "<sha256>"},
      "settings": {...},           # what the threshold was set for (see settings_record)
      "settings_sha256": "<sha256 of the settings, canonical JSON>"
    }

On load (:func:`verify_integrity`) the settings the guard would run with are rebuilt from
the config files and compared with the recorded ones, key by key, so an edited
``score_metric``, mask, SAE shape, position or threshold is a
:class:`~hf_lsad.errors.GuardMismatchError` that names the key and both values; the
recorded settings themselves are checked against their fingerprint; and each tensor file's
SHA-256 must equal the recorded one.

:func:`check_guard_tree` walks a guard folder without following links, refuses pickle
files and links that resolve outside the folder (or loop), and gives up on folders far
too large to be a guard, so a wrong path fails fast instead of walking a whole tree.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from ..errors import GuardFormatError, GuardMismatchError, UnsafeGuardFileError

INTEGRITY_KEY = "integrity"
MAX_GUARD_ENTRIES = 10_000
"""A folder with more files and folders than this is not a guard (checked while walking, so it stops early)."""
PICKLE_SUFFIXES: tuple[str, ...] = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")
"""File suffixes of formats that can run code when loaded; a guard folder must hold none."""

_SHA256 = re.compile(r"^[0-9a-f]{64}$")


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def canonical_json(data: Any) -> str:
    """The one JSON text of ``data`` that is hashed (sorted keys, no spaces, no NaN)."""
    return json.dumps(data, sort_keys=True, separators=(",", ":"), allow_nan=False)


def settings_record(config: dict[str, Any], sae_config: dict[str, Any] | None) -> dict[str, Any]:
    """The settings a guard's threshold (and calibration) were set for, from its JSON configs.

    ``config`` is the guard's ``config.json`` content, ``sae_config`` the ``sae`` object of
    ``sae/config.json`` (``None`` without an SAE). Everything that changes a score or a
    verdict is in it: the hook point (model, layer, position), method, threshold, target
    FPR and split, every detector setting (score metric, mask, k-means), the SAE's shape,
    the calibration, the prompt format (``inputs``), any supervised heads with their budget, and the heads the
    fingerprint was recorded for (its scores are in a tensor file, whose SHA-256 the record holds).
    """
    return {
        "guard": config.get("guard"),
        "detector": config.get("detector"),
        "d_sae": config.get("d_sae"),
        "sae": sae_config,
        "calibration": config.get("calibration"),
        # only guards that record their inputs (or have supervised heads) fingerprint them: older records stay valid
        **{key: config[key] for key in ("inputs", "heads", "budget", "fingerprint") if key in config},
    }


def integrity_record(folder: Path, files: Iterable[str], settings: dict[str, Any]) -> dict[str, Any]:
    """The ``integrity`` block for the saved ``files`` (relative to ``folder``) and ``settings``."""
    return {
        "files": {name: sha256_file(folder / name) for name in sorted(files)},
        "settings": settings,
        "settings_sha256": hashlib.sha256(canonical_json(settings).encode()).hexdigest(),
    }


def _differences(recorded: Any, current: Any, prefix: str = "") -> list[str]:
    if isinstance(recorded, dict) and isinstance(current, dict):
        out = []
        for key in sorted(set(recorded) | set(current), key=str):
            where = f"{prefix}.{key}" if prefix else str(key)
            if key not in current:
                out.append(f"{where} was {recorded[key]!r} when saved and is now absent")
            elif key not in recorded:
                out.append(f"{where} is {current[key]!r} now and was absent when saved")
            else:
                out.extend(_differences(recorded[key], current[key], where))
        return out
    if isinstance(recorded, list) and isinstance(current, list) and len(recorded) == len(current):
        return [d for i, (r, c) in enumerate(zip(recorded, current)) for d in _differences(r, c, f"{prefix}[{i}]")]
    numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (recorded, current))
    if (recorded != current) if numbers else (type(recorded) is not type(current) or recorded != current):
        return [f"{prefix} is {current!r} now but was {recorded!r} when the guard was saved"]
    return []


def verify_integrity(
    folder: Path, config: dict[str, Any], sae_config: dict[str, Any] | None, files: Iterable[str], *, source: str
) -> None:
    """Check the ``integrity`` block of a loaded guard's ``config.json`` (module docstring).

    ``files`` are the tensor files the guard reads (relative to ``folder``). Raises
    :class:`GuardFormatError` for a missing or malformed block and
    :class:`GuardMismatchError` for edited settings or modified files.
    """
    record = config.get(INTEGRITY_KEY)
    if record is None:
        raise GuardFormatError(
            f"{source}: no {INTEGRITY_KEY!r} record (SHA-256 of the tensor files and the settings the threshold was "
            "set for); guards saved by older hf-lsad versions lack it, so their tensors and threshold cannot be "
            "verified. If you trust these files, add the record with "
            f"hf_lsad.guard.guard.upgrade_guard_folder({str(folder)!r}), or re-save the guard with save_pretrained"
        )
    where = f"{source}:{INTEGRITY_KEY}"
    if not isinstance(record, dict):
        raise GuardFormatError(f"{where}: expected a JSON object, got {type(record).__name__}")
    expected_keys = {"files", "settings", "settings_sha256"}
    if set(record) != expected_keys:
        raise GuardFormatError(
            f"{where}: missing key(s) {sorted(expected_keys - set(record))}, unknown key(s) "
            f"{sorted(set(record) - expected_keys)}"
        )
    hashes, settings, fingerprint = record["files"], record["settings"], record["settings_sha256"]
    if not isinstance(hashes, dict) or not all(isinstance(v, str) and _SHA256.match(v) for v in hashes.values()):
        raise GuardFormatError(f"{where}.files: expected an object of file name -> SHA-256 hex digest, got {hashes!r}")
    files = sorted(files)
    if sorted(hashes) != files:
        raise GuardFormatError(f"{where}.files: records {sorted(hashes)}, but this guard reads {files}")
    if not isinstance(fingerprint, str) or not _SHA256.match(fingerprint):
        raise GuardFormatError(f"{where}.settings_sha256: expected a SHA-256 hex digest, got {fingerprint!r}")
    if not isinstance(settings, dict):
        raise GuardFormatError(f"{where}.settings: expected a JSON object, got {type(settings).__name__}")

    changed = _differences(settings, settings_record(config, sae_config))
    if changed:
        raise GuardMismatchError(
            f"{source}: the guard's settings differ from the ones its threshold was set for: {'; '.join(changed)}. "
            "A threshold is only valid for the settings it was measured with: refit the guard (or re-save a guard "
            "changed on purpose in Python with save_pretrained)"
        )
    try:
        actual = hashlib.sha256(canonical_json(settings).encode()).hexdigest()
    except ValueError as err:  # NaN in the recorded settings
        raise GuardFormatError(f"{where}.settings: {err}") from err
    if actual != fingerprint:
        raise GuardMismatchError(
            f"{where}.settings: the recorded settings were edited (their SHA-256 is {actual[:12]}..., "
            f"the record says {fingerprint[:12]}...)"
        )
    for name in files:
        actual = sha256_file(folder / name)
        if actual != hashes[name]:
            raise GuardMismatchError(
                f"{folder / name}: SHA-256 {actual[:16]}... differs from {hashes[name][:16]}... recorded in {source}; "
                "the file was modified or corrupted after the guard was saved"
            )


def bounding_folder(folder: Path) -> Path:
    """The folder a guard's files must resolve into.

    The guard folder itself, except inside a huggingface_hub cache snapshot
    (``.../models--org--name/snapshots/<sha>/...``), whose files are links into the
    repo's ``blobs/``: there it is the repo's cache folder.
    """
    parts = folder.absolute().parts
    for i in range(len(parts) - 2, 0, -1):
        if parts[i] == "snapshots" and parts[i - 1].startswith(("models--", "datasets--", "spaces--")):
            return Path(*parts[:i])
    return folder


def check_guard_tree(folder: Path, bound: Path | None = None) -> list[str]:
    """Walk ``folder`` (links not followed) and return its files, relative, as POSIX paths.

    Raises :class:`UnsafeGuardFileError` for pickle files and for links that resolve
    outside ``bound`` (default :func:`bounding_folder`) or loop, and
    :class:`GuardFormatError` when the folder has more than :data:`MAX_GUARD_ENTRIES`
    entries (it stops counting there).
    """
    folder = Path(folder)
    root = Path(os.path.realpath(bound if bound is not None else bounding_folder(folder)))
    files: list[str] = []
    seen = 0
    for current, dirs, names in os.walk(folder, followlinks=False):
        here = Path(current)
        for name in [*dirs, *names]:
            seen += 1
            if seen > MAX_GUARD_ENTRIES:
                raise GuardFormatError(
                    f"'{folder}' holds more than {MAX_GUARD_ENTRIES} files and folders: not a guard folder"
                )
            path = here / name
            if path.is_symlink():
                try:
                    target = path.resolve(strict=True)
                except (OSError, RuntimeError) as err:
                    raise UnsafeGuardFileError(f"Refusing '{folder}': link {path} is broken or loops ({err})") from err
                if target != root and root not in target.parents:
                    raise UnsafeGuardFileError(
                        f"Refusing '{folder}': {path} links to {target}, outside the guard folder {root}"
                    )
        files.extend((here / name).relative_to(folder).as_posix() for name in names)
    pickles = sorted(f for f in files if f.lower().endswith(PICKLE_SUFFIXES))
    if pickles:
        raise UnsafeGuardFileError(
            f"Refusing '{folder}': it holds pickle files, which can run arbitrary code when loaded: "
            f"{', '.join(pickles)}. hf-lsad guards are stored as safetensors and JSON only."
        )
    return files
