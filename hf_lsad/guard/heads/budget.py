"""Every head's threshold set on a user's own benign prompts (:func:`fit_budget_on_prompts`), what ``hf-lsad
set-budget`` runs: for traffic the heads flag more often than chat (a benign domain they were not fitted on), the
thresholds set on a sample of it instead of the bundled chat, optionally with bundled pools kept within the budget
too (``keep_bundled``).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from typing import Any, Literal

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from ...capture.adapters import adapter_label
from ...capture.collect import check_prompts, collect_prompt_features
from ...core.batching import BATCH_TOKENS
from ...core.serialization import folder_path
from ...data import Prompt
from ...data.pools import KEEPABLE_POOLS
from ...errors import ThresholdsResetWarning, warn
from ..fingerprint import record_fingerprint
from ..threshold import allowed_flags
from ..types import BudgetConfig
from .bundled import KEPT_CACHE, bundled_features, check_cache_turn, release_rows

THRESHOLD_POOL = "chat"
"""The pool whose validation rows set every head's threshold again: the traffic a deployed guard mostly sees."""

BUNDLED_CHAT_ROWS = f"validation {THRESHOLD_POOL}"
"""How a budget set on the bundled validation chat names its rows (:func:`fit_budget_on_prompts` without prompts,
:func:`~hf_lsad.guard.heads.training.add_fitted_head`), before the system turn or adapter it was read under."""

KEPT_LABEL = "the bundled validation rows of"
"""The words that open the naming of the pools :func:`fit_budget_on_prompts` kept within the budget
(:func:`kept_pools_label`), in a budget's rows after ``", and "`` and in the commands' lines."""


TAUGHT_LABEL = "more taught to head"
"""The words a budget set by :func:`~hf_lsad.guard.heads.training.teach_traffic` names its taught prompts with ("(330
held back; 495 more taught to head 'harm')"), which :func:`was_taught` reads."""


def was_taught(budget: BudgetConfig | None, head: str | None = None) -> bool:
    """Whether ``budget`` was set by :func:`~hf_lsad.guard.heads.training.teach_traffic` teaching ``head`` (any head:
    ``None``), as its rows say (:data:`TAUGHT_LABEL`): what the warnings of ``teach``, ``add-head`` and
    ``set-budget`` on a taught guard advise by."""
    taught = f" {TAUGHT_LABEL} " + ("" if head is None else repr(head))
    return budget is not None and taught in budget.rows


def taught_budget_warning(budget: BudgetConfig | None, own_prompts: bool) -> str:
    """What to tell a user who sets the thresholds of a guard with ``budget`` again (:func:`fit_budget_on_prompts`,
    ``hf-lsad set-budget``): ``""`` unless a head was taught the user's traffic (:func:`was_taught`), whose thresholds
    ``teach`` set on the part of the sample it held back. Set on the prompts it taught, which its head scores lower
    than new traffic of their kind, they would flag more of that traffic than the budget allows; set on the bundled
    chat, they no longer bound the taught traffic's rate. ``own_prompts``: the thresholds are set on the user's
    prompts (else on the bundled chat)."""
    if budget is None or not was_taught(budget):
        return ""
    before = f"the guard's thresholds were set by hf-lsad teach ({budget.rows}); "
    if own_prompts:
        return before + (
            "if these prompts hold the ones it taught, which its head scores lower than new traffic of their kind, "
            "thresholds set on them flag more of that traffic than the budget allows: set them again by teaching "
            "it again on the same sample with the same --seed (hf-lsad teach), which sets them on the prompts it "
            "holds back; prompts of traffic it was not taught are sound here (docs/heads.md, 'Your own traffic')"
        )
    return before + (
        "set again on the bundled validation chat, they bound the flag rate on chat, and no longer on the traffic it "
        "was taught: if the deployment serves that traffic, teach it again instead, with --keep-bundled chat to hold "
        "both (docs/heads.md, 'Your own traffic')"
    )


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
    if cache_dir is not None:  # before any forward pass: an empty name, a cache kept under another turn
        check_cache_turn(cache_dir, system)
    taught = taught_budget_warning(guard.budget, own_prompts=prompts is not None)
    if taught and (rows is None or TAUGHT_LABEL not in rows):  # not teach_traffic setting its own thresholds
        warn(taught, ThresholdsResetWarning)
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
        folder = None if cache_dir is None else folder_path(cache_dir, "cache_dir") / KEPT_CACHE / pool
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
