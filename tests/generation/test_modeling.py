"""Guarded generate: same sequences, consistent and batch-invariant scores, hooks cleaned up."""

from __future__ import annotations

import pytest
import torch
from tiny import LAYER, MIXED_BATCH, PROMPTS, last_layer_output, tiny_guard

from hf_lsad.capture.collect import encode_prompts
from hf_lsad.capture.recorder import final_call_index, generate_with_activations, prefill_activations
from hf_lsad.core.hook_point import decoder_layer
from hf_lsad.generation.model import GuardedGenerateDecoderOnlyOutput, GuardedModelForCausalLM
from hf_lsad.testing import tiny_model


@pytest.mark.parametrize("architecture", ["llama", "qwen2", "mistral", "gemma", "gpt2"])
def test_decoder_layers_are_found_for_common_architectures(architecture):
    model, _ = tiny_model(architecture)
    name, module = decoder_layer(model, -1)
    assert name.endswith(".3") and module is dict(model.named_modules())[name]


def test_layer_out_of_range_is_a_clear_error():
    model, _ = tiny_model("llama")
    with pytest.raises(IndexError, match=r"layer 4 is out of range.*4 decoder layers"):
        decoder_layer(model, 4)


def test_unknown_architecture_is_a_clear_error():
    model, _ = tiny_model("llama")
    model.model.layers = torch.nn.ModuleList(list(model.model.layers)[:2])  # no longer matches the config
    with pytest.raises(ValueError, match="cannot locate the decoder layers"):
        decoder_layer(model, 0)


@pytest.mark.parametrize("position", ["response_last", "prompt_last"])
def test_scores_are_batch_invariant_with_left_padding(position):
    model, tokenizer, guard = tiny_guard(position)
    guarded = GuardedModelForCausalLM(model, guard)
    batch = encode_prompts(tokenizer, MIXED_BATCH)
    assert len(set(batch["attention_mask"].sum(1).tolist())) == 3  # three different lengths
    guarded.generate(**batch, max_new_tokens=6, do_sample=False)
    together = [r.score for r in guarded.last_safety]
    for i, prompt in enumerate(MIXED_BATCH):
        guarded.generate(**encode_prompts(tokenizer, [prompt]), max_new_tokens=6, do_sample=False)
        assert abs(guarded.last_safety[0].score - together[i]) <= 1e-4


@pytest.mark.parametrize("architecture", ["llama", "qwen2", "mistral", "gemma", "gpt2"])
def test_prefill_collection_equals_what_guarded_generate_scores(architecture):
    """prompt_last collection stops after the hooked block; it must read the prefill activation of generate."""
    model, tokenizer = tiny_model(architecture)
    inputs = encode_prompts(tokenizer, MIXED_BATCH)
    assert len(set(inputs["attention_mask"].sum(1).tolist())) == 3
    _, generated = generate_with_activations(model, LAYER, "prompt_last", **inputs, max_new_tokens=2, do_sample=False)
    cut = prefill_activations(model, LAYER, inputs["input_ids"], inputs["attention_mask"])
    torch.testing.assert_close(cut, generated, atol=1e-5, rtol=1e-5)
    calls = []
    handle = model.lm_head.register_forward_hook(lambda *a: calls.append(1))
    try:
        prefill_activations(model, 0, inputs["input_ids"], inputs["attention_mask"])
    finally:
        handle.remove()
    assert calls == []  # the forward pass stopped before the LM head


def test_generate_returns_the_plain_models_sequences_and_reports():
    model, tokenizer, guard = tiny_guard()
    guarded = GuardedModelForCausalLM(model, guard)
    inputs = encode_prompts(tokenizer, MIXED_BATCH)
    plain = model.generate(**inputs, max_new_tokens=6, do_sample=False)
    tensor_out = guarded.generate(**inputs, max_new_tokens=6, do_sample=False)
    assert torch.equal(plain, tensor_out)
    assert len(guarded.last_safety) == 3
    dict_out = guarded.generate(
        **inputs, max_new_tokens=6, do_sample=False, return_dict_in_generate=True, output_scores=True
    )
    assert isinstance(dict_out, GuardedGenerateDecoderOnlyOutput)
    assert torch.equal(dict_out.sequences, plain) and len(dict_out.scores) == 6
    for report in dict_out.safety:
        assert report.threshold == guard.threshold and report.flagged == (report.score > guard.threshold)
        assert 0 <= report.cluster < 3 and report.probability is None


def test_the_prompt_ids_may_be_given_as_transformers_names_them():
    model, tokenizer, guard = tiny_guard()
    guarded = GuardedModelForCausalLM(model, guard)
    inputs = encode_prompts(tokenizer, MIXED_BATCH)
    keyword = guarded.generate(**inputs, max_new_tokens=4, do_sample=False, return_dict_in_generate=True)
    mask = inputs["attention_mask"]
    for out in (
        guarded.generate(inputs["input_ids"], attention_mask=mask, max_new_tokens=4, do_sample=False),
        guarded.generate(inputs=inputs["input_ids"], attention_mask=mask, max_new_tokens=4, do_sample=False),
    ):
        assert torch.equal(out, keyword.sequences)
        assert [r.score for r in guarded.last_safety] == [r.score for r in keyword.safety]
    with pytest.raises(ValueError, match="as input_ids or as inputs, not both"):
        guarded.generate(inputs["input_ids"], inputs=inputs["input_ids"], max_new_tokens=2)


