"""Fitting supervised heads: from activations (:func:`fit_head`) or from a user's prompts (:func:`add_head`); and
setting every head's threshold on a user's own benign prompts (:func:`fit_budget_on_prompts`).

:func:`add_head` is what ``hf-lsad add-head`` runs: a head for a user's own category ("medical dosage advice", a
company's confidential project names) from about a hundred examples of it, against the user's safe examples (if any)
and the fit rows of the bundled benign pools; then every head's threshold is set again, together, on validation
chat rows, the new head taking its share of the one false-positive budget.

:func:`fit_budget_on_prompts` is what ``hf-lsad set-budget`` runs: the thresholds set on a sample of the user's own
benign traffic instead of the bundled chat, for traffic the heads flag more often than chat (a benign domain they
were not fitted on).

:func:`teach_traffic` is what ``hf-lsad teach`` runs: a supervised head fitted again on the bundled pools' fit rows
with part of the user's benign sample beside them, and every threshold set on the rest of the sample. Thresholds
alone move up to where the user's traffic sits, and pass the harm that looks like it; a head taught the traffic
moves its scores instead (measured: ``benchmarks/experiments/heads/own_traffic_fit.json``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import os
import shutil
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Literal, TypeVar

import torch
from torch import Tensor
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from ...capture.adapters import adapter_digest, adapter_label
from ...capture.collect import check_prompts, collect_prompt_features, prompt_format
from ...core.batching import BATCH_TOKENS
from ...core.hook_point import HookPoint
from ...core.prompt_inputs import InputProfile, check_system_turn, turn_label
from ...core.splits import seeded_parts, split_of
from ...data import GUARD_POOLS, POOL_CATEGORY, Prompt, is_reserved, is_unsafe_pool, load_pool
from ...data.pools import (
    CHAT_CHECK_ROWS,
    CHECK_DOMAINS,
    DOMAIN_CHECK_ROWS,
    EVAL_SOURCES,
    HARM_CHECK_POOLS,
    HARM_CHECK_ROWS,
    KEEPABLE_POOLS,
)
from ...data.store import INDEX, ActivationSet, ActivationStore, load_activations, save_activations
from ...errors import SmallSampleWarning, ThresholdsResetWarning, warn
from ..fingerprint import record_fingerprint
from ..threshold import allowed_flags
from ..types import BudgetConfig
from .probe import ProbeConfig, Read, SupervisedHead, SupervisedHeadConfig, balanced_weights, check_head_name

BENIGN_POOLS: tuple[str, ...] = ("chat", "safe", "benign_ood", "lookalike")
"""The bundled benign pools a head added from a few examples learns against (their fit rows)."""

THRESHOLD_POOL = "chat"
"""The pool whose validation rows set every head's threshold again: the traffic a deployed guard mostly sees."""

BUNDLED_CHAT_ROWS = f"validation {THRESHOLD_POOL}"
"""How a budget set on the bundled validation chat names its rows (:func:`fit_budget_on_prompts` without prompts,
:func:`add_fitted_head`), before the system turn or adapter it was read under."""
KEPT_LABEL = "the bundled validation rows of"
"""The words that open the naming of the pools :func:`fit_budget_on_prompts` kept within the budget
(:func:`kept_pools_label`), in a budget's rows after ``", and "`` and in the commands' lines."""

MIN_UNSAFE = 10
"""Fewest examples of a category a head is fitted on."""

NEW_HEAD_SHARE = 0.05
"""The share of the false-positive budget a head added beside supervised heads takes unless told otherwise: on
validation rows, the smallest of 0.02, 0.05, 0.1 and 0.2 at which the released guard with a head for each of four
hand-written categories caught as many of the category's held-out phrasings as at an equal share, less one of 32.
The harm head's threshold then moves from 0.357 to 0.375 (to 0.50-0.55 at an equal share)
(``benchmarks/experiments/heads/new_head_share.json``)."""

NEW_HEAD_SHARE_BESIDE_ANOMALY = 0.2
"""The share a head added to a guard whose only head is the anomaly head takes unless told otherwise: the same rule
on the paper guard (at 0.1 one category's held-out phrasings were caught at 0.56)."""


USER_SAFE = "your safe prompts"
"""The group of the user's own ``safe`` prompts in :func:`add_head`'s fit, beside the bundled benign pools (a space:
no head, whose name is the unsafe rows' group, can share it)."""


def fit_head(
    name: str,
    reads: dict[Read, Tensor],
    labels: Tensor,
    groups: Sequence[str],
    config: ProbeConfig,
    *,
    balance: Literal["source", "none"] = "source",
    weights: Tensor | None = None,
) -> SupervisedHead:
    """A supervised head fitted on ``reads`` (each ``[n, hidden]``) with 0/1 ``labels``; ``groups`` names each row's
    source (or benign domain). ``balance="source"`` weighs every group of each label alike
    (:func:`~hf_lsad.guard.heads.balanced_weights`), ``"none"`` weighs every row alike. ``weights`` (``[n]``, finite,
    non-negative, some on each label) are weights of your own instead: they replace ``balance``, and the head records
    ``balance="given"``."""
    check_head_name(name)
    if balance not in ("source", "none"):
        raise ValueError(f"balance must be 'source' or 'none', got {balance!r}")
    labels = torch.as_tensor(labels).to(torch.int64)
    if labels.ndim != 1 or len(labels) != len(groups):
        raise ValueError(f"{len(labels)} labels for {len(groups)} groups; expected one of each per row")
    unsafe = int(labels.sum())
    if unsafe == 0 or unsafe == len(labels):
        raise ValueError(f"head {name!r} needs safe and unsafe rows; got {unsafe} unsafe of {len(labels)}")
    hidden = next(iter(reads.values())).shape[1]
    head = SupervisedHead(
        SupervisedHeadConfig(
            name=name,
            probe=config,
            hidden_size=hidden,
            n_safe=len(labels) - unsafe,
            n_unsafe=unsafe,
            sources=sorted({g for g, label in zip(groups, labels.tolist()) if label == 1}),
            balance="given" if weights is not None else balance,
        )
    )
    if weights is None and balance == "source":
        weights = balanced_weights(groups, labels)
    head.probe.fit(head.probe.features(reads), labels, weights)
    return head.eval()


