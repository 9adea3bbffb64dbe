"""Fitting supervised heads: from activations (:func:`fit_head`), from a user's examples of a category
(:func:`add_head`), and again with a user's benign traffic beside the bundled pools (:func:`teach_traffic`).

:func:`add_head` is what ``hf-lsad add-head`` runs: a head for a user's own category ("medical dosage advice", a
company's confidential project names) from about a hundred examples of it, against the user's safe examples (if any)
and the fit rows of the bundled benign pools; then every head's threshold is set again, together, on validation
chat rows, the new head taking its share of the one false-positive budget.

:func:`teach_traffic` is what ``hf-lsad teach`` runs: a supervised head fitted again on the bundled pools' fit rows
with part of the user's benign sample beside them, and every threshold set on the rest of the sample
(:func:`~hf_lsad.guard.heads.budget.fit_budget_on_prompts`). Thresholds alone move up to where the user's traffic
sits, and pass the harm that looks like it; a head taught the traffic moves its scores instead (measured:
``benchmarks/experiments/heads/own_traffic_fit.json``).
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Iterator, Sequence
from typing import Any, Literal, TypeVar

import torch
from torch import Tensor
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from ...capture.collect import check_prompts, collect_prompt_features
from ...core.batching import BATCH_TOKENS
from ...core.hook_point import Read
from ...core.prompt_inputs import check_system_turn
from ...core.splits import seeded_parts
from ...data import GUARD_POOLS, POOL_CATEGORY, Prompt, is_unsafe_pool
from ...errors import ReteachWarning, SmallSampleWarning, ThresholdsResetWarning, warn
from ..threshold import allowed_flags
from ..types import BudgetConfig
from .budget import (
    BUNDLED_CHAT_ROWS,
    KEPT_LABEL,
    TAUGHT_LABEL,
    THRESHOLD_POOL,
    budget_rule,
    check_keep_bundled,
    check_reads_prompt,
    fit_budget_on_prompts,
    kept_pool_rows,
    was_taught,
)
from .bundled import bundled_features, check_cache_turn, drawn_fit_rows, release_rows, sample_rows
from .probe import (
    ProbeConfig,
    SupervisedHead,
    SupervisedHeadConfig,
    balanced_weights,
    check_head_name,
    check_name_free,
)

BENIGN_POOLS: tuple[str, ...] = ("chat", "safe", "benign_ood", "lookalike")
"""The bundled benign pools a head added from a few examples learns against (their fit rows)."""

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
    if cache_dir is not None:  # before any forward pass: an empty name, a cache kept under another turn
        check_cache_turn(cache_dir, system)
    check_prompts(unsafe)
    if safe:
        check_prompts(safe)
    if len(unsafe) < MIN_UNSAFE:
        raise ValueError(f"a head needs at least {MIN_UNSAFE} examples of its category, got {len(unsafe)}")
    check_name_free(name, guard.head_names)
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
        rows = sample_rows(release_rows(pool, "fit"), benign_per_pool, seed)
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
    chat = sample_rows(release_rows(THRESHOLD_POOL, "validation"), threshold_rows, seed)
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
    beside kept pools), since :func:`add_fitted_head` sets them again on that chat. A guard taught the traffic
    (:func:`teach_traffic`) is told to be taught again: its head was fitted on part of the sample, so thresholds set
    on the whole sample would rest partly on rows that head was fitted on."""
    if budget is None or (budget.rows.startswith(BUNDLED_CHAT_ROWS) and f", and {KEPT_LABEL} " not in budget.rows):
        return ""
    reset = (
        f"the guard's thresholds had been set on {budget.rows}; with head {name!r} added they are set again on the "
        "bundled validation chat: "
    )
    if was_taught(budget):
        return reset + (
            "teach it again on the same sample with the same --seed (hf-lsad teach), which sets them on the prompts it "
            "holds back; set-budget on the whole sample would set them partly on prompts a head was fitted on "
            "(docs/heads.md, 'Your own traffic')"
        )
    return reset + (
        "set them on that traffic again afterwards (hf-lsad set-budget --benign YOUR_SAMPLE, or hf-lsad teach; "
        "docs/heads.md, 'Your own traffic')"
    )


