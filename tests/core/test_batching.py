"""How prompts are grouped into forward passes: a number of prompts a pass, or a budget of padded tokens."""

from __future__ import annotations

import random

import pytest

from hf_lsad.core.batching import length_batches


def _lengths(seed: int, n: int = 200) -> list[int]:
    rng = random.Random(seed)
    return [rng.choice([rng.randint(1, 40), rng.randint(40, 400), rng.randint(400, 3000)]) for _ in range(n)]


def test_without_a_budget_batches_are_fixed_size_chunks_in_order_of_length():
    lengths = [5, 3, 9, 3, 1, 7, 5]
    assert length_batches(lengths, 3) == [[4, 1, 3], [0, 6, 5], [2]]


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize(("batch_size", "budget"), [(16, 4096), (4, 1000), (64, 512)])
def test_a_budget_caps_padded_tokens_and_closes_a_batch_only_when_the_next_prompt_would_not_fit(
    seed, batch_size, budget
):
    lengths = _lengths(seed)
    batches = length_batches(lengths, batch_size, budget)
    flat = [i for batch in batches for i in batch]
    assert sorted(flat) == list(range(len(lengths)))  # every prompt once
    assert [lengths[i] for i in flat] == sorted(lengths)  # shortest first
    for batch, following in zip(batches, [*batches[1:], None]):
        longest = max(lengths[i] for i in batch)
        assert len(batch) <= batch_size
        assert len(batch) * longest <= budget or len(batch) == 1  # a prompt over the budget goes alone
        if following is not None:  # greedy: the next prompt did not fit
            assert len(batch) == batch_size or (len(batch) + 1) * lengths[following[0]] > budget


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="batch_size"):
        length_batches([1, 2], 0)
    with pytest.raises(ValueError, match="max_batch_tokens"):
        length_batches([1, 2], 4, 0)
