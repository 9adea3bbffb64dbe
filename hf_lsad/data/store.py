"""Activation store: safetensors shards of activations plus a JSON index of rows.

A store folder::

    index.json                   hook point, row records (id, source, category, ...), shard list
    shard-00000.safetensors      {"activations": [rows, hidden_size]}
    ...

:func:`load_activations` reads a store whole; :class:`ActivationStore` reads rows
of it in batches (for fits that stream, see :func:`hf_lsad.guard.fitting.fit_guard`).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple, Protocol

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file
from torch import Tensor

from ..core.checks import check_activations
from ..core.hook_point import HookPoint
from ..core.prompt_inputs import InputProfile
from ..core.serialization import (
    FORMAT_VERSION,
    GuardFormatError,
    check_readable,
    config_from_dict,
    config_to_dict,
    config_to_replace,
    folder_path,
    read_json,
    staged_folder,
    write_json,
)
from ..core.validation import check_format_version, require_keys

INDEX = "index.json"
SHARD_NAME = re.compile(r"shard-\d{5,}\.safetensors")
"""The file name of a shard: in the store folder itself, numbered from 0."""


@dataclass(frozen=True)
class ShardEntry:
    """One shard of a store, as ``index.json`` lists it."""

    file: str
    """Its file name in the store folder (``shard-00000.safetensors``, ...); never a path elsewhere."""
    rows: int
    """Its row count."""

    def __post_init__(self) -> None:
        if not SHARD_NAME.fullmatch(self.file):
            raise ValueError(f"shard file {self.file!r} is not a shard-NNNNN.safetensors name in the store folder")
        if self.rows < 1:
            raise ValueError(f"shard rows {self.rows}, expected at least 1")


class ActivationSet(NamedTuple):
    """A store read into memory: the rows, their records and where they were read."""

    activations: Tensor
    """``[n, hidden_size]`` float32."""
    records: list[dict[str, Any]]
    """One JSON record per row (prompt id, source, category, response, ...)."""
    hook: HookPoint
    """Where the activations were read."""
    inputs: InputProfile | None = None
    """How the prompts were formatted and the longest one (``None`` in stores that did not record it)."""


INDEX_KEYS = {"format_version", "hook", "shards", "records"}
"""The keys of a store's ``index.json``."""


def check_store_destination(path: Path) -> None:
    """Raise :class:`FileExistsError` if ``path`` holds an ``index.json`` that is not a store's (a web project's,
    another tool's), which a store saved there would overwrite."""
    config_to_replace(path / INDEX, INDEX_KEYS, "an activation store")


def save_activations(
    directory: str | os.PathLike,
    activations: Tensor,
    records: list[dict[str, Any]],
    hook: HookPoint,
    *,
    shard_size: int = 50_000,
    dtype: torch.dtype = torch.float32,
    inputs: InputProfile | None = None,
) -> None:
    """Write ``activations`` (stored as ``dtype``) and their ``records`` as a store folder.

    ``inputs`` records how the prompts were given to the model; a guard fitted on the store
    keeps it, to warn about inputs unlike them (:mod:`hf_lsad.core.prompt_inputs`). Written over
    another store, the shards of it that this one does not have are removed once the index is written. The files
    are written in a folder of their own and moved into place, the index last
    (:func:`~hf_lsad.core.serialization.staged_folder`): a save that fails (a full disk, an interrupt) leaves the
    store that was there, never its index beside this one's activations. An ``index.json`` that is not a store's
    is not overwritten (:func:`check_store_destination`): the save is refused before anything is written.
    """
    check_activations(activations, hook.hidden_size)
    if len(records) != len(activations):
        raise ValueError(f"{len(records)} records for {len(activations)} activation rows")
    if not all(isinstance(record, dict) for record in records):
        raise TypeError("each record must be a dict (a JSON object)")
    path = folder_path(directory, "directory")
    check_store_destination(path)
    with staged_folder(path, last=INDEX) as staging:  # a failed save leaves the store that was there
        shards = []
        for number, start in enumerate(range(0, len(activations), shard_size)):
            name = f"shard-{number:05d}.safetensors"
            rows = activations[start : start + shard_size].to(dtype).contiguous().cpu()
            save_file({"activations": rows}, str(staging / name))
            shards.append(ShardEntry(name, min(shard_size, len(activations) - start)))
        index = {
            "format_version": FORMAT_VERSION,
            "hook": config_to_dict(hook),
            "shards": [config_to_dict(shard) for shard in shards],
            "records": records,
        }
        if inputs is not None:
            index["inputs"] = config_to_dict(inputs)
        write_json(staging / INDEX, index)
    written = {shard.file for shard in shards}
    for file in path.iterdir():  # an earlier store's shards beyond this one's (never a file of another name)
        if SHARD_NAME.fullmatch(file.name) and file.name not in written:
            file.unlink()


