"""How prompts are grouped into forward passes: batches of a fixed size, or under a budget of padded tokens."""

from __future__ import annotations

import random

import pytest
import torch
from tiny import MIXED_BATCH, PROMPTS

from hf_lsad.capture.collect import collect_prompt_features, length_batches, prompt_texts
from hf_lsad.testing import tiny_model

READS = [(1, "prompt_last"), (2, "prompt_mean")]


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


def test_collection_under_a_budget_reads_the_same_features_in_input_order_and_keeps_to_it():
    model, tokenizer = tiny_model("llama")
    prompts = [*MIXED_BATCH, *PROMPTS[:30], "a long prompt " * 40]
    texts, _ = prompt_texts(tokenizer, prompts)
    lengths = [len(tokenizer(text, add_special_tokens=False)["input_ids"]) for text in texts]
    budget = 3 * max(lengths[:-1])
    shapes = []
    handle = model.model.layers[0].register_forward_hook(lambda _m, args, _o: shapes.append(tuple(args[0].shape[:2])))
    try:
        budgeted, profile = collect_prompt_features(
            model, tokenizer, prompts, READS, batch_size=8, max_batch_tokens=budget, progress=False
        )
    finally:
        handle.remove()
    fixed, fixed_profile = collect_prompt_features(model, tokenizer, prompts, READS, batch_size=8, progress=False)
    assert profile == fixed_profile
    assert all(rows * length <= budget or rows == 1 for rows, length in shapes)
    assert (1, max(lengths)) in shapes  # the prompt over the budget went alone
    for read in READS:
        torch.testing.assert_close(budgeted[read], fixed[read], atol=1e-5, rtol=1e-5)
    single, _ = collect_prompt_features(model, tokenizer, [prompts[4]], READS, max_batch_tokens=budget, progress=False)
    for read in READS:
        torch.testing.assert_close(budgeted[read][4], single[read][0], atol=1e-5, rtol=1e-5)
