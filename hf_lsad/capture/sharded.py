"""Activation collection over several processes (``accelerate launch`` / ``torchrun``), merged into one store.

    accelerate launch --num_processes 4 -m hf_lsad.cli collect --pool safe --layer 20 --out acts/safe
    accelerate launch --multi_gpu --num_processes 2 -m hf_lsad.cli collect --device cpu ...   # CPU processes

Each process (an accelerate ``PartialState``) takes a contiguous shard of the prompt list
(``split_between_processes``: process ``i`` gets the ``i``-th block, so the blocks in rank order
are the prompt list), collects it on its own device and writes it as a store of its own under
``<out>/.parts/rank-<i>``. Once every process is done, process 0 concatenates the parts in rank
order into ``<out>`` and deletes them. So the store is row for row the one a single process
writes (each prompt's activation does not depend on the rest of its batch: left padding,
see :mod:`hf_lsad.capture`).

Why files rather than a collective ``gather``: a part is written in the store's own format
(safetensors + JSON, no pickle; ``gather_object`` pickles), shards of unequal size need no
padding, and no process ever holds more than its own activations until process 0 merges.
The processes must therefore share a file system (one machine, or a shared folder on several).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from ..core.hook_point import HookPoint
from ..core.prompt_inputs import InputProfile
from ..data.store import load_activations, save_activations

if TYPE_CHECKING:
    from accelerate import PartialState

PARTS = ".parts"
"""Folder under the output store that holds each process's part while collection runs."""


class Shard(NamedTuple):
    """The prompts one process collects."""

    rank: int
    """The process's index, from 0."""
    n_processes: int
    """Number of processes."""
    rows: list[int]
    """Positions, in the full prompt list, of the prompts this process collects (contiguous, ascending)."""


def process_state(device: str) -> PartialState:
    """The accelerate process state; CPU processes (``--device cpu``, or no GPU) communicate over gloo."""
    from accelerate import PartialState

    cpu = device == "cpu" or (device == "auto" and not torch.cuda.is_available())
    return PartialState(cpu=cpu)


def shard_of(state: PartialState, n_prompts: int) -> Shard:
    """This process's contiguous block of ``range(n_prompts)`` (``split_between_processes``)."""
    with state.split_between_processes(list(range(n_prompts))) as rows:
        return Shard(state.process_index, state.num_processes, list(rows))


def write_part(
    out: str | os.PathLike,
    shard: Shard,
    activations: torch.Tensor,
    records: list[dict[str, Any]],
    hook: HookPoint,
    *,
    inputs: InputProfile | None = None,
) -> None:
    """Write this process's rows (and how its prompts were given): the store itself for one process, else its part
    under ``<out>/.parts``."""
    if shard.n_processes == 1:
        save_activations(out, activations, records, hook, inputs=inputs)
    elif shard.rows:  # a process left without prompts (fewer prompts than processes) writes nothing
        save_activations(_part(out, shard.rank), activations, records, hook, inputs=inputs)


def merge_parts(out: str | os.PathLike, count: int, n_prompts: int) -> None:
    """Concatenate the parts of ``count`` processes in rank order into the store ``out``, then delete them."""
    parts = [load_activations(_part(out, rank)) for rank in range(count) if _part(out, rank).is_dir()]
    records = [record for part in parts for record in part.records]
    if len(records) != n_prompts:
        raise RuntimeError(
            f"the {count} processes wrote {len(records)} rows for {n_prompts} prompts under {Path(out) / PARTS}"
        )
    hooks = {repr(part.hook) for part in parts}
    if len(hooks) != 1:
        raise RuntimeError(f"the processes recorded different hook points: {sorted(hooks)}")
    save_activations(
        out,
        torch.cat([part.activations for part in parts]),
        records,
        parts[0].hook,
        inputs=_merged_inputs([part.inputs for part in parts]),
    )
    shutil.rmtree(Path(out) / PARTS)


def finish(state: PartialState, out: str | os.PathLike, shard: Shard, n_prompts: int) -> None:
    """Wait for every process, merge on process 0 (:func:`merge_parts`), and wait for the merge."""
    if shard.n_processes == 1:
        return
    state.wait_for_everyone()
    if state.is_main_process:
        merge_parts(out, shard.n_processes, n_prompts)
    state.wait_for_everyone()


def _merged_inputs(profiles: list[InputProfile | None]) -> InputProfile | None:
    """The input profile of the whole store: the parts' format, system turn and adapter (they must agree) and their
    longest prompt."""
    known = [profile for profile in profiles if profile is not None]
    if len(known) < len(profiles):
        return None
    formats = {(profile.prompt_format, profile.system, profile.adapter) for profile in known}
    if len(formats) != 1:
        seen = sorted(formats, key=str)
        raise RuntimeError(f"the processes read their prompts differently (format, system turn, adapter): {seen}")
    prompt_format, system, adapter = formats.pop()
    return InputProfile(prompt_format, max(profile.max_prompt_tokens for profile in known), system, adapter)


def _part(out: str | os.PathLike, rank: int) -> Path:
    return Path(out) / PARTS / f"rank-{rank:05d}"


def select(items: Sequence[Any], shard: Shard) -> list[Any]:
    """The items of ``items`` at this shard's rows."""
    return [items[i] for i in shard.rows]