@contextlib.contextmanager
def fitting_note(name: str, rows: int, progress: bool) -> Iterator[None]:
    """Say on stderr that head ``name`` is being fitted on ``rows`` rows, and how long it took: the fit prints nothing
    of its own, and three MLP fits on the release's rows take minutes on a CPU."""
    if not progress:
        yield
        return
    print(f"fitting head {name!r} on {rows:,} rows ...", file=sys.stderr, flush=True)
    start = time.perf_counter()
    yield
    print(f"fitted head {name!r} in {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)


def add_head(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    guard: Any,
    name: str,
    unsafe: Sequence[str],
    safe: Sequence[str] = (),
    *,
    reads: Sequence[Read] | None = None,
    share: float | None = None,
    safe_weight: float | None = None,
    target_fpr: float | None = None,
    benign_per_pool: int | None = 400,
    threshold_rows: int | None = 1000,
    inverse_regularisation: float = 0.01,
    cache_dir: str | os.PathLike | None = None,
    batch_size: int = 16,
    max_batch_tokens: int | None = BATCH_TOKENS,
    seed: int = 0,
    progress: bool = True,
    system: str | None = None,
) -> BudgetConfig:
    """Fit a head for the category of the ``unsafe`` prompts, add it to ``guard`` and split the budget again.

    Args:
        model, tokenizer: The guard's base model and its tokenizer (prompts are encoded as user turns of the chat
            template, as the guard's other heads read them).
        guard: A :class:`~hf_lsad.guard.SafetyGuard` reading ``prompt_last`` (changed in place).
        name: The head's name (letters, digits, ``-``, ``_``).
        unsafe: At least :data:`MIN_UNSAFE` examples of the category.
        safe: The user's own benign examples (optional), fitted on beside the bundled benign pools.
        reads: What the head reads (default: those of the guard's first supervised head, else the last prompt token
            and the mean over the prompt at the anomaly head's layer).
        share: The new head's share of the false-positive budget (default: :func:`new_head_share`, 0.05 beside
            supervised heads, 0.2 beside the anomaly head alone); the other heads keep their proportions of the rest.
            The smaller it is, the more the other heads keep and the higher the new head's own threshold.
        safe_weight: The share of the benign weight your ``safe`` prompts carry together, in (0, 1) (default: they
            weigh as one bundled benign pool does, a fifth); the bundled pools split the rest alike.
        target_fpr: The combined flag rate on validation chat (default: the guard's, else 5%); the guard's
            ``confidence`` (:class:`~hf_lsad.guard.types.BudgetConfig`) is kept.
        benign_per_pool: Fit rows drawn from each bundled benign pool (seeded; ``None``: all).
        threshold_rows: Validation chat rows the thresholds are set on (seeded; ``None``: all).
        inverse_regularisation: The logistic regression's ``C``.
        cache_dir: A folder that keeps the bundled benign rows' activations (:func:`bundled_features`), so that a
            later head with the same reads on the same model runs the model over the user's prompts alone, and an
            interrupted collection resumes. ``None``: collected every time, kept nowhere.
        batch_size, seed, progress: Forward-pass batch size, the seed of the draws of bundled rows (the rows they
            are drawn from are the release's split: :func:`release_rows`), progress bars.
        max_batch_tokens: Padded tokens a forward pass holds at most (``None``: ``batch_size`` prompts whatever
            their length, as the bundled collections were made).
        system: The system turn the deployment puts before each user turn (``None``: the template's default): the
            examples, the bundled rows and the chat that sets the thresholds are all formatted under it, and the
            guard records it (:func:`fit_budget_on_prompts`). A ``cache_dir`` holds one turn.

    Returns:
        The guard's new :class:`~hf_lsad.guard.types.BudgetConfig`.
    """
    check_head_name(name)
    check_system_turn(system)
    check_prompts(unsafe)
    if safe:
        check_prompts(safe)
    if len(unsafe) < MIN_UNSAFE:
        raise ValueError(f"a head needs at least {MIN_UNSAFE} examples of its category, got {len(unsafe)}")
    if name in guard.head_names:
        raise ValueError(f"the guard already has a head named {name!r}")
    if share is not None and not 0.0 < share < 1.0:
        raise ValueError(f"share must be in (0, 1), got {share}")
    if safe_weight is not None and not (safe and 0.0 < safe_weight < 1.0):
        raise ValueError(
            f"safe_weight needs safe prompts and a value in (0, 1), got {safe_weight} with {len(safe)} safe prompts"
        )
    overlap = set(unsafe) & set(safe)
    if overlap:
        raise ValueError(f"{len(overlap)} prompts are both unsafe and safe, e.g. {sorted(overlap)[0]!r}")
    if reads is None:
        first = next(iter(guard.heads.values()), None)
        layer = guard.config.hook.layer
        reads = first.reads if first is not None else [(layer, "prompt_last"), (layer, "prompt_mean")]
    config = ProbeConfig(reads=list(reads), inverse_regularisation=inverse_regularisation)

    bundled: list[Prompt] = []
    groups = [name] * len(unsafe) + [USER_SAFE] * len(safe)
    for pool in BENIGN_POOLS:
        rows = _sample(release_rows(pool, "fit"), benign_per_pool, seed)
        bundled += rows
        groups += [pool] * len(rows)
    labels = torch.tensor([1] * len(unsafe) + [0] * (len(safe) + len(bundled)))
    user_reads, _ = collect_prompt_features(
        model,
        tokenizer,
        [*unsafe, *safe],
        config.reads,
        batch_size=batch_size,
        max_batch_tokens=max_batch_tokens,
        progress=progress,
        system=system,
    )
    bundled_reads = bundled_features(
        model,
        tokenizer,
        bundled,
        config.reads,
        cache_dir=cache_dir,
        batch_size=batch_size,
        max_batch_tokens=max_batch_tokens,
        progress=progress,
        system=system,
    )
    fit_reads = {read: torch.cat([user_reads[read], bundled_reads[read]]) for read in config.reads}
    weights = None if safe_weight is None else balanced_weights(groups, labels, {USER_SAFE: safe_weight})
    with fitting_note(name, len(labels), progress):
        head = fit_head(name, fit_reads, labels, groups, config, weights=weights)
    return add_fitted_head(
        model,
        tokenizer,
        guard,
        head,
        share=share,
        target_fpr=target_fpr,
        threshold_rows=threshold_rows,
        batch_size=batch_size,
        max_batch_tokens=max_batch_tokens,
        seed=seed,
        progress=progress,
        system=system,
    )


def add_fitted_head(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    guard: Any,
    head: SupervisedHead,
    *,
    share: float | None = None,
    target_fpr: float | None = None,
    threshold_rows: int | None = 1000,
    batch_size: int = 16,
    max_batch_tokens: int | None = BATCH_TOKENS,
    seed: int = 0,
    progress: bool = True,
    system: str | None = None,
) -> BudgetConfig:
    """Add a fitted supervised ``head`` to ``guard`` and set every threshold again on the bundled validation chat, as
    :func:`add_head` does once it has fitted its head (use this for a head fitted your own way, say with weights of
    your own). The new head takes ``share`` of the one false-positive budget (default: :func:`new_head_share`), the
    others keep their proportions of the rest; the guard's target rate (unless ``target_fpr`` is given)
    and ``confidence`` are kept. On any error the guard is left as it was. The other arguments are
    :func:`add_head`'s."""
    if share is not None and not 0.0 < share < 1.0:
        raise ValueError(f"share must be in (0, 1), got {share}")
    chat = _sample(release_rows(THRESHOLD_POOL, "validation"), threshold_rows, seed)
    old = guard.budget  # adding the head clears it
    share = new_head_share(guard) if share is None else share
    guard.add_head(head)
    try:
        previous = old.shares if old is not None else [1.0]  # a single-head guard: the anomaly head had it all
        budget = fit_budget_on_prompts(
            model,
            tokenizer,
            guard,
            [p.text for p in chat],
            target_fpr=target_fpr if target_fpr is not None else old.target_fpr if old is not None else None,
            shares=[s * (1.0 - share) for s in previous] + [share],
            confidence=old.confidence if old is not None else None,
            rows=BUNDLED_CHAT_ROWS,
            batch_size=batch_size,
            max_batch_tokens=max_batch_tokens,
            progress=progress,
            system=system,
            keep_nearest=True,  # bundled rows
        )
    except BaseException:  # leave the guard as it was
        del guard.heads[head.name]
        guard.budget = old
        raise
    reset = thresholds_reset_warning(old, head.name)
    if reset:  # the user's traffic no longer sets them: say so
        warn(reset, ThresholdsResetWarning)
    return budget


def thresholds_reset_warning(budget: BudgetConfig | None, name: str) -> str:
    """What to tell a user who adds head ``name`` to a guard with ``budget`` (``""`` unless its thresholds were set on
    other rows than the bundled validation chat alone, under any system turn or adapter: a user's own traffic, or
    beside kept pools), since :func:`add_fitted_head` sets them again on that chat."""
    if budget is None or (budget.rows.startswith(BUNDLED_CHAT_ROWS) and f", and {KEPT_LABEL} " not in budget.rows):
        return ""
    return (
        f"the guard's thresholds had been set on {budget.rows}; with head {name!r} added they are set again on the "
        "bundled validation chat: set them on that traffic again afterwards (hf-lsad set-budget --benign "
        "YOUR_SAMPLE, or hf-lsad teach; docs/heads.md, 'Your own traffic')"
    )


def new_head_share(guard: Any) -> float:
    """The share of the false-positive budget a head added to ``guard`` takes by default:
    :data:`NEW_HEAD_SHARE` beside supervised heads, :data:`NEW_HEAD_SHARE_BESIDE_ANOMALY` when the anomaly head is
    the guard's only head."""
    return NEW_HEAD_SHARE if guard.heads else NEW_HEAD_SHARE_BESIDE_ANOMALY


def fit_budget_on_prompts(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    guard: Any,
    prompts: Sequence[str] | None = None,
    *,
    target_fpr: float | None = None,
    shares: Sequence[float] | None = None,
    confidence: float | Literal["keep"] | None = "keep",
    rows: str | None = None,
    batch_size: int = 16,
    max_batch_tokens: int | None = BATCH_TOKENS,
    progress: bool = True,
    system: str | None = None,
    keep_nearest: bool | None = None,
    keep_bundled: Sequence[str] = (),
    cache_dir: str | os.PathLike | None = None,
) -> BudgetConfig:
    """Set every head's threshold on benign ``prompts`` (a sample of the traffic the guard will see, fitted on by no
    head), so that together the heads flag at most ``target_fpr`` of them
    (:meth:`~hf_lsad.guard.SafetyGuard.fit_budget`; the guard is changed in place). The guard also records its
    fingerprint of ``model`` (:func:`hf_lsad.guard.fingerprint.record_fingerprint`), so that a model whose weights
    differ is refused; with the bundled rows (``prompts=None``) it also keeps those nearest the thresholds, which
    catch a smaller change (your own prompts are kept only when you ask: ``keep_nearest``).

    Args:
        model, tokenizer: The guard's base model and its tokenizer (prompts are encoded as user turns of the chat
            template, as the heads read them). A model running peft adapters (a ``PeftModel``, or adapters loaded by
            transformers) sets the thresholds for the adapted model, and the guard records which adapters
            (:attr:`~hf_lsad.core.prompt_inputs.InputProfile.adapter`).
        guard: A :class:`~hf_lsad.guard.SafetyGuard` whose heads all read the prompt.
        prompts: The benign prompts. With a ``confidence``, at least as many as it needs
            (:func:`~hf_lsad.guard.threshold.allowed_flags`: 59 at 5% and 0.95); checked before the forward pass.
            ``None``: the bundled chat pool's validation rows (:func:`release_rows`), what the released thresholds
            were set on: the released operating point again, for a model that reads prompts otherwise (a peft
            adapter, a system turn of your own).
        target_fpr: The combined flag rate (default: the guard's budget's, else its ``config.target_fpr``).
        shares: Each head's share of the budget (default: the guard's budget's, else equal shares).
        confidence: ``"keep"`` (default): the guard's budget's; a float: bound the rate on fresh prompts of the same
            kind with that probability; ``None``: the plain quantile.
        rows: What the prompts are, recorded in the budget and on the card (default: "the user's own benign
            prompts", or "validation chat" for the bundled rows).
        batch_size, progress: Forward-pass batch size and progress bar.
        max_batch_tokens: Padded tokens a forward pass holds at most (``None``: ``batch_size`` prompts whatever
            their length).
        system: The system turn the deployment puts before each user turn (``None``: the template's default).
            Verdicts depend on it, so set the thresholds under the one the guard will meet; it is recorded in
            ``rows`` and in the guard's :attr:`~hf_lsad.core.prompt_inputs.InputProfile.system`, against which
            ``generate`` and ``screen`` check their rows (a guard without a profile takes the one of ``prompts``).
        keep_nearest: Keep the prompts nearest the thresholds, as token ids, in the guard's fingerprint
            (:func:`hf_lsad.guard.fingerprint.boundary_rows`), so that a smaller change of the model is refused.
            Default: only with the bundled rows (``prompts=None``); pass ``True`` only for prompts the guard folder
            may carry wherever it is pushed.
        keep_bundled: Bundled benign pools (of :data:`KEEPABLE_POOLS`; ``"chat"``: the rows the released thresholds
            were set on) whose validation rows the heads must also flag within the budget, each pool on its own
            rows beside ``prompts``: thresholds set on traffic the heads score lower than chat fall, and flag more
            of the chat and other traffic the deployment also serves. No head was fitted on those rows.
        cache_dir: A :func:`bundled_features` cache that keeps the ``keep_bundled`` rows' activations, a folder per
            pool in its :data:`KEPT_CACHE` sub-folder (``None``: read every time).

    Returns:
        The guard's new :class:`~hf_lsad.guard.types.BudgetConfig`.
    """
    kept = check_keep_bundled(keep_bundled, own_prompts=prompts is not None)
    if keep_nearest is None:  # only bundled rows are kept in the fingerprint, never a user's own traffic unasked
        keep_nearest = prompts is None
    if prompts is None:
        prompts = released_threshold_prompts()
        rows = rows or BUNDLED_CHAT_ROWS
    rows = rows or "the user's own benign prompts"
    check_prompts(prompts)
    check_reads_prompt(guard)
    target_fpr, confidence = budget_rule(guard, target_fpr, confidence)
    budget = guard.budget
    if shares is None:
        shares = budget.shares if budget is not None and budget.heads == guard.head_names else None
    allowed_flags(len(prompts), target_fpr, confidence)  # too few prompts for the confidence: refused here
    kept_rows = kept_pool_rows(kept, target_fpr, confidence)
    benign, profile = collect_prompt_features(
        model,
        tokenizer,
        list(prompts),
        guard.reads,
        batch_size=batch_size,
        max_batch_tokens=max_batch_tokens,
        progress=progress,
        system=system,
    )
    groups = torch.zeros(len(prompts), dtype=torch.long)  # [n]: the prompts are group 0, each kept pool one more
    for group, (pool, pool_rows) in enumerate(kept_rows.items(), start=1):
        folder = None if cache_dir is None else Path(cache_dir) / KEPT_CACHE / pool
        pool_features = bundled_features(
            model,
            tokenizer,
            pool_rows,
            guard.reads,
            cache_dir=folder,
            batch_size=batch_size,
            max_batch_tokens=max_batch_tokens,
            progress=progress,
            system=system,
            desc=f"kept {pool}",
        )
        benign = {read: torch.cat([benign[read], pool_features[read]]) for read in guard.reads}
        groups = torch.cat([groups, torch.full((len(pool_rows),), group, dtype=torch.long)])
        prompts = [*prompts, *(p.text for p in pool_rows)]
    if kept:
        label = kept_pools_label({pool: len(pool_rows) for pool, pool_rows in kept_rows.items()})
        rows = f"{rows}, and {label}, each kind within the budget"
    if system is not None:
        rows = f"{rows}, under the system turn {system!r}"
    if profile.adapter is not None:
        rows = f"{rows}, read through {adapter_label(profile.adapter)}"
    budget = guard.fit_budget(
        benign, target_fpr=target_fpr, shares=shares, rows=rows, confidence=confidence, groups=groups
    )
    # the thresholds, and so the verdicts, now hold for this system turn and the adapters the model runs; a guard
    # without a profile takes the one of the prompts its thresholds were set on
    if guard.inputs is not None:
        guard.inputs = dataclasses.replace(guard.inputs, system=system, adapter=profile.adapter)
    else:
        guard.inputs = profile
    # a model that scores otherwise is then refused; the rows nearest the thresholds only from rows the folder may carry
    nearest = prompts if keep_nearest else None
    record_fingerprint(
        model, tokenizer, guard, system=system, benign_prompts=nearest, benign_features=benign, rows=rows
    )
    return budget


USER_SOURCE = "user-benign"
"""The source name the user's benign prompts are fitted under by :func:`teach_traffic` (weighed as one source)."""

STEADY_SAMPLE = 1000
"""Prompts a user should bring to :func:`teach_traffic`. With a few hundred, the thresholds rest on the top few
scores of the part held back, and which sample is brought moves both the traffic flagged and the harm caught; with
a thousand far less (measured with chat, task prompts and benign OOD as the user's traffic:
``benchmarks/experiments/heads/own_traffic_sample.json`` and ``own_traffic_sample_domains.json``)."""


def check_keep_bundled(pools: Sequence[str], *, own_prompts: bool) -> list[str]:
    """The pools of ``keep_bundled`` as a list, checked: distinct names of :data:`KEEPABLE_POOLS`, and not
    :data:`THRESHOLD_POOL` when the thresholds are set on its rows already (``own_prompts=False``)."""
    if isinstance(pools, str):
        raise TypeError(f"keep_bundled takes a list of pool names, got the string {pools!r}")
    pools = list(pools)
    unknown = [pool for pool in pools if pool not in KEEPABLE_POOLS]
    if unknown or len(set(pools)) != len(pools):
        raise ValueError(f"keep_bundled takes distinct pools of {list(KEEPABLE_POOLS)}, got {pools}")
    if not own_prompts and THRESHOLD_POOL in pools:
        raise ValueError(f"without prompts the thresholds are set on the {THRESHOLD_POOL} pool's rows already")
    return pools


def kept_pools_label(sizes: dict[str, int]) -> str:
    """The words that name the kept pools' validation rows, ``{pool: rows}``, as a budget's rows and the commands'
    lines say them: "the bundled validation rows of chat (1,338), statements (201)"."""
    return f"{KEPT_LABEL} " + ", ".join(f"{pool} ({rows:,})" for pool, rows in sizes.items())


def kept_pool_rows(pools: Sequence[str], target_fpr: float, confidence: float | None) -> dict[str, list[Prompt]]:
    """The validation rows of each kept pool (:func:`check_keep_bundled`), each checked to be as many as the
    ``confidence`` needs to bound the rate at ``target_fpr`` on its own."""
    rows = {pool: release_rows(pool, "validation") for pool in pools}
    for pool_rows in rows.values():
        allowed_flags(len(pool_rows), target_fpr, confidence)
    return rows


def small_sample_warning(n_prompts: int, n_held_back: int, allowed: int) -> str:
    """What to tell a user who brings ``n_prompts`` to ``teach``, of which ``n_held_back`` set the thresholds and
    ``allowed`` of those may be flagged (``""`` from :data:`STEADY_SAMPLE` prompts up)."""
    if n_prompts >= STEADY_SAMPLE:
        return ""
    return (
        f"{n_prompts} prompts: the thresholds are set on the {n_held_back} held back, of which at most {allowed} may "
        f"be flagged, so the guard moves with which sample you bring; bring about {STEADY_SAMPLE:,} "
        "(docs/heads.md, 'Your own traffic')"
    )


def teach_traffic(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    guard: Any,
    prompts: Sequence[str],
    *,
    head: str = "harm",
    fit_fraction: float = 0.6,
    pools: Sequence[str] = GUARD_POOLS,
    rows_per_pool: int | None = None,
    target_fpr: float | None = None,
    confidence: float | Literal["keep"] | None = "keep",
    rows: str = "the user's own benign prompts",
    cache_dir: str | os.PathLike | None = None,
    batch_size: int = 16,
    max_batch_tokens: int | None = BATCH_TOKENS,
    seed: int = 0,
    progress: bool = True,
    system: str | None = None,
    keep_nearest: bool = False,
    keep_bundled: Sequence[str] = (),
) -> BudgetConfig:
    """Fit supervised head ``head`` again with part of the user's benign ``prompts`` beside the bundled pools' fit rows,
    and set every head's threshold on the rest of them (the guard is changed in place).

    The prompts are cut by a seeded permutation: ``fit_fraction`` of them join the head's fit as one more benign source
    (:data:`USER_SOURCE`, weighed like every other source), the rest set the thresholds as
    :func:`fit_budget_on_prompts` does. The head keeps its reads and fit settings (``head.config.probe``); its other
    rows are by default those it was released with: the ``fit`` split of every pool of
    :data:`~hf_lsad.data.GUARD_POOLS`, without the README's demo prompts.

    Args:
        model, tokenizer: The guard's base model and its tokenizer.
        guard: A :class:`~hf_lsad.guard.SafetyGuard` with a supervised head named ``head``, every head reading the
            prompt.
        prompts: A sample of the user's benign traffic, fitted on by no head. The part that sets the thresholds must be
            as large as the confidence needs (59 prompts at 5% and 0.95); checked before any forward pass. Fewer than
            :data:`STEADY_SAMPLE` are taught with a :class:`SmallSampleWarning`.
        head: The supervised head to fit again.
        fit_fraction: The share of ``prompts`` taught to the head, in (0, 1).
        pools: The bundled pools whose fit rows the head is fitted on again (default: those it was released with;
            fewer, or fewer rows, make a faster fit of another head).
        rows_per_pool: Fit rows drawn from each bundled pool (seeded; ``None``: all of them, as released).
        target_fpr, confidence: As :func:`fit_budget_on_prompts` (default: the guard's budget's).
        rows: What the prompts are, recorded in the budget and on the card.
        cache_dir: A folder that keeps the bundled rows' activations (:func:`bundled_features`): read when it holds
            them, so that teaching the same head again costs a forward pass over the user's prompts alone; written
            as they are collected when it does not, so that an interrupted teach resumes where it stopped.
            ``None``: collected every time, kept nowhere.
        batch_size, seed, progress: Forward-pass batch size; the seed of the cut and of ``rows_per_pool``'s draw
            (the bundled rows' split is the release's whatever the seed); progress bars.
        max_batch_tokens: Padded tokens a forward pass holds at most (``None``: ``batch_size`` prompts whatever
            their length). The bundled pools hold prompts of up to 8,000 tokens; padding their batch-mates to that
            length is most of the cost of a teach without it.
        system: The system turn the deployment puts before each user turn (``None``: the template's default). Every
            row the head is fitted on, the bundled ones and the user's, is formatted under it, and so are the prompts
            that set the thresholds; it is recorded in the guard's
            :attr:`~hf_lsad.core.prompt_inputs.InputProfile.system` (as :func:`fit_budget_on_prompts` records it).
            A ``cache_dir`` holds the bundled rows under one turn: keep one per turn.
        keep_nearest: Keep the held-back prompts nearest the thresholds in the guard's fingerprint, as
            :func:`fit_budget_on_prompts` does when asked (they travel with the guard folder).
        keep_bundled: Bundled benign pools whose validation rows the heads must also flag within the budget, each
            on its own beside the held-back prompts (:func:`fit_budget_on_prompts`; ``["chat"]``: a deployment that
            also serves ordinary chat). Their activations are kept in ``cache_dir`` when given.

    Returns:
        The guard's new :class:`~hf_lsad.guard.types.BudgetConfig`.
    """
    check_prompts(prompts)
    check_reads_prompt(guard)
    check_system_turn(system)
    kept = check_keep_bundled(keep_bundled, own_prompts=True)
    if head not in guard.heads:
        raise ValueError(f"the guard has no supervised head named {head!r}; it has {guard.head_names}")
    unknown = sorted(set(pools) - set(POOL_CATEGORY))
    if unknown or not pools:
        raise ValueError(f"pools must be bundled pools ({sorted(POOL_CATEGORY)}), got {list(pools)}")
    taught, held_back = cut_traffic(prompts, fit_fraction, seed)
    target, rule = budget_rule(guard, target_fpr, confidence)
    allowed = allowed_flags(len(held_back), target, rule)  # too few for the confidence: refused before any pass
    kept_pool_rows(kept, target, rule)
    warning = small_sample_warning(len(prompts), len(held_back), allowed)
    if warning:
        warn(warning, SmallSampleWarning)

    bundled = []
    for pool in pools:
        bundled += [(p, is_unsafe_pool(pool)) for p in drawn_fit_rows(pool, rows_per_pool, seed)]
    groups = [p.source for p, _ in bundled] + [USER_SOURCE] * len(taught)
    labels = torch.tensor([int(unsafe) for _, unsafe in bundled] + [0] * len(taught))
    old_head, old_budget = guard.heads[head], guard.budget
    bundled_reads = bundled_features(
        model,
        tokenizer,
        [p for p, _ in bundled],
        old_head.reads,
        cache_dir=cache_dir,
        batch_size=batch_size,
        max_batch_tokens=max_batch_tokens,
        progress=progress,
        system=system,
    )
    taught_reads, _ = collect_prompt_features(
        model,
        tokenizer,
        taught,
        old_head.reads,
        batch_size=batch_size,
        max_batch_tokens=max_batch_tokens,
        progress=progress,
        system=system,
    )
    fit_reads = {read: torch.cat([bundled_reads[read], taught_reads[read]]) for read in old_head.reads}
    with fitting_note(head, len(labels), progress):
        new_head = fit_head(head, fit_reads, labels, groups, old_head.config.probe)
    guard.heads[head] = new_head.to(old_head.probe.mean.device)
    try:
        return fit_budget_on_prompts(
            model,
            tokenizer,
            guard,
            held_back,
            target_fpr=target,
            shares=old_budget.shares if old_budget is not None else None,
            confidence=rule,
            rows=f"{rows} ({len(held_back)} held back; {len(taught)} more taught to head {head!r})",
            batch_size=batch_size,
            max_batch_tokens=max_batch_tokens,
            progress=progress,
            system=system,
            keep_nearest=keep_nearest,
            keep_bundled=keep_bundled,
            cache_dir=cache_dir,
        )
    except BaseException:  # leave the guard as it was
        guard.heads[head] = old_head
        guard.budget = old_budget
        raise


CHAT_CACHE = "validation-chat"
"""The sub-folder of a :func:`bundled_features` cache that keeps the rows :func:`bundled_chat_flag_rates` reads, a
folder per draw (``<rows>-rows-seed-<seed>``), so that a check of another size reads or writes its own (the fit rows'
stores sit at the cache's top)."""
HARM_CACHE = "validation-harm"
"""The sub-folder of a :func:`bundled_features` cache that keeps the rows :func:`bundled_harm_catch_rates` reads, a
folder per draw (``<rows>-per-group-seed-<seed>``)."""
DOMAIN_CACHE = "validation-domains"
"""The sub-folder of a :func:`bundled_features` cache that keeps the rows :func:`bundled_domain_flag_rates` reads, a
folder per draw (``<rows>-per-domain-seed-<seed>``)."""
KEPT_CACHE = "validation-kept"
"""The sub-folder of a :func:`bundled_features` cache that keeps the rows of each pool :func:`fit_budget_on_prompts`
keeps within the budget (``keep_bundled``), a folder per pool."""
CHECK_CACHES = (CHAT_CACHE, DOMAIN_CACHE, HARM_CACHE, KEPT_CACHE)
"""The sub-folders of a :func:`bundled_features` cache that keep bundled validation rows: the checks' draws and the
kept pools."""


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
    (:func:`teach_traffic`), or whose thresholds were set on it (:func:`fit_budget_on_prompts`), holds its budget on
    that traffic alone; this says what that does to ordinary chat, beside the guard it came from
    (``heads/security_traffic``: a security team's questions taught alone left bundled chat flagged at 14.9%, against
    7.0% as released).

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
    prompts = _sample(release_rows("chat", "validation"), rows, seed)
    folder = None if cache_dir is None else Path(cache_dir) / CHAT_CACHE / f"{len(prompts)}-rows-seed-{seed}"
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
    does rise, and the harm they let through is not in the user's sample: on 366 bug-report titles, which the
    released guard flags at 47%, :func:`fit_budget_on_prompts` left do-not-answer's validation rows caught at 36%
    (95% as released). This says what a change did to the harm the guard was taught, beside the guard it came from.

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
    drawn = {group: _sample(rows, rows_per_source, seed) for group, rows in groups.items()}
    draw = "all" if rows_per_source is None else str(rows_per_source)
    folder = None if cache_dir is None else Path(cache_dir) / HARM_CACHE / f"{draw}-per-group-seed-{seed}"
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
    by_pool = {pool: _sample(release_rows(pool, "validation"), rows_per_domain, seed) for pool in CHECK_DOMAINS}
    draw = "all" if rows_per_domain is None else str(rows_per_domain)
    folder = None if cache_dir is None else Path(cache_dir) / DOMAIN_CACHE / f"{draw}-per-domain-seed-{seed}"
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


PARTIAL = ".partial"
"""The folder of a cache holding an interrupted collection's parts (:func:`bundled_features`)."""
CHECKPOINT_BATCHES = 32
"""Batches collected between two parts of a collection into a cache (about 500 prompts)."""


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
    two). ``desc``: the progress bar's label.
    """
    ids = [p.id for p in prompts]
    if len(set(ids)) != len(ids):
        raise ValueError("the bundled prompts hold repeated ids")
    if checkpoint_batches < 1:
        raise ValueError(f"checkpoint_batches must be a positive integer, got {checkpoint_batches}")
    digests = [_digest(p.text) for p in prompts]
    if cache_dir is not None:
        _drop_finished_parts(Path(cache_dir))
    folders = {read: None if cache_dir is None else Path(cache_dir) / read_folder(read) for read in reads}
    adapter = adapter_digest(model)  # what every store read or written here is checked against and records
    features = {
        read: _cached_read(model, folder, read, ids, digests, system, adapter)
        for read, folder in folders.items()
        if folder is not None and (folder / INDEX).exists()
    }
    missing = [read for read in reads if read not in features]
    if not missing:
        return features
    records = [cache_record(p) for p in prompts]
    partial = None
    if cache_dir is not None:
        inputs_format = prompt_format(tokenizer)
        partial = _PartialCollection(Path(cache_dir) / PARTIAL, model, missing, records, inputs_format, system, adapter)
    done = partial.resume(ids, digests) if partial is not None else {}
    if done and progress:
        print(f"resuming: {len(done)} of {len(ids)} bundled prompts collected before", file=sys.stderr, flush=True)
    collected, inputs = collect_prompt_features(
        model,
        tokenizer,
        [p.text for p in prompts],
        missing,
        batch_size=batch_size,
        max_batch_tokens=max_batch_tokens,
        progress=progress,
        skip=done,
        on_batch=None if partial is None else partial.batch_writer(checkpoint_batches),
        system=system,
        desc=desc,
    )
    if partial is not None:
        if done:  # the rows an earlier run collected, in their place
            rows, part_rows = torch.tensor(list(done)), torch.tensor(list(done.values()))
            for read in missing:
                collected[read][rows] = partial.values[read][part_rows]
        ran = len(done) < len(ids)  # a prompt no part holds: its batch ran
        longest = max(partial.longest, inputs.max_prompt_tokens if ran else 0)
        inputs = dataclasses.replace(inputs, max_prompt_tokens=longest)
    for read in missing:
        folder = folders[read]
        if folder is not None:
            save_activations(folder, collected[read], records, HookPoint.from_model(model, *read), inputs=inputs)
        features[read] = collected[read]
    if partial is not None:
        partial.remove()
    return features


def _drop_finished_parts(cache: Path) -> None:
    """Remove a cache's parts when the stores of every read they hold are in the cache: a run stopped after writing
    its stores and before removing its parts left them, and they would refuse a later collection of other reads."""
    folder = cache / PARTIAL
    parts = sorted(folder.glob("part-*")) if folder.is_dir() else []
    stores = [store.name for part in parts for store in part.iterdir() if (store / INDEX).is_file()]
    if parts and all((cache / name / INDEX).is_file() for name in stores):
        shutil.rmtree(folder)


def read_folder(read: Read) -> str:
    """The folder of a cache holding the store of ``read``: ``layer<L>-<position>``."""
    return f"layer{read[0]}-{read[1]}"


class _PartialCollection:
    """An interrupted collection into a cache (:func:`bundled_features`): parts written as it goes, read by the next
    run. A part is a folder ``part-<n>`` holding a store per read (whose input profile records the part's longest
    prompt), renamed into place when complete."""

    def __init__(
        self,
        folder: Path,
        model: PreTrainedModel,
        reads: list[Read],
        records: list[dict[str, Any]],
        inputs: str,
        system: str | None,
        adapter: str | None,
    ) -> None:
        self.folder, self.model, self.reads, self.records = folder, model, reads, records
        self.prompt_format = inputs
        """How the prompts reach the model (``InputProfile.prompt_format``), recorded in each part."""
        self.system = system
        """The system turn before each prompt (``InputProfile.system``), recorded in each part."""
        self.adapter = adapter
        """The peft adapters the model runs (``InputProfile.adapter``), recorded in each part."""
        self.values: dict[Read, Tensor] = {}
        """Per read, ``[rows, hidden]``: every row the parts hold, in part order (:meth:`resume`)."""
        self.longest = 0
        """The longest prompt of the parts, in tokens."""
        self._positions: list[int] = []
        self._features: dict[Read, list[Tensor]] = {read: [] for read in reads}
        self._batches = self._batch_longest = 0

    def resume(self, ids: list[str], digests: list[str]) -> dict[int, int]:
        """``{position in ids: row of values}`` for every prompt a part holds, each part checked as the cache's
        stores are: of this model, of each read, of the prompts' text as it is now."""
        position = {prompt_id: i for i, prompt_id in enumerate(ids)}
        done: dict[int, int] = {}
        chunks: dict[Read, list[Tensor]] = {read: [] for read in self.reads}
        offset = 0
        for part in sorted(self.folder.glob("part-*")) if self.folder.is_dir() else []:
            absent = [read for read in self.reads if not (part / read_folder(read) / INDEX).is_file()]
            if absent:
                raise ValueError(
                    f"{part} holds an interrupted collection of other reads (not {absent[0]}): pass another cache "
                    "folder, or delete this one"
                )
            stores = {
                read: _checked_store(self.model, part / read_folder(read), read, self.system, self.adapter)
                for read in self.reads
            }
            part_ids = [record["id"] for record in stores[self.reads[0]].records]
            for read, store in stores.items():
                if [record["id"] for record in store.records] != part_ids or store.inputs is None:
                    raise ValueError(f"{part / read_folder(read)} is not a part of this collection; delete {part}")
                chunks[read].append(store.activations)
            for row, record in enumerate(stores[self.reads[0]].records):
                i = position.get(record["id"])
                if i is None:  # a prompt of a fit on more pools: not needed by this one
                    continue
                if record.get("digest") != digests[i]:
                    raise ValueError(
                        f"{part} was written when the text of bundled prompt {record['id']!r} was different; "
                        "pass another cache folder, or delete this one"
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
        records = [self.records[i] for i in self._positions]
        inputs = InputProfile(self.prompt_format, self._batch_longest, self.system, self.adapter)
        for read in self.reads:
            values, hook = torch.cat(self._features[read]), HookPoint.from_model(self.model, *read)
            save_activations(staging / read_folder(read), values, records, hook, inputs=inputs)
        os.replace(staging, part)  # a part is complete or absent
        self._positions, self._features = [], {read: [] for read in self.reads}
        self._batches = self._batch_longest = 0

    def remove(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)


def cache_record(prompt: Prompt) -> dict[str, str]:
    """The record a :func:`bundled_features` cache keeps of a bundled prompt: its id, a digest of its text (a store
    written when the text was different is refused), its source and category. A cache written otherwise, say from the
    stores ``hf-lsad collect`` wrote, is read when its records are these."""
    return {"id": prompt.id, "digest": _digest(prompt.text), "source": prompt.source, "category": prompt.category}


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


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
    store = _checked_store(model, folder, read, system, adapter)
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


def _checked_store(
    model: PreTrainedModel, folder: Path, read: Read, system: str | None, adapter: str | None
) -> ActivationSet:
    """The store in ``folder``, checked to hold ``model``'s activations at ``read`` of prompts under the system turn
    ``system``, through the peft ``adapter`` the model runs (:func:`~hf_lsad.capture.adapters.adapter_digest`; a
    store without an input profile was collected under the template's default, without an adapter)."""
    store = load_activations(folder)
    if (store.hook.layer, store.hook.position) != tuple(read):
        raise ValueError(f"{folder} holds activations of layer {store.hook.layer} {store.hook.position}, not {read}")
    store.hook.check_model(model)
    _check_turn(folder, store.inputs, system)
    stored = store.inputs.adapter if store.inputs is not None else None
    if stored != adapter:
        raise ValueError(
            f"{folder} holds the bundled prompts read through {adapter_label(stored)}, and the model runs "
            f"{adapter_label(adapter)}: pass another cache folder (one per adapter), or delete this one"
        )
    return store


def check_cache_turn(cache_dir: str | os.PathLike, system: str | None) -> None:
    """Refuse (``ValueError``) a :func:`bundled_features` cache whose stores, or whose interrupted collection's
    parts, hold the bundled prompts under another system turn than ``system``, from their indexes alone: the CLI
    checks a ``--cache`` so before it loads a model. The stores are checked in full as they are read."""
    cache = Path(cache_dir)
    # the fit rows' stores at the top, each check's draw in a folder of its own; each with an interrupted part
    folders = [cache, *(folder for check in CHECK_CACHES for folder in sorted(cache.glob(f"{check}/*")))]
    indexes = [
        index
        for folder in folders
        for pattern in (f"layer*/{INDEX}", f"{PARTIAL}/part-*/layer*/{INDEX}")
        for index in sorted(folder.glob(pattern))
    ]
    for index in indexes:
        _check_turn(index.parent, ActivationStore(index.parent).inputs, system)


def _check_turn(folder: Path, inputs: InputProfile | None, system: str | None) -> None:
    """Refuse a cache store whose prompts were formatted under another system turn than ``system`` (a store without
    an input profile was collected under the template's default)."""
    stored = inputs.system if inputs is not None else None
    if stored != system:
        raise ValueError(
            f"{folder} holds the bundled prompts under the system turn {turn_label(stored)}, not "
            f"{turn_label(system)}: pass another cache folder (one per system turn), or delete this one"
        )


T = TypeVar("T")
"""Any row :func:`cut_traffic` cuts."""


def cut_traffic(prompts: Sequence[T], fit_fraction: float, seed: int) -> tuple[list[T], list[T]]:
    """``(taught, held_back)``: :func:`teach_traffic`'s seeded cut of the user's prompts (or of any rows: the
    benchmarks cut row indices by it), each part in input order."""
    if not 0.0 < fit_fraction < 1.0:
        raise ValueError(f"fit_fraction must be in (0, 1), got {fit_fraction}")
    taught_rows, held_back_rows = seeded_parts(len(prompts), [round(fit_fraction * len(prompts))], seed)
    taught = [prompts[i] for i in taught_rows.tolist()]
    held_back = [prompts[i] for i in held_back_rows.tolist()]
    if not taught or not held_back:
        raise ValueError(f"{len(prompts)} prompts cut at {fit_fraction} leave none to fit on or none to set thresholds")
    return taught, held_back


def check_reads_prompt(guard: Any) -> None:
    """Refuse a guard with a head that reads the response: :func:`fit_budget_on_prompts` scores prompts alone."""
    response = [read for read in guard.reads if not read[1].startswith("prompt")]
    if response:
        raise ValueError(f"thresholds are set on prompts; this guard reads the response at {response}")


def budget_rule(
    guard: Any, target_fpr: float | None, confidence: float | Literal["keep"] | None
) -> tuple[float, float | None]:
    """The ``(target_fpr, confidence)`` :func:`fit_budget_on_prompts` sets thresholds by: each as given, or the guard's
    (``target_fpr=None``: its budget's, else its ``config.target_fpr``; ``confidence="keep"``: its budget's, else the
    plain quantile)."""
    budget = guard.budget
    if target_fpr is None:
        target_fpr = budget.target_fpr if budget is not None else guard.config.target_fpr
    if confidence == "keep":
        confidence = budget.confidence if budget is not None else None
    return target_fpr, confidence


def released_threshold_prompts() -> list[str]:
    """The bundled rows the released guard's thresholds were set on (the validation rows of :data:`THRESHOLD_POOL`),
    as texts: where :func:`fit_budget_on_prompts` sets them without prompts of the user's."""
    return [p.text for p in release_rows(THRESHOLD_POOL, "validation")]


def release_rows(pool: str, split: Literal["fit", "validation", "test"]) -> list[Prompt]:
    """The bundled ``pool``'s rows in ``split`` of the release's split (:func:`~hf_lsad.core.splits.split_of`, seed
    0), the README's reserved prompts left out: what a head added to a bundled guard may fit or set thresholds on.
    The split is the one the bundled heads were fitted on, whatever seed draws a sample of these rows, so their
    validation and test rows stay out of every fit and no threshold is set on a row a head was fitted on."""
    return [p for p in load_pool(pool) if split_of(p.id) == split and not is_reserved(p.text)]


def drawn_fit_rows(pool: str, rows_per_pool: int | None, seed: int) -> list[Prompt]:
    """The bundled ``pool``'s fit rows that :func:`teach_traffic` fits a head on again: a seeded draw of
    ``rows_per_pool`` of them (``None``: all of them, as released)."""
    return _sample(release_rows(pool, "fit"), rows_per_pool, seed)


def _sample(items: list[Any], limit: int | None, seed: int) -> list[Any]:
    if limit is None or limit >= len(items):
        return items
    picked = torch.randperm(len(items), generator=torch.Generator().manual_seed(seed))[:limit].sort().values
    return [items[i] for i in picked.tolist()]