def test_scored_activation_equals_a_fresh_forward_pass_at_the_final_response_token():
    model, tokenizer, _ = tiny_guard()
    inputs = encode_prompts(tokenizer, MIXED_BATCH)
    prompt_length = inputs["input_ids"].shape[1]
    plain = model.generate(**inputs, max_new_tokens=8, do_sample=False)
    # Make row 0 stop early: its 3rd generated token becomes an EOS token for this call.
    eos = int(plain[0, prompt_length + 2])
    output, activations = generate_with_activations(
        model, LAYER, "response_last", **inputs, max_new_tokens=8, do_sample=False, eos_token_id=eos
    )
    for row in range(3):
        mask = inputs["attention_mask"][row].bool()
        prompt = inputs["input_ids"][row][mask]
        response = output[row, prompt_length:].tolist()
        n = response.index(eos) + 1 if eos in response else len(response)
        consumed = torch.cat([prompt, torch.tensor(response[: n - 1], dtype=prompt.dtype)])
        torch.testing.assert_close(activations[row], last_layer_output(model, consumed), atol=1e-5, rtol=1e-5)
    assert eos in output[0, prompt_length:].tolist()


def test_guarded_generate_runs_one_forward_per_new_token():
    model, tokenizer, guard = tiny_guard()
    calls = []
    handle = model.register_forward_hook(lambda *args: calls.append(1))
    try:
        GuardedModelForCausalLM(model, guard).generate(
            **encode_prompts(tokenizer, MIXED_BATCH), max_new_tokens=6, min_new_tokens=6, do_sample=False
        )
    finally:
        handle.remove()
    assert len(calls) == 6


def test_final_call_index_counts_up_to_the_first_eos():
    new_tokens = torch.tensor([[5, 9, 2, 2], [5, 6, 7, 8], [2, 2, 2, 2]])
    assert final_call_index(new_tokens, [2], "response_last").tolist() == [2, 3, 0]
    assert final_call_index(new_tokens, [], "response_last").tolist() == [3, 3, 3]
    assert final_call_index(new_tokens, [2], "prompt_last").tolist() == [0, 0, 0]


def test_hooks_are_removed_after_generate_and_on_errors():
    model, tokenizer, guard = tiny_guard()
    _, block = decoder_layer(model, LAYER)
    guarded = GuardedModelForCausalLM(model, guard)
    guarded.generate(**encode_prompts(tokenizer, ["hello"]), max_new_tokens=2, do_sample=False)
    before = dict(block._forward_hooks)  # transformers keeps hooks of its own there
    guarded.generate(**encode_prompts(tokenizer, ["hello"]), max_new_tokens=2, do_sample=False)
    assert block._forward_hooks == before
    with pytest.raises(ValueError):
        guarded.generate(input_ids=torch.tensor([[1, 2, 3]]), max_new_tokens=-5)
    assert block._forward_hooks == before


@pytest.mark.parametrize("padding_side", ["left", "right"])
def test_a_prompt_last_guard_reports_under_beam_search(padding_side):
    """The paper's guard alone reads the prompt's last token on the prefill: under beam search each returned sequence
    gets its prompt's greedy report, and the sequences are plain beam search's."""
    model, tokenizer, guard = tiny_guard("prompt_last")
    guarded = GuardedModelForCausalLM(model, guard)
    inputs = encode_prompts(tokenizer, PROMPTS[:6], padding_side=padding_side)
    greedy = guarded.generate(**inputs, max_new_tokens=3, do_sample=False, return_dict_in_generate=True).safety
    options = {"num_beams": 3, "num_return_sequences": 2, "max_new_tokens": 3, "do_sample": False}
    out = guarded.generate(**inputs, **options, return_dict_in_generate=True)
    assert torch.equal(out.sequences, model.generate(**inputs, **options, pad_token_id=tokenizer.pad_token_id))
    assert len(out.safety) == 12
    for i, report in enumerate(out.safety):
        want = greedy[i // 2]
        assert report.flagged == want.flagged and report.cluster == want.cluster
        assert report.score == pytest.approx(want.score, rel=1e-5, abs=1e-6)


def test_unsupported_generation_modes_and_inputs_are_refused():
    model, tokenizer, guard = tiny_guard()
    guarded = GuardedModelForCausalLM(model, guard)
    inputs = encode_prompts(tokenizer, ["hello"])
    with pytest.raises(ValueError, match="num_beams=1"):
        guarded.generate(**inputs, num_beams=2, max_new_tokens=2)  # a response_last guard reads beams' responses
    with pytest.raises(ValueError, match="needs input_ids"):
        guarded.generate(inputs_embeds=torch.zeros(1, 3, 32), max_new_tokens=2)
    with pytest.raises(ValueError, match="prompt list is empty"):
        encode_prompts(tokenizer, [])
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        encode_prompts(tokenizer, ["fine", "   "])
