"""The guard scores activations recorded on another device or in another dtype than its own.

A model loaded with ``device_map="auto"`` across devices records block L wherever that block
lives; a bf16 model records bf16. The guard moves the activation to its own device as float32.
The cross-device tests need one GPU (guard on the CPU, rows on the GPU) or two (a model split across
them) and are skipped without; the dtype test runs anywhere.
"""

from __future__ import annotations

import pytest
import torch
from accelerate import dispatch_model
from tiny import LAYER, MIXED_BATCH, fresh_guard, tiny_guard

from hf_lsad.capture.collect import encode_prompts
from hf_lsad.capture.recorder import prefill_activations
from hf_lsad.generation.model import GuardedModelForCausalLM
from hf_lsad.testing import tiny_model

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_a_bf16_model_is_scored_as_its_float32_activations():
    model, tokenizer = tiny_model("llama", seed=0)
    guard = fresh_guard("prompt_last")
    guarded = GuardedModelForCausalLM(model.to(torch.bfloat16), guard, tokenizer=tokenizer)
    reports = guarded.screen(MIXED_BATCH)
    inputs = encode_prompts(tokenizer, MIXED_BATCH)
    hidden = prefill_activations(model, LAYER, inputs["input_ids"], inputs["attention_mask"])  # what screen() reads
    assert hidden.dtype == torch.bfloat16
    assert [r.score for r in reports] == pytest.approx(guard(hidden.float()).scores.tolist(), rel=1e-5, abs=1e-6)


@needs_cuda
def test_activations_on_another_device_are_moved_to_the_guard():
    _, _, guard = tiny_guard("prompt_last")
    rows = torch.randn(3, guard.config.hook.hidden_size)
    expected = guard(rows).scores
    torch.testing.assert_close(guard(rows.cuda()).scores, expected)  # guard on the CPU, rows on the GPU
    assert [r.score for r in guard.reports(rows.cuda())] == pytest.approx(expected.tolist(), rel=1e-6)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_a_model_split_across_devices_is_guarded():
    model, tokenizer = tiny_model("llama", seed=0)
    reference = GuardedModelForCausalLM(model, fresh_guard("prompt_last"), tokenizer=tokenizer).screen(MIXED_BATCH)
    # The embeddings and the blocks below LAYER on GPU 0 (model.device: the guard goes there), block LAYER on GPU 1.
    device_map = {"model.embed_tokens": 0, "model.rotary_emb": 0, "model.norm": 1, "lm_head": 1}
    device_map |= {f"model.layers.{i}": 0 if i < LAYER else 1 for i in range(model.config.num_hidden_layers)}
    split, _ = tiny_model("llama", seed=0)
    split = dispatch_model(split, device_map=device_map)
    guarded = GuardedModelForCausalLM(split, fresh_guard("prompt_last"), tokenizer=tokenizer)
    assert guarded.device == torch.device("cuda", 0)
    assert next(split.model.layers[LAYER].parameters()).device == torch.device("cuda", 1)
    reports = guarded.screen(MIXED_BATCH)
    assert [r.score for r in reports] == pytest.approx([r.score for r in reference], rel=1e-4, abs=1e-5)
    inputs = {k: v.to(guarded.device) for k, v in encode_prompts(tokenizer, MIXED_BATCH).items()}
    output = guarded.generate(**inputs, max_new_tokens=2, do_sample=False, return_dict_in_generate=True)
    assert len(output.safety) == len(MIXED_BATCH)
