"""Activation store: safetensors shards of activations plus a JSON index of rows.

A store folder::

    index.json                   hook point, row records (id, source, category, ...), shard list
    shard-00000.safetensors      {"activations": [rows, hidden_size]}
    ...
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, NamedTuple

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import Tensor

from .capture import HookPoint
from .serialization import FORMAT_VERSION, GuardFormatError, config_from_dict, config_to_dict, read_json, write_json
from .validation import check_activations

INDEX = "index.json"


class ActivationSet(NamedTuple):
    activations: Tensor
    """``[n, hidden_size]`` float32."""
    records: list[dict[str, Any]]
    """One JSON record per row (prompt id, source, category, response, ...)."""
    hook: HookPoint
    """Where the activations were read."""


def save_activations(
    directory: str | os.PathLike,
    activations: Tensor,
    records: list[dict[str, Any]],
    hook: HookPoint,
    *,
    shard_size: int = 50_000,
    dtype: torch.dtype = torch.float32,
) -> None:
    """Write ``activations`` (stored as ``dtype``) and their ``records`` as a store folder."""
    check_activations(activations, hook.hidden_size)
    if len(records) != len(activations):
        raise ValueError(f"{len(records)} records for {len(activations)} activation rows")
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    shards = []
    for number, start in enumerate(range(0, len(activations), shard_size)):
        name = f"shard-{number:05d}.safetensors"
        save_file({"activations": activations[start : start + shard_size].to(dtype).contiguous().cpu()}, str(path / name))
        shards.append({"file": name, "rows": min(shard_size, len(activations) - start)})
    write_json(
        path / INDEX,
        {"format_version": FORMAT_VERSION, "hook": config_to_dict(hook), "shards": shards, "records": records},
    )


def load_activations(directory: str | os.PathLike) -> ActivationSet:
    """Read a store folder written by :func:`save_activations` (activations as float32)."""
    path = Path(directory)
    index = read_json(path / INDEX)
    for key in ("format_version", "hook", "shards", "records"):
        if key not in index:
            raise GuardFormatError(f"{path / INDEX}: missing key {key!r}")
    if index["format_version"] != FORMAT_VERSION:
        raise GuardFormatError(f"{path / INDEX}: format_version {index['format_version']!r}, expected {FORMAT_VERSION}")
    hook = config_from_dict(HookPoint, index["hook"], source=str(path / INDEX))
    parts = []
    for shard in index["shards"]:
        try:
            tensor = load_file(str(path / shard["file"]))["activations"]
        except (SafetensorError, OSError, KeyError) as err:
            raise GuardFormatError(f"{path / shard['file']}: unreadable activation shard ({err})") from err
        if tensor.shape != (shard["rows"], hook.hidden_size):
            raise GuardFormatError(f"{path / shard['file']}: shape {tuple(tensor.shape)}, index expects {(shard['rows'], hook.hidden_size)}")
        parts.append(tensor.float())
    activations = torch.cat(parts)
    if len(activations) != len(index["records"]):
        raise GuardFormatError(f"{path}: {len(activations)} rows but {len(index['records'])} records")
    check_activations(activations, hook.hidden_size)
    return ActivationSet(activations, index["records"], hook)
