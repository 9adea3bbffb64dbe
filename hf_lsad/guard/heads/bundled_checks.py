"""What a changed guard does to the bundled traffic it was not changed for: the share of the bundled validation chat
(:func:`bundled_chat_flag_rates`), of the other benign domains (:func:`bundled_domain_flag_rates`) and of each unsafe
source (:func:`bundled_harm_catch_rates`) a guard flags, read once for the guard and the guard it came from, and the
warnings ``hf-lsad set-budget`` and ``teach`` print when a rate moved far (:func:`chat_shift_warning`,
:func:`domain_shift_warning`, :func:`harm_drop_warning`). A guard whose thresholds were set on one kind of traffic
holds its budget on that traffic alone; these say what it costs elsewhere.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from ...core.batching import BATCH_TOKENS
from ...core.serialization import folder_path
from ...data import GUARD_POOLS, Prompt, is_unsafe_pool
from ...data.pools import (
    CHAT_CHECK_ROWS,
    CHECK_DOMAINS,
    DOMAIN_CHECK_ROWS,
    EVAL_SOURCES,
    HARM_CHECK_POOLS,
    HARM_CHECK_ROWS,
)
from .budget import check_reads_prompt
from .bundled import CHAT_CACHE, DOMAIN_CACHE, HARM_CACHE, bundled_features, release_rows, sample_rows


def bundled_chat_flag_rates(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    guards: Sequence[Any],
    *,
    rows: int | None = CHAT_CHECK_ROWS,
    seed: int = 0,
    cache_dir: str | os.PathLike | None = None,
    batch_size: int = 16,
    max_batch_tokens: int | None = BATCH_TOKENS,
    progress: bool = True,
    system: str | None = None,
) -> list[float]:
    """The share of the bundled validation chat that each of ``guards`` flags, the rows read once through ``model``.

    Those rows set the released guards' thresholds and no head was fitted on them. A guard taught one kind of traffic
    (:func:`~hf_lsad.guard.heads.training.teach_traffic`), or whose thresholds were set on it
    (:func:`~hf_lsad.guard.heads.budget.fit_budget_on_prompts`), holds its budget on that traffic alone; this says what
    that does to ordinary chat, beside the guard it came from (``heads/security_traffic``: a security team's questions
    taught alone left bundled chat flagged at 14.9%, against 7.0% as released).

    Args:
        model, tokenizer: The guards' base model and its tokenizer.
        guards: Guards whose heads all read the prompt; every read of any of them is collected once.
        rows: A seeded draw of this many of the 1,338 rows (``None``: all of them).
        seed: The seed of the draw.
        cache_dir: A :func:`bundled_features` cache: these rows are kept in its :data:`CHAT_CACHE` sub-folder, a
            folder per draw.
        batch_size, max_batch_tokens, progress, system: As :func:`bundled_features`.
    """
    _check_rows(rows, "rows")
    prompts = sample_rows(release_rows("chat", "validation"), rows, seed)
    folder = _cache_folder(cache_dir, CHAT_CACHE, f"{len(prompts)}-rows-seed-{seed}")
    rates = _group_flag_rates(
        model,
        tokenizer,
        guards,
        {"chat": prompts},
        folder,
        desc="chat check",
        batch_size=batch_size,
        max_batch_tokens=max_batch_tokens,
        progress=progress,
        system=system,
    )
    return [shares["chat"] for shares in rates]


def bundled_harm_catch_rates(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    guards: Sequence[Any],
    *,
    rows_per_source: int | None = HARM_CHECK_ROWS,
    seed: int = 0,
    cache_dir: str | os.PathLike | None = None,
    batch_size: int = 16,
    max_batch_tokens: int | None = BATCH_TOKENS,
    progress: bool = True,
    system: str | None = None,
) -> list[dict[str, float]]:
    """The share of each bundled unsafe source of :data:`~hf_lsad.data.pools.EVAL_SOURCES` (the sources the evaluation
    holds out one at a time) and of each other unsafe pool the guard is taught (prompt injections, harmful look-alikes,
    slur-eliciting text: :data:`~hf_lsad.data.pools.HARM_CHECK_POOLS`, a pool one group) that each of ``guards``
    catches on its validation rows, the rows read once through ``model``.

    No head of a bundled guard was fitted on those rows. Thresholds set on traffic that looks more like harm than chat
    does rise, and the harm they let through is not in the user's sample: on 366 bug-report titles, which the released
    guard flags at 47%, :func:`~hf_lsad.guard.heads.budget.fit_budget_on_prompts` left do-not-answer's validation rows
    caught at 36% (95% as released). This says what a change did to the harm the guard was taught, beside the guard it
    came from.

    Args:
        model, tokenizer: The guards' base model and its tokenizer.
        guards: Guards whose heads all read the prompt; every read of any of them is collected once.
        rows_per_source: A seeded draw of this many validation rows of each source and pool (``None``: all 1,037).
        seed: The seed of the draws.
        cache_dir: A :func:`bundled_features` cache: these rows are kept in its :data:`HARM_CACHE` sub-folder, a
            folder per draw.
        batch_size, max_batch_tokens, progress, system: As :func:`bundled_features`.

    Returns:
        Per guard, ``{source or pool: share caught}``, the sources in the order of ``EVAL_SOURCES``, then the pools.
    """
    _check_rows(rows_per_source, "rows_per_source")
    by_pool = {pool: release_rows(pool, "validation") for pool in GUARD_POOLS if is_unsafe_pool(pool)}
    groups = {source: [p for rows in by_pool.values() for p in rows if p.source == source] for source in EVAL_SOURCES}
    groups |= {pool: by_pool[pool] for pool in HARM_CHECK_POOLS}
    drawn = {group: sample_rows(rows, rows_per_source, seed) for group, rows in groups.items()}
    draw = "all" if rows_per_source is None else str(rows_per_source)
    folder = _cache_folder(cache_dir, HARM_CACHE, f"{draw}-per-group-seed-{seed}")
    return _group_flag_rates(
        model,
        tokenizer,
        guards,
        drawn,
        folder,
        desc="harm check",
        batch_size=batch_size,
        max_batch_tokens=max_batch_tokens,
        progress=progress,
        system=system,
    )


def bundled_domain_flag_rates(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    guards: Sequence[Any],
    *,
    rows_per_domain: int | None = DOMAIN_CHECK_ROWS,
    seed: int = 0,
    cache_dir: str | os.PathLike | None = None,
    batch_size: int = 16,
    max_batch_tokens: int | None = BATCH_TOKENS,
    progress: bool = True,
    system: str | None = None,
) -> list[dict[str, float]]:
    """The share of each bundled benign domain beside chat (:data:`~hf_lsad.data.pools.CHECK_DOMAINS`: task prompts,
    benign out-of-domain text, benign look-alikes, everyday questions, plain statements) that each of ``guards`` flags
    on its validation rows, the rows read once through ``model``.

    No head of a bundled guard was fitted on those rows. A guard taught one kind of traffic, or whose thresholds were
    set on it, holds its budget on that traffic alone, and :func:`bundled_chat_flag_rates` says what that does to
    chat only: a security team's questions taught (``hf-lsad teach``) left chat at 11.6% of its validation rows
    (4.1% as released) and plain statements at 33.3% (2.5%), task prompts at 8.4% (1.9%), the look-alikes at 41.4%
    (21.8%). This says it of every other kind of benign traffic the pools hold, beside the guard it came from.

    Args:
        model, tokenizer: The guards' base model and its tokenizer.
        guards: Guards whose heads all read the prompt; every read of any of them is collected once.
        rows_per_domain: A seeded draw of this many validation rows of each domain (``None``: all 2,850).
        seed: The seed of the draws.
        cache_dir: A :func:`bundled_features` cache: these rows are kept in its :data:`DOMAIN_CACHE` sub-folder, a
            folder per draw.
        batch_size, max_batch_tokens, progress, system: As :func:`bundled_features`.

    Returns:
        Per guard, ``{pool: share flagged}`` in the order of ``CHECK_DOMAINS``.
    """
    _check_rows(rows_per_domain, "rows_per_domain")
    by_pool = {pool: sample_rows(release_rows(pool, "validation"), rows_per_domain, seed) for pool in CHECK_DOMAINS}
    draw = "all" if rows_per_domain is None else str(rows_per_domain)
    folder = _cache_folder(cache_dir, DOMAIN_CACHE, f"{draw}-per-domain-seed-{seed}")
    return _group_flag_rates(
        model,
        tokenizer,
        guards,
        by_pool,
        folder,
        desc="domain check",
        batch_size=batch_size,
        max_batch_tokens=max_batch_tokens,
        progress=progress,
        system=system,
    )


def _cache_folder(cache_dir: str | os.PathLike | None, kind: str, draw: str) -> Path | None:
    """The folder under ``cache_dir`` that keeps one check's draw of rows, or ``None`` without a cache."""
    return None if cache_dir is None else folder_path(cache_dir, "cache_dir") / kind / draw


