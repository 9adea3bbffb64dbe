"""Grouping prompts into forward passes: in order of length, a number of prompts a pass or a budget of padded tokens.

The one home of how prompts are batched (collection, fitting heads on prompts, screening). Pure Python, so that the
command line reads :data:`BATCH_TOKENS` without importing a model library.
"""

from __future__ import annotations

from collections.abc import Sequence

BATCH_TOKENS = 4096
"""The padded tokens a forward pass holds by default where a user waits on their own prompts: fitting heads and
setting thresholds on them (``hf-lsad add-head``, ``set-budget``, ``teach``) and screening a file (``hf-lsad
screen``). A long prompt then does not pad its batch-mates to its length (:func:`length_batches`; measured in
``benchmarks/results/perf--collect_batching.json``). Collection and evaluation keep ``batch_size`` prompts a pass
by default, as the bundled stores and the recorded studies were made."""


def check_batching(batch_size: int, max_batch_tokens: int | None) -> None:
    """Raise ``ValueError`` for a batch size or a token budget that is not a positive integer."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size}")
    if max_batch_tokens is not None and max_batch_tokens < 1:
        raise ValueError(f"max_batch_tokens must be a positive integer or None, got {max_batch_tokens}")


def length_batches(lengths: Sequence[int], batch_size: int, max_batch_tokens: int | None = None) -> list[list[int]]:
    """Indices of prompts of these ``lengths`` grouped into forward-pass batches, shortest first (ties in input order).

    Each batch holds at most ``batch_size`` prompts and, when ``max_batch_tokens`` is given, at most that many padded
    tokens (its prompts times its longest prompt, with ``lengths`` in tokens); a prompt longer than the budget is a
    batch of its own. The budget keeps one long prompt from padding its batch-mates to its length: on a CPU a batch's
    cost per token grows with its padded size.
    """
    check_batching(batch_size, max_batch_tokens)
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    if max_batch_tokens is None:
        return [order[start : start + batch_size] for start in range(0, len(order), batch_size)]
    batches: list[list[int]] = []
    for i in order:  # ascending lengths: prompt i is the longest of any batch it joins
        if batches and len(batches[-1]) < batch_size and (len(batches[-1]) + 1) * lengths[i] <= max_batch_tokens:
            batches[-1].append(i)
        else:
            batches.append([i])
    return batches
