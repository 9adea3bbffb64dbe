"""A collection of prompt features written in parts as it goes, so that one interrupted (Ctrl-C, a lost session)
and started again collects only what no part holds: ``hf-lsad collect`` into its ``--out``, and the bundled rows
that ``add-head``, ``set-budget`` and ``teach`` keep in a ``--cache``.

Every ``checkpoint_batches`` batches, the rows collected since the last part are written as a part: a folder
``part-<n>`` holding a store per read (:mod:`hf_lsad.data.store`), its records the prompts' ids and a digest of their
text, renamed into place when complete. A run on the same folder reads the parts, each checked to be of this model,
read, system turn and adapter, and of the prompts' text as it is now, and runs only the batches that hold a prompt
no part holds, in the same batches as before, for the same activations bit for bit. The caller removes the parts
once it has written what it collected.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import shutil
import sys
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from ..core.hook_point import HookPoint, Read
from ..core.prompt_inputs import InputProfile, turn_label
from ..data.store import INDEX, ActivationSet, load_activations, save_activations
from .adapters import adapter_digest, adapter_label
from .collect import collect_prompt_features, prompt_format

PARTIAL = ".partial"
"""The folder, inside the folder collected into, that holds an interrupted collection's parts."""

CHECKPOINT_BATCHES = 32
"""Batches collected between two parts (about 500 prompts)."""


def collect_resumably(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    texts: Sequence[str],
    ids: Sequence[str],
    reads: Sequence[Read],
    parts: Path,
    *,
    remedy: str,
    batch_size: int = 16,
    max_batch_tokens: int | None = None,
    progress: bool = True,
    checkpoint_batches: int = CHECKPOINT_BATCHES,
    system: str | None = None,
    desc: str = "collect",
) -> tuple[dict[Read, Tensor], InputProfile]:
    """:func:`~hf_lsad.capture.collect.collect_prompt_features` of ``texts`` (their ``ids`` unique), with the parts
    of an earlier run in the folder ``parts`` read and this run's written there (module docstring). ``remedy``: what
    a part that cannot be used (another model, read, turn, adapter or text) tells the user to do. The parts stay
    until the caller removes them (:func:`remove_parts`), once it has written what it collected."""
    if len(set(ids)) != len(ids):
        raise ValueError("the prompts hold repeated ids")
    if checkpoint_batches < 1:
        raise ValueError(f"checkpoint_batches must be a positive integer, got {checkpoint_batches}")
    partial = PartialCollection(
        parts,
        model,
        list(reads),
        list(ids),
        [prompt_digest(text) for text in texts],
        prompt_format(tokenizer),
        system,
        adapter_digest(model),
        remedy,
    )
    done = partial.resume()
    if done and progress:
        print(f"resuming: {len(done)} of {len(ids)} prompts collected before", file=sys.stderr, flush=True)
    collected, inputs = collect_prompt_features(
        model,
        tokenizer,
        texts,
        reads,
        batch_size=batch_size,
        max_batch_tokens=max_batch_tokens,
        progress=progress,
        skip=done,
        on_batch=partial.batch_writer(checkpoint_batches),
        system=system,
        desc=desc,
    )
    if done:  # the rows an earlier run collected, in their place
        rows, part_rows = torch.tensor(list(done)), torch.tensor(list(done.values()))
        for read in reads:
            collected[read][rows] = partial.values[read][part_rows]
    ran = len(done) < len(ids)  # a prompt no part holds: its batch ran
    longest = max(partial.longest, inputs.max_prompt_tokens if ran else 0)
    return collected, dataclasses.replace(inputs, max_prompt_tokens=longest)


def remove_parts(parts: Path) -> None:
    """Remove the parts of a collection whose result is written."""
    shutil.rmtree(parts, ignore_errors=True)


def prompt_digest(text: str) -> str:
    """A digest of a prompt's text: a part or store written when the text was different is refused."""
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def read_folder(read: Read) -> str:
    """The folder of the store of ``read`` in a part or a cache: ``layer<L>-<position>``."""
    return f"layer{read[0]}-{read[1]}"