def _check_rows(rows: int | None, name: str) -> None:
    if rows is not None and (isinstance(rows, bool) or not isinstance(rows, int) or rows < 1):
        raise ValueError(f"{name} must be a positive number of rows or None, got {rows!r}")


def _group_flag_rates(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    guards: Sequence[Any],
    groups: dict[str, list[Prompt]],
    cache: Path | None,
    *,
    batch_size: int,
    max_batch_tokens: int | None,
    progress: bool,
    system: str | None,
    desc: str,
) -> list[dict[str, float]]:
    """Per guard, the share of each group of bundled prompts it flags, ``{group: share}`` in the order of ``groups``:
    every group read in one collection (into ``cache``), every read of any guard collected once; ``desc`` labels the
    progress bar."""
    for guard in guards:
        check_reads_prompt(guard)
    prompts = [p for rows in groups.values() for p in rows]
    reads = sorted({read for guard in guards for read in guard.reads})
    features = bundled_features(
        model,
        tokenizer,
        prompts,
        reads,
        cache_dir=cache,
        batch_size=batch_size,
        max_batch_tokens=max_batch_tokens,
        progress=progress,
        system=system,
        desc=desc,
    )
    rates = []
    for guard in guards:
        with torch.no_grad():
            flags = guard({read: features[read] for read in guard.reads}).flagged  # [rows], the groups in order
        shares, start = {}, 0
        for group, rows in groups.items():
            shares[group] = float(flags[start : start + len(rows)].double().mean())
            start += len(rows)
        rates.append(shares)
    return rates


