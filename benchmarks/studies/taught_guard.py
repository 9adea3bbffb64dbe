"""A guard folder judged under the system turn it records, on test rows: what ``hf-lsad teach --system`` gives.

``heads/system_turn_teach`` measured the recipe (the release's head fitted under the deployment's turn on a fifth of
the fit rows, thresholds on validation chat under the turn). This runner judges what the command writes: a guard
folder (``guard``), at its own thresholds, on the rows :func:`~.system_turns.judged_rows` draws from the test split
(every chat and look-alike row, a seeded draw of each unsafe source), formatted under the system turn the guard
records (``inputs.system``; its features are read from the cache of ``heads/system_turns`` when that study collected
them). It fits and sets nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from hf_lsad.data import GUARD_POOLS
from hf_lsad.evaluation.sources import load_source_rows
from hf_lsad.guard import SafetyGuard

from . import system_turns
from .system_turns import TurnCollector, cached_reads, judged_rows, rates


@dataclass
class Settings:
    guard: str = "artifacts/taught-bank-guard"
    """The guard folder judged (written by ``hf-lsad teach --system ...``); it must record a system turn."""
    folder: str = "artifacts/smollm2"
    """The stores of every pool (the rows' ids, texts, sources and splits; their features are not read)."""
    cache: str = "artifacts/system_turns"
    """Where the features of rows under a system turn are kept between runs (shared with ``heads/system_turns``)."""
    pools: list[str] = field(default_factory=lambda: list(GUARD_POOLS))
    """The pools judged."""
    model: str = "default"
    """The model read (the bundled SmolLM2-135M-Instruct)."""
    split: str = "test"
    """The split judged."""
    rows_per_source: int = 60
    """Rows drawn per unsafe source (seeded; those ``heads/system_turns`` cached)."""
    judged_domains: list[str] = field(default_factory=lambda: ["chat", "lookalike"])
    """The benign domains whose every row of the split is judged."""
    max_batch_tokens: int = 4096
    """Padded tokens a forward pass holds at most."""
    seed: int = 0
    """Seed of the draws."""


def run(settings: Settings) -> dict[str, Any]:
    guard = SafetyGuard.from_pretrained(settings.guard)
    if guard.inputs is None or guard.inputs.system is None:
        raise ValueError(f"{settings.guard} records no system turn: teach or set its budget with --system")
    if guard.budget is None:
        raise ValueError(f"{settings.guard} has no budget")
    turn = guard.inputs.system
    turn_settings = system_turns.Settings(
        folder=settings.folder,
        cache=settings.cache,
        pools=list(settings.pools),
        model=settings.model,
        rows_per_source=settings.rows_per_source,
        judged_domains=list(settings.judged_domains),
        max_batch_tokens=settings.max_batch_tokens,
        seed=settings.seed,
    )
    # the cache of heads/system_turns is keyed by the reads it collected: the released guard's, which are this one's
    reads = cached_reads(SafetyGuard.from_pretrained(turn_settings.guard))
    if not set(guard.reads) <= set(reads):
        raise ValueError(f"{settings.guard} reads {guard.reads}, not among {reads}")
    rows = load_source_rows(settings.folder, settings.pools, reads, seed=settings.seed)
    index = judged_rows(rows, settings.split, turn_settings)
    features = TurnCollector(turn_settings, reads)(rows, index, turn, settings.split)
    with torch.no_grad():
        flagged = guard(features).flagged
    return {
        "turn": turn,
        "thresholds": dict(zip(guard.budget.heads, guard.budget.thresholds)),
        "budget_rows": guard.budget.rows,
        "budget_measured_fpr": guard.budget.measured_fpr,
        "harm_head": {"n_safe": guard.heads["harm"].config.n_safe, "n_unsafe": guard.heads["harm"].config.n_unsafe},
        **rates(rows, index, flagged),
    }
