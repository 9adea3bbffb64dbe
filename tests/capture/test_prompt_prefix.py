"""The opening every prompt of a collection shares (the chat template's, a system turn) runs once: the features are
those of whole prompts, on every architecture, and the model reads fewer tokens."""

from __future__ import annotations

import pytest
import torch
from tiny import MIXED_BATCH

from hf_lsad.capture.collect import collect_prompt_features, encode_prompts, prompt_texts, shared_prefix_length
from hf_lsad.capture.recorder import PromptPrefix, prefix_reader, prompt_features, read_after_prefix, read_prompts
from hf_lsad.testing import tiny_model

ARCHITECTURES = ["llama", "qwen2", "mistral", "gemma", "gpt2"]
READS = [(1, "prompt_mean"), (2, "prompt_last"), (3, "prompt_mean"), (3, "prompt_last")]
SYSTEM = "You are the support assistant of a small web shop."


def whole(model, tokenizer, prompts, system):
    """The reads of a pass over the whole prompts, left-padded, as screening reads them."""
    inputs = encode_prompts(tokenizer, prompts, system=system)
    return prompt_features(model, READS, inputs["input_ids"], inputs["attention_mask"])


@pytest.mark.parametrize("architecture", ARCHITECTURES)
@pytest.mark.parametrize("system", [None, SYSTEM])
def test_a_collection_reads_what_the_whole_prompts_give(architecture, system):
    model, tokenizer = tiny_model(architecture)
    texts, special = prompt_texts(tokenizer, MIXED_BATCH, system=system)
    assert shared_prefix_length(tokenizer(texts, add_special_tokens=special)["input_ids"]) > 0  # a prefix to share
    collected, profile = collect_prompt_features(model, tokenizer, MIXED_BATCH, READS, batch_size=3, system=system)
    want = whole(model, tokenizer, MIXED_BATCH, system)
    for read in READS:
        assert torch.allclose(collected[read], want[read], atol=1e-5), read
    assert profile.max_prompt_tokens == int(
        encode_prompts(tokenizer, MIXED_BATCH, system=system)["attention_mask"].sum(1).max()
    )


def test_the_prefix_runs_once():
    model, tokenizer = tiny_model()
    fed: list[int] = []
    handle = model.get_input_embeddings().register_forward_hook(lambda module, args, out: fed.append(args[0].numel()))
    try:
        collect_prompt_features(model, tokenizer, MIXED_BATCH, READS, batch_size=2, system=SYSTEM, progress=False)
    finally:
        handle.remove()
    texts, special = prompt_texts(tokenizer, MIXED_BATCH, system=SYSTEM)
    ids = tokenizer(texts, add_special_tokens=special)["input_ids"]
    shared = shared_prefix_length(ids)
    assert fed[0] == shared  # the prefix, once
    assert sum(fed[1:]) < sum(len(i) for i in ids) - shared  # then the rests of the prompts, padded
    assert len(fed) == 1 + -(-len(MIXED_BATCH) // 2)


def test_left_and_right_padded_rests_read_alike():
    model, tokenizer = tiny_model()
    texts, special = prompt_texts(tokenizer, MIXED_BATCH, system=SYSTEM)
    ids = tokenizer(texts, add_special_tokens=special)["input_ids"]
    shared = shared_prefix_length(ids)
    prefix = PromptPrefix.run(model, [layer for layer, _ in READS], ids[0][:shared])
    assert prefix is not None
    rests = {
        side: tokenizer.pad({"input_ids": [i[shared:] for i in ids]}, padding_side=side, return_tensors="pt")
        for side in ("left", "right")
    }
    left, right = (
        read_after_prefix(model, READS, prefix, rests[s]["input_ids"], rests[s]["attention_mask"])
        for s in ("left", "right")
    )
    want = whole(model, tokenizer, MIXED_BATCH, SYSTEM)
    for read in READS:
        assert torch.allclose(right[read], want[read], atol=1e-5) and torch.allclose(left[read], want[read], atol=1e-5)


def test_a_prefix_reader_keeps_the_rests_tokens_as_the_whole_prompts_give_them():
    model, tokenizer = tiny_model()
    texts, special = prompt_texts(tokenizer, MIXED_BATCH, system=SYSTEM)
    ids = tokenizer(texts, add_special_tokens=special)["input_ids"]
    shared = shared_prefix_length(ids)
    prefix = PromptPrefix.run(model, [layer for layer, _ in READS], ids[0][:shared])
    assert prefix is not None
    rests = tokenizer.pad({"input_ids": [i[shared:] for i in ids]}, padding_side="right", return_tensors="pt")
    reader = prefix_reader(model, READS, prefix, rests["input_ids"], rests["attention_mask"], keep_tokens=True)
    inputs = encode_prompts(tokenizer, MIXED_BATCH, system=SYSTEM, padding_side="right")
    full = read_prompts(model, READS, inputs["input_ids"], inputs["attention_mask"], keep_tokens=True)
    for row, prompt_ids in enumerate(ids):
        rest = len(prompt_ids) - shared
        for layer in (1, 2, 3):
            want = full.hidden[layer][row, shared : len(prompt_ids)]  # [rest, hidden]
            torch.testing.assert_close(reader.hidden[layer][row, :rest], want, atol=1e-5, rtol=1e-5)


def test_a_prefix_and_its_rests_are_checked():
    model, _ = tiny_model()
    with pytest.raises(ValueError, match="at least one token"):
        PromptPrefix.run(model, [1], [])
    prefix = PromptPrefix.run(model, [1, 2], [5, 6, 7])
    assert prefix is not None and prefix.length == 3
    input_ids, attention_mask = torch.tensor([[8, 9], [10, 0]]), torch.tensor([[1, 1], [1, 0]])
    with pytest.raises(ValueError, match=r"the prefix was run to blocks \[1, 2\]; these reads need \[3\]"):
        read_after_prefix(model, [(3, "prompt_mean")], prefix, input_ids, attention_mask)
    with pytest.raises(ValueError, match="positions \\['response_last'\\]"):
        read_after_prefix(model, [(2, "response_last")], prefix, input_ids, attention_mask)
    with pytest.raises(ValueError, match="hold no real token"):
        read_after_prefix(model, [(2, "prompt_mean")], prefix, input_ids, torch.tensor([[1, 1], [0, 0]]))


@pytest.mark.parametrize(
    ("token_ids", "length"),
    [
        ([], 0),
        ([[1, 2, 3]], 2),  # one sequence keeps its last token
        ([[1, 2, 3], [1, 2, 3]], 2),
        ([[1, 2, 3, 4], [1, 2, 5]], 2),
        ([[1, 2], [1]], 0),  # a one-token sequence leaves nothing to share
        ([[1, 2], [3, 2]], 0),
    ],
)
def test_the_shared_prefix_leaves_each_sequence_a_token(token_ids, length):
    assert shared_prefix_length(token_ids) == length
