"""Strict reading and writing of configs (JSON) and tensors (safetensors).

Every artefact hf-lsad writes is a dataclass config in JSON next to tensors in
safetensors. Loading is strict on purpose: a missing or unknown config key, a
missing or mis-shaped tensor, or a corrupt file is an error that names the
file, never a silent default (``PyTorchModelHubMixin`` loads with
``strict=False``; we do not).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import stat
import tempfile
import time
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TypeVar

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from ..errors import GuardFormatError
from .locking import abandoned, marked_in_use
from .validation import check_fields

__all__ = [
    "FORMAT_VERSION",
    "GuardFormatError",
    "check_readable",
    "config_from_dict",
    "config_to_dict",
    "folder_path",
    "load_module",
    "new_file_modes",
    "read_json",
    "save_module",
    "staged_folder",
    "write_json",
]

FORMAT_VERSION = 1
"""Version of the on-disk layout; bumped when a file or key changes meaning."""

C = TypeVar("C")


def folder_path(value: str | os.PathLike[str], argument: str) -> Path:
    """``value``, the folder a save writes or a load reads, as a ``Path``. A name that is empty or blank is refused
    (``ValueError``): as a path ``""`` is the current folder, which a save would fill and a load would read without a
    word, and it is what an unset variable gives (``f"{out_dir}"``); ``"."`` names the current folder."""
    if not isinstance(value, (str, os.PathLike)):
        raise TypeError(f"{argument} must be a path (a str or os.PathLike), not {type(value).__name__}")
    name = os.fspath(value)
    if not isinstance(name, str):
        raise TypeError(f"{argument} must be a path as text, not {type(name).__name__}")
    if not name.strip():
        raise ValueError(f"{argument} is empty ({name!r}): name a folder ('.' for the current one)")
    return Path(name)


def config_to_dict(config: Any) -> dict[str, Any]:
    """A dataclass config as a JSON-ready dict (nested dataclasses included)."""
    return dataclasses.asdict(config)


def config_from_dict(cls: type[C], data: dict[str, Any], *, source: str) -> C:
    """Build dataclass ``cls`` from ``data``, requiring exactly its fields.

    Nested dataclass fields are built recursively; every value is checked
    against its annotated type and range (:mod:`hf_lsad.core.validation`).
    ``source`` names the file in error messages.
    """
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"config_from_dict builds dataclasses, not {cls!r}")
    if not isinstance(data, dict):
        raise GuardFormatError(f"{source}: expected a JSON object for {cls.__name__}, got {type(data).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    missing = sorted(set(fields) - set(data))
    unknown = sorted(set(data) - set(fields))
    if missing:
        raise GuardFormatError(f"{source}: missing config key(s) {missing} for {cls.__name__}")
    if unknown:
        raise GuardFormatError(f"{source}: unknown config key(s) {unknown} for {cls.__name__}")
    kwargs = {}
    for name, value in data.items():
        nested = _dataclass_type(cls, name)
        kwargs[name] = config_from_dict(nested, value, source=f"{source}:{name}") if nested else value
    kwargs = check_fields(cls, kwargs, source=source)
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as err:
        raise GuardFormatError(f"{source}: invalid {cls.__name__}: {err}") from err


def _dataclass_type(cls: type, name: str) -> type | None:
    hint = typing.get_type_hints(cls).get(name)
    return hint if isinstance(hint, type) and dataclasses.is_dataclass(hint) else None


def write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object from ``path``; :class:`GuardFormatError` for a missing, unreadable or non-object file."""
    _require_regular_file(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise GuardFormatError(f"{path} is not valid JSON: {err}") from err
    if not isinstance(data, dict):
        raise GuardFormatError(f"{path}: expected a JSON object at the top level, got a JSON {type(data).__name__}")
    return data


def config_to_replace(file: Path, keys: set[str], what: str) -> dict[str, Any] | None:
    """The JSON object in ``file``, the config of the ``what`` (``"a guard"``) a save is about to replace (it holds
    ``keys``), or ``None`` when there is no file or it is not a JSON object (a save cut off mid-write: replaced).

    Raises:
        FileExistsError: ``file`` is the config of something else (a model's, a guard's, an SAE's), which saving
            ``what`` there would overwrite.
    """
    try:
        config = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict):
        return None
    if not keys <= set(config):
        raise FileExistsError(
            f"{file} is not the config of {what}: saving {what} in {file.parent} would overwrite it; save it to a "
            "folder of its own"
        )
    return config


def _require_regular_file(path: Path) -> None:
    if not path.exists() and not path.is_symlink():
        raise GuardFormatError(f"missing file {path}")
    if not path.is_file():
        raise GuardFormatError(f"{path} is not a regular file (a folder, device, or broken link)")
    check_readable(path)


def check_readable(path: Path) -> None:
    """Raise :class:`PermissionError` naming ``path``'s mode and owner when this process may not read it. Without
    this, safetensors reports such a file as "No such file or directory". A missing or corrupt file is left to the
    caller's own error."""
    try:
        with path.open("rb"):
            pass
    except PermissionError as err:
        info = path.stat()
        raise PermissionError(
            f"{path} cannot be read by this user (mode {stat.filemode(info.st_mode)}, owner uid {info.st_uid}): ask "
            f"its owner to make it readable (chmod a+r), or save it again under a umask that lets others read"
        ) from err
    except OSError:
        pass