def load_activations(directory: str | os.PathLike) -> ActivationSet:
    """Read a store folder written by :func:`save_activations` (activations as float32)."""
    path = folder_path(directory, "directory")
    index = _read_index(path)
    hook = index.hook
    parts = []
    for shard in index.shards:
        check_readable(path / shard.file)
        try:
            tensor = load_file(str(path / shard.file))["activations"]
        except (SafetensorError, OSError, KeyError) as err:
            raise GuardFormatError(f"{path / shard.file}: unreadable activation shard ({err})") from err
        if tensor.shape != (shard.rows, hook.hidden_size):
            raise GuardFormatError(
                f"{path / shard.file}: shape {tuple(tensor.shape)}, index expects {(shard.rows, hook.hidden_size)}"
            )
        parts.append(tensor.float())
    activations = torch.cat(parts)
    if len(activations) != len(index.records):
        raise GuardFormatError(f"{path}: {len(activations)} rows but {len(index.records)} records")
    check_activations(activations, hook.hidden_size)
    return ActivationSet(activations, index.records, hook, index.inputs)


class StoreIndex(NamedTuple):
    """A store's ``index.json``, checked."""

    hook: HookPoint
    shards: list[ShardEntry]
    records: list[dict[str, Any]]
    inputs: InputProfile | None


def _read_index(path: Path) -> StoreIndex:
    """The ``index.json`` of a store folder, read as strictly as a guard's ``config.json``: exactly its keys, each
    of its type, shards named as :func:`save_activations` names them."""
    index = read_json(path / INDEX)
    source = str(path / INDEX)
    require_keys(index, {"format_version", "hook", "shards", "records"}, {"inputs"}, source=source)
    check_format_version(index["format_version"], FORMAT_VERSION, source=source)
    hook = config_from_dict(HookPoint, index["hook"], source=source)
    if not isinstance(index["shards"], list) or not index["shards"]:
        raise GuardFormatError(f"{source}: key 'shards' must be a non-empty list of shards")
    shards = [config_from_dict(ShardEntry, s, source=f"{source}:shards[{i}]") for i, s in enumerate(index["shards"])]
    records = index["records"]
    if not isinstance(records, list) or not all(isinstance(record, dict) for record in records):
        raise GuardFormatError(f"{source}: key 'records' must be a list of JSON objects, one per row")
    inputs = index.get("inputs")
    inputs = None if inputs is None else InputProfile.from_dict(inputs, source=f"{source}:inputs")
    return StoreIndex(hook, shards, records, inputs)


DEFAULT_BATCH_SIZE = 4096
"""Rows read (and encoded) at a time by a fit."""


class RowSource(Protocol):
    """Activation rows that a fit reads in batches: :class:`TensorRows` or :class:`ActivationStore`."""

    @property
    def width(self) -> int:
        """Row width (the hidden size)."""

    def __len__(self) -> int:
        """Number of rows."""

    def take(self, rows: Tensor) -> Tensor:
        """The rows at ascending indices ``rows`` as a float32 ``[len(rows), width]`` tensor."""


