"""Collecting under a budget of padded tokens a forward pass: the same features, in input order."""

from __future__ import annotations

import torch
from tiny import MIXED_BATCH, PROMPTS

from hf_lsad.capture.collect import collect_prompt_features, prompt_texts
from hf_lsad.testing import tiny_model

READS = [(1, "prompt_last"), (2, "prompt_mean")]


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