def new_file_modes(folder: Path) -> None:
    """Give every file under ``folder`` the mode a new file gets there (the umask, a default ACL). safetensors
    writes its files private (0600), so a guard saved to a shared folder, or a model converted into a shared cache,
    could not be read by another user (a server's account, a colleague) while its JSON beside it could."""
    probe = folder / f".mode-{os.getpid()}"
    descriptor = os.open(probe, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666)
    try:
        mode = stat.S_IMODE(os.fstat(descriptor).st_mode)
    finally:
        os.close(descriptor)
        probe.unlink()
    for file in folder.rglob("*"):
        if file.is_file() and not file.is_symlink():
            os.chmod(file, mode)


STAGING_PREFIX = ".hf-lsad-saving-"
"""The name a save's own folder starts with, inside the folder it saves to (:func:`staged_folder`); pushes leave
such folders out."""

ABANDONED_AFTER = 60.0
"""Seconds after its last change that a staging folder no save holds is taken for a killed save's and removed. A
save holds its folder from a moment after it is made; the wait keeps that moment's folder."""


@contextlib.contextmanager
def staged_folder(path: Path, last: str) -> Iterator[Path]:
    """A folder of its own inside ``path`` to write a saved guard's, SAE's or activation store's files in. Leaving
    without an error moves each file to its place in ``path``, ``last`` (the ``config.json`` or ``index.json`` that
    describes the others) last; the folder is removed either way. A save that fails while writing (a full disk, an
    interrupt) leaves what ``path`` held as it was, which matters where one is saved over its own folder; only the
    moves, not the writing, can leave a mixture, and until ``last`` is moved the files are described by the earlier
    ``last``. A save killed outright (``SIGKILL``, power lost) leaves its folder; the next save into ``path`` removes
    it (:func:`remove_abandoned_staging`)."""
    if path.exists() and not path.is_dir():
        raise FileExistsError(f"{path} is a file, not a folder: what is saved there is a folder of files")
    path.mkdir(parents=True, exist_ok=True)
    remove_abandoned_staging(path)
    # a removal by another save, after this one lets its folder go, is not an error
    with tempfile.TemporaryDirectory(prefix=STAGING_PREFIX, dir=path, ignore_cleanup_errors=True) as name:
        staging = Path(name)
        with marked_in_use(staging):
            yield staging
            new_file_modes(staging)
            described = staging / last
            for file in sorted(staging.rglob("*")):
                if file.is_file() and file != described:
                    target = path / file.relative_to(staging)
                    target.parent.mkdir(exist_ok=True)
                    file.replace(target)
            described.replace(path / last)


def remove_abandoned_staging(path: Path, prefix: str = STAGING_PREFIX) -> list[Path]:
    """Remove the staging folders in ``path`` (named ``prefix...``) that killed saves left (:func:`staged_folder`, a
    GGUF conversion): those no save holds (:func:`~hf_lsad.core.locking.marked_in_use`), unchanged for
    :data:`ABANDONED_AFTER` seconds. Where locks do not work (Windows, some network mounts) none can be told
    abandoned and all are kept. Returns the folders removed."""
    removed = []
    for folder in path.glob(f"{prefix}*"):
        try:
            if not folder.is_dir() or time.time() - folder.stat().st_mtime < ABANDONED_AFTER or not abandoned(folder):
                continue
        except FileNotFoundError:  # removed meanwhile, by its own save or another's
            continue
        shutil.rmtree(folder, ignore_errors=True)
        removed.append(folder)
    return removed


def save_module(module: nn.Module, path: Path) -> None:
    """Save a module's parameters and buffers as contiguous safetensors."""
    tensors = {k: v.detach().contiguous().cpu() for k, v in module.state_dict().items()}
    save_file(tensors, str(path))


def load_module(module: nn.Module, path: Path) -> None:
    """Load ``path`` into ``module`` strictly: same keys, same shapes."""
    _require_regular_file(path)
    try:
        tensors = load_file(str(path))
    except (SafetensorError, OSError) as err:
        raise GuardFormatError(f"{path} is not a readable safetensors file ({err})") from err
    expected = module.state_dict()
    missing = sorted(set(expected) - set(tensors))
    unknown = sorted(set(tensors) - set(expected))
    if missing or unknown:
        raise GuardFormatError(f"{path}: missing tensors {missing}, unexpected tensors {unknown}")
    for name, tensor in tensors.items():
        if tensor.shape != expected[name].shape:
            raise GuardFormatError(
                f"{path}: tensor {name!r} has shape {tuple(tensor.shape)}, config expects {tuple(expected[name].shape)}"
            )
        if not torch.isfinite(tensor.float()).all():
            raise GuardFormatError(f"{path}: tensor {name!r} holds NaN or inf")
    module.load_state_dict(tensors, strict=True)
