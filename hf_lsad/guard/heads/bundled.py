"""The bundled pools' rows a head is fitted or thresholded on (the release's split), and their activations, kept in
a cache (:func:`bundled_features`): ``hf-lsad add-head``, ``teach`` and ``set-budget`` read the same rows through the
model every time, so a ``--cache`` folder keeps them, checked against the model, the read, the prompts' text, the
system turn and the adapter, and an interrupted collection resumes where it stopped.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import torch
from torch import Tensor
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from ...capture.adapters import adapter_digest
from ...capture.collect import collect_prompt_features
from ...capture.resumable import (
    CHECKPOINT_BATCHES,
    PARTIAL,
    check_turn,
    checked_store,
    collect_resumably,
    prompt_digest,
    read_folder,
    remove_parts,
)
from ...core.batching import BATCH_TOKENS
from ...core.hook_point import HookPoint, Read
from ...core.locking import held_alone
from ...core.serialization import folder_path
from ...core.splits import split_of
from ...data import Prompt, is_reserved, load_pool
from ...data.store import INDEX, ActivationStore, save_activations


def release_rows(pool: str, split: Literal["fit", "validation", "test"]) -> list[Prompt]:
    """The bundled ``pool``'s rows in ``split`` of the release's split (:func:`~hf_lsad.core.splits.split_of`, seed
    0), the README's reserved prompts left out: what a head added to a bundled guard may fit or set thresholds on.
    The split is the one the bundled heads were fitted on, whatever seed draws a sample of these rows, so their
    validation and test rows stay out of every fit and no threshold is set on a row a head was fitted on."""
    return [p for p in load_pool(pool) if split_of(p.id) == split and not is_reserved(p.text)]


def drawn_fit_rows(pool: str, rows_per_pool: int | None, seed: int) -> list[Prompt]:
    """The bundled ``pool``'s fit rows that :func:`~hf_lsad.guard.heads.training.teach_traffic` fits a head on again: a
    seeded draw of ``rows_per_pool`` of them (``None``: all of them, as released)."""
    return sample_rows(release_rows(pool, "fit"), rows_per_pool, seed)


def sample_rows(items: list[Any], limit: int | None, seed: int) -> list[Any]:
    """A seeded draw of ``limit`` of ``items`` in their order (``None``, or as many as there are: all of them): the
    draw of bundled rows a head is fitted or thresholded on, and a check reads."""
    if limit is None or limit >= len(items):
        return items
    picked = torch.randperm(len(items), generator=torch.Generator().manual_seed(seed))[:limit].sort().values
    return [items[i] for i in picked.tolist()]


CHAT_CACHE = "validation-chat"
"""The sub-folder of a :func:`bundled_features` cache that keeps the rows
:func:`~hf_lsad.guard.heads.bundled_checks.bundled_chat_flag_rates` reads, a folder per draw
(``<rows>-rows-seed-<seed>``), so that a check of another size reads or writes its own (the fit rows' stores sit at the
cache's top)."""

HARM_CACHE = "validation-harm"
"""The sub-folder of a :func:`bundled_features` cache that keeps the rows
:func:`~hf_lsad.guard.heads.bundled_checks.bundled_harm_catch_rates` reads, a folder per draw
(``<rows>-per-group-seed-<seed>``)."""

DOMAIN_CACHE = "validation-domains"
"""The sub-folder of a :func:`bundled_features` cache that keeps the rows
:func:`~hf_lsad.guard.heads.bundled_checks.bundled_domain_flag_rates` reads, a folder per draw
(``<rows>-per-domain-seed-<seed>``)."""

KEPT_CACHE = "validation-kept"
"""The sub-folder of a :func:`bundled_features` cache that keeps the rows of each pool
:func:`~hf_lsad.guard.heads.budget.fit_budget_on_prompts` keeps within the budget (``keep_bundled``), a folder per
pool."""

CACHE_REMEDY = "pass another cache folder (one per model, system turn and adapter), or delete this one"
"""What a cache's store or part that cannot be used tells the user to do."""

CHECK_CACHES = (CHAT_CACHE, DOMAIN_CACHE, HARM_CACHE, KEPT_CACHE)
"""The sub-folders of a :func:`bundled_features` cache that keep bundled validation rows: the checks' draws and the
kept pools."""


def bundled_features(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: Sequence[Any],
    reads: Sequence[Read],
    *,
    cache_dir: str | os.PathLike | None = None,
    batch_size: int = 16,
    max_batch_tokens: int | None = BATCH_TOKENS,
    progress: bool = True,
    checkpoint_batches: int = CHECKPOINT_BATCHES,
    system: str | None = None,
    desc: str = "collect",
) -> dict[Read, Tensor]:
    """``[n_prompts, hidden]`` activations of bundled pool ``prompts`` (:class:`~hf_lsad.data.Prompt`) at each read,
    kept in ``cache_dir`` when given.

    The cache holds one activation store per read (``layer<L>-<position>/``, :mod:`hf_lsad.data.store`), its records
    the prompts' ids and a digest of their text. A read whose store is there is read from it: any prompts it holds,
    in any order, so a cache written for every bundled pool serves a fit on fewer. A read whose store is not there is
    collected and written. A store of another model or read, one that lacks some of the prompts, or one written when
    a prompt's text was different or under another system turn, is refused (``ValueError``) rather than collected
    again over it. ``system``: the system turn before each prompt (``None``: the template's default). ``batch_size``
    and ``max_batch_tokens`` batch the forward pass as :func:`~hf_lsad.capture.collect.collect_prompt_features` does
    (another batching than the cache's moves the features by float round-off alone).

    Nothing collected into a cache is lost to an interruption: every ``checkpoint_batches`` batches are written to
    ``<cache_dir>/.partial/`` (a part per checkpoint, a store per read in it, checked as the cache's are), and a run
    on the same cache collects only the prompts no part holds, in the same batches, for the same activations bit for
    bit. The parts are removed once the stores are written (by the next run on the cache, if one stopped between the
    two). Another run collecting into the same cache meanwhile is refused (:func:`~hf_lsad.core.locking.held_alone`):
    each would collect what the other had not yet written, and one's clean-up would remove the other's parts.
    ``desc``: the progress bar's label.
    """
    ids = [p.id for p in prompts]
    if len(set(ids)) != len(ids):
        raise ValueError("the bundled prompts hold repeated ids")
    if checkpoint_batches < 1:
        raise ValueError(f"checkpoint_batches must be a positive integer, got {checkpoint_batches}")
    digests = [prompt_digest(p.text) for p in prompts]
    cache = None if cache_dir is None else folder_path(cache_dir, "cache_dir")
    with contextlib.nullcontext() if cache is None else held_cache(cache):
        if cache is not None:
            _drop_finished_parts(cache)
        folders = {read: None if cache is None else cache / read_folder(read) for read in reads}
        adapter = adapter_digest(model)  # what every store read or written here is checked against and records
        features = {
            read: _cached_read(model, folder, read, ids, digests, system, adapter)
            for read, folder in folders.items()
            if folder is not None and (folder / INDEX).exists()
        }
        missing = [read for read in reads if read not in features]
        if not missing:
            return features
        texts = [p.text for p in prompts]
        if cache is None:
            collected, inputs = collect_prompt_features(
                model,
                tokenizer,
                texts,
                missing,
                batch_size=batch_size,
                max_batch_tokens=max_batch_tokens,
                progress=progress,
                system=system,
                desc=desc,
            )
        else:
            collected, inputs = collect_resumably(
                model,
                tokenizer,
                texts,
                ids,
                missing,
                cache / PARTIAL,
                remedy=CACHE_REMEDY,
                batch_size=batch_size,
                max_batch_tokens=max_batch_tokens,
                progress=progress,
                checkpoint_batches=checkpoint_batches,
                system=system,
                desc=desc,
            )
        records = [cache_record(p) for p in prompts]
        for read in missing:
            folder = folders[read]
            if folder is not None:
                save_activations(folder, collected[read], records, HookPoint.from_model(model, *read), inputs=inputs)
            features[read] = collected[read]
        if cache is not None:
            remove_parts(cache / PARTIAL)
        return features


def held_cache(cache: Path) -> contextlib.AbstractContextManager[None]:
    """``cache`` (created if missing) held by this run until the block ends, or refused (``ValueError``) while another
    run holds it (:func:`~hf_lsad.core.locking.held_alone`). A command holds its whole ``--cache`` for its run; each
    collection holds the folder it collects into, again where that is the one the command holds."""
    cache.mkdir(parents=True, exist_ok=True)
    return held_alone(cache, cache_in_use(cache))


def cache_in_use(cache: Path) -> str:
    """What a run on ``cache`` is told while another run collects into it."""
    return (
        f"{cache} is in use by another run that collects into it: wait for it to end (then its activations are read "
        "from there), or pass another cache folder"
    )


def _drop_finished_parts(cache: Path) -> None:
    """Remove a cache's parts when the stores of every read they hold are in the cache: a run stopped after writing
    its stores and before removing its parts left them, and they would refuse a later collection of other reads."""
    folder = cache / PARTIAL
    parts = sorted(folder.glob("part-*")) if folder.is_dir() else []
    stores = [store.name for part in parts for store in part.iterdir() if (store / INDEX).is_file()]
    if parts and all((cache / name / INDEX).is_file() for name in stores):
        shutil.rmtree(folder)


def cache_record(prompt: Prompt) -> dict[str, str]:
    """The record a :func:`bundled_features` cache keeps of a bundled prompt: its id, a digest of its text (a store
    written when the text was different is refused), its source and category. A cache written otherwise, say from the
    stores ``hf-lsad collect`` wrote, is read when its records are these."""
    return {"id": prompt.id, "digest": prompt_digest(prompt.text), "source": prompt.source, "category": prompt.category}


def _cached_read(
    model: PreTrainedModel,
    folder: Path,
    read: Read,
    ids: list[str],
    digests: list[str],
    system: str | None,
    adapter: str | None,
) -> Tensor:
    """The rows of ``ids`` from the cache store in ``folder``, checked to be ``model``'s activations at ``read`` of
    prompts with these text ``digests`` under the system turn ``system``, through the peft ``adapter``."""
    store = checked_store(model, folder, read, system, adapter, remedy=CACHE_REMEDY)
    row_of = {record["id"]: row for row, record in enumerate(store.records)}
    absent = [i for i in ids if i not in row_of]
    if absent:
        raise ValueError(
            f"{folder} lacks {len(absent)} of the {len(ids)} bundled prompts to fit on (e.g. {absent[0]!r}); "
            "it was written for other pools or rows: pass another cache folder, or delete this one"
        )
    changed = [i for i, digest in zip(ids, digests) if store.records[row_of[i]].get("digest") != digest]
    if changed:
        raise ValueError(
            f"{folder} was written when the text of {len(changed)} bundled prompts was different "
            f"(e.g. {changed[0]!r}); pass another cache folder, or delete this one"
        )
    return store.activations[torch.tensor([row_of[i] for i in ids])]


def check_cache_turn(cache_dir: str | os.PathLike, system: str | None) -> None:
    """Refuse (``ValueError``) a :func:`bundled_features` cache whose stores, or whose interrupted collection's
    parts, hold the bundled prompts under another system turn than ``system``, from their indexes alone: the CLI
    checks a ``--cache`` so before it loads a model. The stores are checked in full as they are read."""
    cache = folder_path(cache_dir, "cache_dir")
    # the fit rows' stores at the top, each check's draw in a folder of its own; each with an interrupted part
    folders = [cache, *(folder for check in CHECK_CACHES for folder in sorted(cache.glob(f"{check}/*")))]
    indexes = [
        index
        for folder in folders
        for pattern in (f"layer*/{INDEX}", f"{PARTIAL}/part-*/layer*/{INDEX}")
        for index in sorted(folder.glob(pattern))
    ]
    for index in indexes:
        check_turn(index.parent, ActivationStore(index.parent).inputs, system, remedy=CACHE_REMEDY)