class TensorRows:
    """A :class:`RowSource` over an in-memory ``[n, width]`` tensor; rows are checked as they are read."""

    def __init__(self, activations: Tensor) -> None:
        if activations.ndim != 2 or len(activations) == 0:
            raise ValueError(f"activations must be a non-empty [n, hidden_size] tensor, got {tuple(activations.shape)}")
        self.activations = activations

    @property
    def width(self) -> int:
        return self.activations.shape[1]

    def __len__(self) -> int:
        return len(self.activations)

    def take(self, rows: Tensor) -> Tensor:
        batch = self.activations[rows.to(self.activations.device)].float()
        check_activations(batch, self.width)
        return batch


class ActivationStore:
    """A store folder opened for reading rows in batches, never loading it whole.

    Each :meth:`take` opens the shards it needs, copies the contiguous span of
    rows it asks for and closes them again, so the memory a read holds is that
    span, whatever the size of the store. Rows are checked (finite, right width)
    as they are read.
    """

    def __init__(self, directory: str | os.PathLike) -> None:
        self.path = folder_path(directory, "directory")
        index = _read_index(self.path)
        self.hook, self.inputs = index.hook, index.inputs
        self.records: list[dict[str, Any]] = index.records
        """One JSON record per row."""
        self.shards: list[str] = [shard.file for shard in index.shards]
        starts = [0]
        for shard in index.shards:
            check_readable(self.path / shard.file)  # once here, not at each take()
            with _open_shard(self.path / shard.file) as handle:
                shape = tuple(handle.get_slice("activations").get_shape())
            if shape != (shard.rows, self.hook.hidden_size):
                raise GuardFormatError(
                    f"{self.path / shard.file}: shape {shape}, index expects {(shard.rows, self.hook.hidden_size)}"
                )
            starts.append(starts[-1] + shard.rows)
        self.shard_starts = torch.tensor(starts)
        """Row offset of each shard, and the total row count last."""
        if starts[-1] != len(self.records):
            raise GuardFormatError(f"{self.path}: {starts[-1]} rows but {len(self.records)} records")

    @property
    def width(self) -> int:
        """Row width: the hidden size of the layer the store read."""
        return self.hook.hidden_size

    def __len__(self) -> int:
        return int(self.shard_starts[-1])

    def take(self, rows: Tensor) -> Tensor:
        """The rows at ascending indices ``rows`` as a float32 ``[len(rows), width]`` tensor, read from the shards
        that hold them and checked (``IndexError`` for indices out of range or out of order)."""
        rows = rows.cpu()
        if len(rows) and (rows[0] < 0 or rows[-1] >= len(self) or (rows[1:] < rows[:-1]).any()):
            raise IndexError(f"rows must be ascending indices in [0, {len(self)})")
        shard_of = torch.searchsorted(self.shard_starts, rows, right=True) - 1
        parts = []
        for shard in shard_of.unique().tolist():
            local = rows[shard_of == shard] - self.shard_starts[shard]
            low, high = int(local[0]), int(local[-1]) + 1
            with _open_shard(self.path / self.shards[shard]) as handle:
                span = handle.get_slice("activations")[low:high]
            parts.append(span[local - low].float())
        batch = torch.cat(parts) if parts else torch.empty(0, self.width)
        check_activations(batch, self.width, name=f"activations read from {self.path}")
        return batch


def _open_shard(file: Path) -> Any:
    try:
        return safe_open(str(file), framework="pt")
    except (SafetensorError, OSError) as err:
        raise GuardFormatError(f"{file}: unreadable activation shard ({err})") from err


def row_batches(source: RowSource, rows: Tensor, batch_size: int) -> Iterator[Tensor]:
    """``source.take`` of consecutive chunks of ``batch_size`` indices of ``rows`` (ascending)."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    for start in range(0, len(rows), batch_size):
        yield source.take(rows[start : start + batch_size])