def new_head_share(guard: Any) -> float:
    """The share of the false-positive budget a head added to ``guard`` takes by default:
    :data:`NEW_HEAD_SHARE` beside supervised heads, :data:`NEW_HEAD_SHARE_BESIDE_ANOMALY` when the anomaly head is
    the guard's only head."""
    return NEW_HEAD_SHARE if guard.heads else NEW_HEAD_SHARE_BESIDE_ANOMALY


USER_SOURCE = "user-benign"
"""The source name the user's benign prompts are fitted under by :func:`teach_traffic` (weighed as one source)."""

STEADY_SAMPLE = 1000
"""Prompts a user should bring to :func:`teach_traffic`. With a few hundred, the thresholds rest on the top few
scores of the part held back, and which sample is brought moves both the traffic flagged and the harm caught; with
a thousand far less (measured with chat, task prompts and benign OOD as the user's traffic:
``benchmarks/experiments/heads/own_traffic_sample.json`` and ``own_traffic_sample_domains.json``)."""


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


def reteach_warning(budget: BudgetConfig | None, head: str) -> str:
    """What to tell a user who teaches head ``head`` of a guard with ``budget`` (``""`` unless that budget was set by
    :func:`teach_traffic` teaching the same head). The head is fitted again on the bundled rows and the new sample
    alone: what it learnt of the traffic it was taught before stays only if the new sample holds that traffic too.
    The budget's rows are all that says a head was taught; once ``set-budget`` or ``add-head`` has set the thresholds
    again, a taught head is not recognised."""
    if budget is None or not was_taught(budget, head):
        return ""
    return (
        f"head {head!r} was taught before ({budget.rows}); it is fitted again on the bundled rows and this sample "
        "alone, so it keeps what it learnt of that traffic only if this sample holds it too (the same sample again "
        "does): bring one sample of all the traffic the guard serves (docs/heads.md, 'Your own traffic')"
    )


def added_from_own_examples(head: Any) -> bool:
    """Whether :func:`add_head` added ``head`` from a user's own unsafe examples: it records the head's own name as
    their source."""
    return head.name in head.config.sources


def check_teachable(head: Any) -> None:
    """Refuse to teach a head :func:`add_head` added from a user's own unsafe examples
    (:func:`added_from_own_examples`): :func:`teach_traffic` fits a head again on the bundled pools, and those
    examples, which the guard does not keep, would be lost, leaving a second head of the bundled kinds of harm under
    the user's name."""
    if added_from_own_examples(head):
        raise ValueError(
            f"head {head.name!r} was added from your own unsafe examples, which the guard does not keep: teaching it "
            "would fit it again on the bundled pools without them. Add it again with your traffic as its safe "
            "prompts instead (hf-lsad add-head --unsafe EXAMPLES --safe TRAFFIC; add_head(..., safe=...))"
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
            :data:`STEADY_SAMPLE` are taught with a :class:`SmallSampleWarning`. A head taught before is taught again
            with a :class:`~hf_lsad.errors.ReteachWarning` (:func:`reteach_warning`): it keeps only what this sample
            holds.
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
    if cache_dir is not None:  # before any forward pass: an empty name, a cache kept under another turn
        check_cache_turn(cache_dir, system)
    kept = check_keep_bundled(keep_bundled, own_prompts=True)
    if head not in guard.heads:
        raise ValueError(f"the guard has no supervised head named {head!r}; it has {guard.head_names}")
    check_teachable(guard.heads[head])
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
    reteach = reteach_warning(guard.budget, head)
    if reteach:
        warn(reteach, ReteachWarning)

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
            rows=f"{rows} ({len(held_back)} held back; {len(taught)} {TAUGHT_LABEL} {head!r})",
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