class PartialCollection:
    """The parts of a collection in the folder ``folder`` (module docstring): read by :meth:`resume`, written by the
    ``on_batch`` of :meth:`batch_writer`."""

    def __init__(
        self,
        folder: Path,
        model: PreTrainedModel,
        reads: list[Read],
        ids: list[str],
        digests: list[str],
        inputs: str,
        system: str | None,
        adapter: str | None,
        remedy: str,
    ) -> None:
        self.folder, self.model, self.reads, self.ids, self.digests = folder, model, reads, ids, digests
        self.prompt_format = inputs
        """How the prompts reach the model (``InputProfile.prompt_format``), recorded in each part."""
        self.system = system
        """The system turn before each prompt (``InputProfile.system``), recorded in each part."""
        self.adapter = adapter
        """The peft adapters the model runs (``InputProfile.adapter``), recorded in each part."""
        self.remedy = remedy
        """What a part that cannot be used tells the user to do."""
        self.values: dict[Read, Tensor] = {}
        """Per read, ``[rows, hidden]``: every row the parts hold, in part order (:meth:`resume`)."""
        self.longest = 0
        """The longest prompt of the parts, in tokens."""
        self._positions: list[int] = []
        self._features: dict[Read, list[Tensor]] = {read: [] for read in reads}
        self._batches = self._batch_longest = 0

    def resume(self) -> dict[int, int]:
        """``{position in ids: row of values}`` for every prompt a part holds, each part checked as a cache's stores
        are: of this model, of each read, of the prompts' text as it is now."""
        position = {prompt_id: i for i, prompt_id in enumerate(self.ids)}
        done: dict[int, int] = {}
        chunks: dict[Read, list[Tensor]] = {read: [] for read in self.reads}
        offset = 0
        for part in sorted(self.folder.glob("part-*")) if self.folder.is_dir() else []:
            absent = [read for read in self.reads if not (part / read_folder(read) / INDEX).is_file()]
            if absent:
                raise ValueError(
                    f"{part} holds an interrupted collection of other reads (not {absent[0]}): {self.remedy}"
                )
            stores = {
                read: checked_store(
                    self.model, part / read_folder(read), read, self.system, self.adapter, remedy=self.remedy
                )
                for read in self.reads
            }
            part_ids = [record["id"] for record in stores[self.reads[0]].records]
            for read, store in stores.items():
                if [record["id"] for record in store.records] != part_ids or store.inputs is None:
                    raise ValueError(f"{part / read_folder(read)} is not a part of this collection; delete {part}")
                chunks[read].append(store.activations)
            for row, record in enumerate(stores[self.reads[0]].records):
                i = position.get(record["id"])
                if i is None:  # a prompt of a collection of more prompts: not needed by this one
                    continue
                if record.get("digest") != self.digests[i]:
                    raise ValueError(
                        f"{part} was written when the text of prompt {record['id']!r} was different; {self.remedy}"
                    )
                done[i] = offset + row
            offset += len(part_ids)
            longest = [store.inputs.max_prompt_tokens for store in stores.values() if store.inputs is not None]
            self.longest = max(self.longest, *longest)  # every store of a part has its profile (checked above)
        self.values = {read: torch.cat(chunks[read]) for read in self.reads if chunks[read]}
        return done

    def batch_writer(self, every: int) -> Callable[[list[int], dict[Read, Tensor], int], None]:
        """The ``on_batch`` of :func:`~hf_lsad.capture.collect.collect_prompt_features`: a part every ``every``
        batches."""

        def on_batch(positions: list[int], features: dict[Read, Tensor], longest: int) -> None:
            self._positions += positions
            for read in self.reads:
                self._features[read].append(features[read])
            self._batches += 1
            self._batch_longest = max(self._batch_longest, longest)
            if self._batches == every:
                self._write()

        return on_batch

    def _write(self) -> None:
        numbers = [int(part.name.removeprefix("part-")) for part in self.folder.glob("part-*")]
        part = self.folder / f"part-{max(numbers, default=0) + 1:05d}"
        staging = self.folder / f".staging-{uuid.uuid4().hex[:8]}"
        staging.mkdir(parents=True)
        records: list[dict[str, Any]] = [{"id": self.ids[i], "digest": self.digests[i]} for i in self._positions]
        inputs = InputProfile(self.prompt_format, self._batch_longest, self.system, self.adapter)
        for read in self.reads:
            values, hook = torch.cat(self._features[read]), HookPoint.from_model(self.model, *read)
            save_activations(staging / read_folder(read), values, records, hook, inputs=inputs)
        os.replace(staging, part)  # a part is complete or absent
        self._positions, self._features = [], {read: [] for read in self.reads}
        self._batches = self._batch_longest = 0


def checked_store(
    model: PreTrainedModel, folder: Path, read: Read, system: str | None, adapter: str | None, *, remedy: str
) -> ActivationSet:
    """The store in ``folder``, checked to hold ``model``'s activations at ``read`` of prompts under the system turn
    ``system``, through the peft ``adapter`` the model runs (:func:`~hf_lsad.capture.adapters.adapter_digest`; a
    store without an input profile was collected under the template's default, without an adapter)."""
    store = load_activations(folder)
    if (store.hook.layer, store.hook.position) != tuple(read):
        raise ValueError(f"{folder} holds activations of layer {store.hook.layer} {store.hook.position}, not {read}")
    store.hook.check_model(model)
    check_turn(folder, store.inputs, system, remedy=remedy)
    stored = store.inputs.adapter if store.inputs is not None else None
    if stored != adapter:
        raise ValueError(
            f"{folder} holds prompts read through {adapter_label(stored)}, and the model runs "
            f"{adapter_label(adapter)}: {remedy}"
        )
    return store


def check_turn(folder: Path, inputs: InputProfile | None, system: str | None, *, remedy: str) -> None:
    """Refuse a store whose prompts were formatted under another system turn than ``system`` (a store without an
    input profile was collected under the template's default)."""
    stored = inputs.system if inputs is not None else None
    if stored != system:
        raise ValueError(
            f"{folder} holds prompts under the system turn {turn_label(stored)}, not {turn_label(system)}: {remedy}"
        )
