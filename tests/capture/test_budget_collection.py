"""Collecting under a budget of padded tokens a forward pass: the same features, in input order."""

from __future__ import annotations

import pytest
import torch
from tiny import MIXED_BATCH, PROMPTS

from hf_lsad.capture.collect import collect_prompt_features, prompt_texts, shared_prefix_length
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
    shared = shared_prefix_length([tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts])
    assert shapes[0] == (1, shared)  # the template's opening every prompt shares, once; then the rests
    assert all(rows * (shared + length) <= budget or rows == 1 for rows, length in shapes[1:])
    assert (1, max(lengths) - shared) in shapes[1:]  # the prompt over the budget went alone
    for read in READS:
        torch.testing.assert_close(budgeted[read], fixed[read], atol=1e-5, rtol=1e-5)
    single, _ = collect_prompt_features(model, tokenizer, [prompts[4]], READS, max_batch_tokens=budget, progress=False)
    for read in READS:
        torch.testing.assert_close(budgeted[read][4], single[read][0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("position", ["prompt_last", "response_last"])
def test_one_read_under_a_budget_matches_fixed_batches(position, monkeypatch):
    from hf_lsad.capture import collect

    model, tokenizer = tiny_model("llama")
    prompts = [*MIXED_BATCH, *PROMPTS[:10], "a long prompt " * 40]
    kwargs = dict(layer=2, position=position, batch_size=4, max_new_tokens=4, progress=False)
    sizes = []  # the rows of each batch: generation encodes them, a prompt read batches their token ids
    encode, read = collect.encode_prompts, collect.read_token_batches
    monkeypatch.setattr(
        collect, "encode_prompts", lambda tok, texts, **kw: sizes.append(len(texts)) or encode(tok, texts, **kw)
    )
    monkeypatch.setattr(
        collect,
        "read_token_batches",
        lambda model, reads, ids, batches, **kw: (
            sizes.extend(map(len, batches)) or read(model, reads, ids, batches, **kw)
        ),
    )
    budgeted = collect.collect_activations(model, tokenizer, prompts, max_batch_tokens=64, **kwargs)
    assert sizes[-1] == 1  # the long prompt, the longest, went alone
    assert len(sizes) > -(-len(prompts) // 4)  # the budget, not the size, closed batches
    fixed = collect.collect_activations(model, tokenizer, prompts, **kwargs)
    torch.testing.assert_close(budgeted.activations, fixed.activations, atol=1e-5, rtol=1e-5)
    assert budgeted.responses == fixed.responses and budgeted.inputs == fixed.inputs
