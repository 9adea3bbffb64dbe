"""Several layers and positions from one forward pass over the prompt: batch- and padding-invariant."""

from __future__ import annotations

import pytest
import torch
from tiny import MIXED_BATCH, PROMPTS

from hf_lsad.capture import encode_prompts
from hf_lsad.capture.recorder import (
    generation_prompt_reader,
    generation_recorder,
    prefill_activations,
    prompt_features,
)
from hf_lsad.testing import tiny_model

READS = [(0, "prompt_last"), (1, "prompt_mean"), (2, "prompt_last"), (2, "prompt_mean")]
BATCH = [*MIXED_BATCH, PROMPTS[5], PROMPTS[70]]


@pytest.mark.parametrize("padding_side", ["left", "right"])
def test_each_row_reads_what_it_reads_alone(padding_side):
    model, tokenizer = tiny_model("llama")
    inputs = encode_prompts(tokenizer, BATCH, padding_side=padding_side)
    batched = prompt_features(model, READS, inputs["input_ids"], inputs["attention_mask"])
    for row, prompt in enumerate(BATCH):
        single = encode_prompts(tokenizer, [prompt])
        alone = prompt_features(model, READS, single["input_ids"], single["attention_mask"])
        for read in READS:
            torch.testing.assert_close(batched[read][row], alone[read][0], atol=1e-5, rtol=1e-5)


def test_the_mean_is_over_the_prompt_tokens_and_the_last_token_matches_the_prefill_reader():
    model, tokenizer = tiny_model("llama")
    inputs = encode_prompts(tokenizer, BATCH)
    features = prompt_features(model, READS, inputs["input_ids"], inputs["attention_mask"])
    torch.testing.assert_close(
        features[2, "prompt_last"], prefill_activations(model, 2, inputs["input_ids"], inputs["attention_mask"])
    )
    single = encode_prompts(tokenizer, [BATCH[1]])
    with torch.no_grad():
        hidden = model(**single, output_hidden_states=True).hidden_states[2][0]  # block 1's output
    torch.testing.assert_close(
        prompt_features(model, READS, single["input_ids"], single["attention_mask"])[1, "prompt_mean"][0],
        hidden.mean(0),
    )


def test_the_pass_stops_after_the_deepest_read_block():
    model, tokenizer = tiny_model("llama")
    calls = []
    handle = model.model.layers[3].register_forward_hook(lambda *_: calls.append(1))
    try:
        inputs = encode_prompts(tokenizer, BATCH[:2])
        prompt_features(model, READS, inputs["input_ids"], inputs["attention_mask"])
    finally:
        handle.remove()
    assert calls == []


def test_bad_reads_are_refused():
    model, tokenizer = tiny_model("llama")
    inputs = encode_prompts(tokenizer, BATCH[:2])
    with pytest.raises(ValueError, match="not read from the prompt"):
        prompt_features(model, [(1, "response_last")], inputs["input_ids"], inputs["attention_mask"])
    with pytest.raises(ValueError, match="0-based"):
        prompt_features(model, [(-1, "prompt_last")], inputs["input_ids"], inputs["attention_mask"])


@pytest.mark.parametrize("options", [{"num_beams": 2}, {"num_return_sequences": 2, "do_sample": True}])
def test_a_prefill_expanded_otherwise_than_the_guard_maps_it_fails_loudly(options):
    """Under beam search the reader picks each prompt's first beam by its row in the prefill; a prefill with other
    rows (transformers expanding the prompts otherwise) must not be read as if the rows were the prompts'."""
    model, tokenizer = tiny_model("llama")
    inputs = encode_prompts(tokenizer, BATCH[:2])
    reader = generation_prompt_reader(model, [(1, "prompt_mean")], {**inputs, **options})
    with reader, torch.no_grad(), pytest.raises(RuntimeError, match="expanded otherwise"):
        model(**inputs)  # the prompts once each, where the call maps two rows a prompt


@pytest.mark.parametrize("options", [{"num_beams": 2}, {"num_return_sequences": 2, "do_sample": True}])
def test_the_layer_recorder_refuses_a_prefill_expanded_otherwise_too(options):
    """The recorder of the anomaly head's read (report, stop and running paths) maps the prefill's rows as the prompt
    reader does, and refuses the same prefill."""
    model, tokenizer = tiny_model("llama")
    inputs = encode_prompts(tokenizer, BATCH[:2])
    recorder = generation_recorder(model, 1, {**inputs, **options})
    with recorder, torch.no_grad(), pytest.raises(RuntimeError, match="expanded otherwise"):
        model(**inputs)
