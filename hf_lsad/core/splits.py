"""The seeded splits: of rows by position, and of prompts by id.

Guards hold out safe rows to set their threshold (:func:`split_safe`), evaluations cut
safe and unsafe stores into fit / validation / test (:func:`seeded_cut`), and the CLI
finds a guard's held-out rows again from its config (:func:`holdout_rows`): all of them
are one permutation of ``range(n)`` drawn from a seed, so the same seed always gives the same rows.

Supervised heads and the leave-one-source-out protocol split the bundled prompts by a hash of
their id instead (:func:`split_of`): the split of a prompt does not depend on which others were collected.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor


def seeded_parts(n: int, sizes: Sequence[int], seed: int) -> list[Tensor]:
    """``randperm(n)`` (seeded) cut into leading parts of ``sizes`` and the rest, each sorted."""
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    parts, start = [], 0
    for size in sizes:
        parts.append(order[start : start + size].sort().values)
        start += size
    parts.append(order[start:].sort().values)
    return parts


def seeded_cut(n: int, fractions: Sequence[float], seed: int) -> list[Tensor]:
    """:func:`seeded_parts` with sizes ``round(n * fraction)``; every part must be non-empty."""
    parts = seeded_parts(n, [round(n * fraction) for fraction in fractions], seed)
    if any(len(part) == 0 for part in parts):
        raise ValueError(f"cannot cut {n} rows into parts of fractions {list(fractions)} and the rest: a part is empty")
    return parts


class SafeSplit(NamedTuple):
    """The safe rows' indices cut in two by :func:`split_safe`."""

    fit: Tensor
    """Row indices the detector is fitted on."""
    holdout: Tensor
    """Row indices held out for the threshold (and as evaluation negatives)."""


def split_safe(n: int, holdout_fraction: float = 0.2, seed: int = 0) -> SafeSplit:
    """A seeded random split of ``n`` safe rows (the paper's 0.8/0.2)."""
    if not 0.0 < holdout_fraction < 1.0:
        raise ValueError(f"holdout_fraction must be in (0, 1), got {holdout_fraction}")
    n_holdout = round(n * holdout_fraction)
    if n_holdout < 1 or n - n_holdout < 1:
        raise ValueError(f"cannot split {n} safe rows with holdout_fraction={holdout_fraction}")
    holdout, fit = seeded_parts(n, [n_holdout], seed)
    return SafeSplit(fit=fit, holdout=holdout)


def holdout_rows(n_fit: int, n_holdout: int, seed: int) -> Tensor:
    """The held-out rows of a guard fitted on ``n_fit + n_holdout`` rows with split ``seed``."""
    return seeded_parts(n_fit + n_holdout, [n_holdout], seed)[0]


def split_of(row_id: str, seed: int = 0) -> str:
    """``fit`` (60%), ``validation`` (20%) or ``test`` (20%), from a hash of the row id and ``seed``.

    A function of the id alone, so a row keeps its split whichever subset of its pool was collected, and the
    supervised heads, their thresholds and the reports of :mod:`hf_lsad.evaluation.sources` agree on it."""
    digest = hashlib.sha256(f"{seed}:{row_id}".encode()).digest()
    u = int.from_bytes(digest[:8], "big") / 2**64
    return "fit" if u < 0.6 else "validation" if u < 0.8 else "test"