BENIGN_SHIFT = 1.5
"""How many times both the share of a kind of benign traffic the guard it came from flags and the budget's target a
changed guard must flag for :func:`chat_shift_warning` and :func:`domain_shift_warning` to speak. A security team's
questions taught alone moved a 500-row draw of the bundled validation chat from 4.6% to 9.4% (``hf-lsad teach --seed 1``
on ``heads/security_traffic``'s sample; 14.9% of the test chat): twice would have said nothing. At 5% a 500-row draw
flags 7.5% or more about once in a hundred; both guards are read on the same rows, so a guard that did not move is not
warned of on any draw."""


def _shifted(before: float, after: float, target: float) -> bool:
    """Whether a kind of benign traffic flagged at ``before`` now flagged at ``after`` moved far enough to warn of."""
    return after > BENIGN_SHIFT * max(before, target)


def chat_shift_warning(before: float, after: float, target: float) -> str:
    """What to tell a user whose changed guard (taught, or thresholds set on their traffic) flags ``after`` of the
    bundled chat where the guard it came from flagged ``before``, for a budget of ``target`` (``""`` unless ``after``
    is above :data:`BENIGN_SHIFT` times both)."""
    if not _shifted(before, after, target):
        return ""
    return (
        f"the new guard flags {after:.1%} of the bundled validation chat ({before:.1%} before): its thresholds are "
        "set for the traffic you brought; if the deployment also serves ordinary chat, keep the bundled chat within "
        "the budget too (--keep-bundled chat; keep_bundled=['chat'] in Python) or bring a sample that holds both "
        "(docs/heads.md, 'Your own traffic')"
    )


def risen_domains(before: dict[str, float], after: dict[str, float], target: float) -> list[str]:
    """The pools of :func:`domain_shift_warning`'s warning: each flagged at ``after`` above :data:`BENIGN_SHIFT` times
    both its share ``before`` and the ``target``, in the order of ``after``."""
    return [pool for pool in after if _shifted(before[pool], after[pool], target)]


def domain_shift_warning(before: dict[str, float], after: dict[str, float], target: float) -> str:
    """What to tell a user whose changed guard flags ``after`` of each bundled benign domain beside chat where the
    guard it came from flagged ``before`` (:func:`bundled_domain_flag_rates`), for a budget of ``target`` (``""``
    unless a domain is above :data:`BENIGN_SHIFT` times both its share before and the target)."""
    risen = risen_domains(before, after, target)
    if not risen:
        return ""
    listed = ", ".join(f"{CHECK_DOMAINS[pool]} {before[pool]:.0%} to {after[pool]:.0%}" for pool in risen)
    return f"the new guard flags far more of other kinds of benign traffic ({listed})"


HARM_DROP = 0.2
"""How far a source's share caught may fall from the guard a guard came from before :func:`harm_drop_warning` speaks:
six of the default draw's 30 rows. On all 781 rows, where the released guard catches 0.95-1.00 of each source,
thresholds set on 150 web-agent tasks moved none by more than 0.04 and on 141 shell tasks one by 0.15
(do-not-answer); on 366 bug-report titles do-not-answer fell by 0.59."""


def harm_drop_warning(before: dict[str, float], after: dict[str, float]) -> str:
    """What to tell a user whose changed guard catches ``after`` of each bundled unsafe source where the guard it came
    from caught ``before`` (``""`` unless a source fell by more than :data:`HARM_DROP`)."""
    fallen = [source for source in after if before[source] - after[source] > HARM_DROP]
    if not fallen:
        return ""
    listed = ", ".join(f"{source} {before[source]:.0%} to {after[source]:.0%}" for source in fallen)
    return f"the new guard lets through more of the bundled harm ({listed})"
