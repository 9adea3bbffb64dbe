"""The guarded model inside transformers: pipeline(), attribute forwarding, save/push/from_pretrained."""

from __future__ import annotations

import copy  # pipeline() changes its tokenizer's padding side: it gets a copy of the shared one
import json
import uuid

import pytest
import torch
from tiny import MIXED_BATCH, fresh_guard, tiny_guard
from transformers import TextGenerationPipeline, pipeline

from hf_lsad.capture.collect import encode_prompts
from hf_lsad.errors import GuardFormatError
from hf_lsad.generation.model import GUARDED_CONFIG, GuardedModelForCausalLM
from hf_lsad.generation.pipeline import GuardedTextGenerationPipeline
from hf_lsad.guard import SafetyReport


def test_pipeline_outputs_carry_the_reports():
    model, tokenizer, guard = tiny_guard()
    guarded = GuardedModelForCausalLM(model, guard, tokenizer=tokenizer)
    pipe = pipeline("text-generation", model=guarded, tokenizer=copy.deepcopy(tokenizer))
    assert isinstance(pipe, GuardedTextGenerationPipeline)
    settings = dict(max_new_tokens=5, do_sample=False, return_full_text=False)
    outputs = pipe(MIXED_BATCH, **settings)
    reference = guarded.generate(
        **encode_prompts(tokenizer, MIXED_BATCH, chat_template=False), max_new_tokens=5, do_sample=False
    )
    expected = guarded.last_safety
    assert len(outputs) == 3
    for out, want, row in zip(outputs, expected, reference):
        record = out[0]
        assert isinstance(record["safety"], SafetyReport)
        assert record["safety"].score == pytest.approx(want.score, abs=1e-4)
        assert (
            record["generated_text"]
            == tokenizer.decode(row[-5:], skip_special_tokens=True)[: len(record["generated_text"])]
        )
    batched = pipe(MIXED_BATCH, batch_size=2, **settings)
    for single, batch in zip(outputs, batched):
        assert batch[0]["safety"].score == pytest.approx(single[0]["safety"].score, abs=1e-4)


def test_pipeline_passes_guard_arguments_and_chat_input():
    model, tokenizer, _ = tiny_guard("prompt_last")
    guard = fresh_guard("prompt_last")
    guard.config.threshold = -1.0  # everything is flagged
    guarded = GuardedModelForCausalLM(model, guard, tokenizer=tokenizer)
    pipe = pipeline("text-generation", model=guarded, tokenizer=copy.deepcopy(tokenizer))
    out = pipe([{"role": "user", "content": "hello"}], max_new_tokens=5, do_sample=False, on_flag="stop", refusal="no.")
    refusal = tokenizer.decode(
        tokenizer("no.", add_special_tokens=False)["input_ids"]
    )  # the tiny tokenizer spaces chars
    assert out[0]["generated_text"][-1] == {"role": "assistant", "content": refusal}
    assert out[0]["safety"].stopped and out[0]["safety"].step == 0


def test_plain_models_get_the_plain_pipeline_behaviour():
    model, tokenizer, _ = tiny_guard()
    pipe = pipeline("text-generation", model=model, tokenizer=copy.deepcopy(tokenizer))
    assert isinstance(pipe, TextGenerationPipeline)
    out = pipe("hi", max_new_tokens=3, do_sample=False)
    assert "safety" not in out[0]


def test_missing_attributes_are_forwarded_to_the_wrapped_model():
    model, _tokenizer, guard = tiny_guard()
    guarded = GuardedModelForCausalLM(model, guard)
    assert guarded.can_generate() and guarded.dtype == model.dtype
    assert guarded.get_input_embeddings() is model.get_input_embeddings()
    assert guarded.main_input_name == model.main_input_name
    with pytest.raises(AttributeError):
        guarded.no_such_attribute  # noqa: B018 - the attribute access itself is what must raise


def save_tiny_model(folder):
    model, tokenizer, _ = tiny_guard()
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def assert_same_generation(a: GuardedModelForCausalLM, b: GuardedModelForCausalLM, tokenizer) -> None:
    inputs = encode_prompts(tokenizer, MIXED_BATCH)
    out_a = a.generate(**inputs, max_new_tokens=5, do_sample=False, return_dict_in_generate=True)
    out_b = b.generate(**inputs, max_new_tokens=5, do_sample=False, return_dict_in_generate=True)
    assert torch.equal(out_a.sequences, out_b.sequences)
    for x, y in zip(out_a.safety, out_b.safety):  # the reloaded model may use another attention kernel
        assert x.score == pytest.approx(y.score, abs=1e-4) and (x.flagged, x.cluster) == (y.flagged, y.cluster)


def test_save_pretrained_round_trip(tmp_path):
    _, tokenizer, guard = tiny_guard()
    folder = save_tiny_model(tmp_path / "tiny-llama")
    model = type(tiny_guard()[0]).from_pretrained(folder)
    guarded = GuardedModelForCausalLM(model, guard, allow_base_model_mismatch=True)
    guarded.save_pretrained(tmp_path / "guarded")
    assert (tmp_path / "guarded" / GUARDED_CONFIG).is_file() and (
        tmp_path / "guarded" / "guard" / "config.json"
    ).is_file()
    assert not list((tmp_path / "guarded").glob("*.safetensors"))  # a reference to the base model, not its weights
    loaded = GuardedModelForCausalLM.from_pretrained(tmp_path / "guarded", allow_base_model_mismatch=True)
    assert loaded.model.config.name_or_path == str(folder)
    assert_same_generation(guarded, loaded, tokenizer)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"guard": "../elsewhere"}, "guard is '../elsewhere', expected 'guard'"),
        ({"weights": "model.safetensors"}, "unknown config key(s) ['weights']"),
        ({"base_model_revision": 3}, "key 'base_model_revision' is 3 (int)"),
        ({"base_model": ""}, "base_model is empty"),
        ({"base_model_revision": ""}, "base_model_revision is empty"),
        ({"format_version": 99}, "format_version 99, expected 1: written by a newer hf-lsad, which reads it"),
        ({"format_version": 0}, "format_version 0, expected 1"),
    ],
)
def test_a_saved_guarded_model_is_read_strictly(tmp_path, change, message):
    """``guarded_model.json`` is checked like a guard's ``config.json``: a guard outside the folder, an unknown key
    or a value of the wrong type fails on load, naming the file, before any model is loaded."""
    model, _, guard = tiny_guard()
    GuardedModelForCausalLM(model, guard).save_pretrained(tmp_path / "guarded", base_model="unused/base")
    file = tmp_path / "guarded" / GUARDED_CONFIG
    file.write_text(json.dumps({**json.loads(file.read_text()), **change}))
    with pytest.raises(GuardFormatError, match=GUARDED_CONFIG) as caught:
        GuardedModelForCausalLM.from_pretrained(tmp_path / "guarded")
    assert message in str(caught.value)


def test_a_saved_guarded_model_without_a_revision_key_is_refused(tmp_path):
    model, _, guard = tiny_guard()
    GuardedModelForCausalLM(model, guard).save_pretrained(tmp_path / "guarded", base_model="unused/base")
    file = tmp_path / "guarded" / GUARDED_CONFIG
    written = json.loads(file.read_text())
    assert written == {"format_version": 1, "base_model": "unused/base", "base_model_revision": None, "guard": "guard"}
    del written["base_model_revision"]
    file.write_text(json.dumps(written))
    with pytest.raises(GuardFormatError, match=r"missing config key\(s\) \['base_model_revision'\]"):
        GuardedModelForCausalLM.from_pretrained(tmp_path / "guarded")


def test_push_to_hub_round_trip(hub_server, hub_cache, tmp_path):
    _, tokenizer, guard = tiny_guard()
    base_repo = f"hf-lsad-org/tiny-llama-{uuid.uuid4().hex[:8]}"
    model = tiny_guard()[0]
    model.push_to_hub(base_repo)
    tokenizer.push_to_hub(base_repo)
    base = type(model).from_pretrained(base_repo, cache_dir=hub_cache)
    guarded = GuardedModelForCausalLM(base, guard, allow_base_model_mismatch=True)
    repo_id = f"hf-lsad-org/guarded-{uuid.uuid4().hex[:8]}"
    commit = guarded.push_to_hub(repo_id)
    loaded = GuardedModelForCausalLM.from_pretrained(
        repo_id,
        guard_kwargs={"revision": commit.oid, "cache_dir": hub_cache},
        cache_dir=hub_cache,
        allow_base_model_mismatch=True,
    )
    assert loaded.model.config.name_or_path == base_repo
    assert_same_generation(guarded, loaded, tokenizer)


def test_from_pretrained_of_a_folder_without_the_reference_is_a_clear_error(tmp_path):
    _, _, guard = tiny_guard()
    guard.save_pretrained(tmp_path / "just-a-guard")
    with pytest.raises(FileNotFoundError, match="pass guard="):
        GuardedModelForCausalLM.from_pretrained(tmp_path / "just-a-guard")


@pytest.mark.filterwarnings("ignore:guard was fitted on base model")
@pytest.mark.parametrize("saved", [False, True], ids=["with a guard", "saved guarded model"])
def test_a_gguf_file_loads_with_its_tokenizer_as_load_model_loads_it(tmp_path, monkeypatch, saved):
    """``from_pretrained(gguf, guard=...)`` loads what ``load_model`` loads (the bundled SmolLM2's path too):
    transformers' ``from_pretrained`` cannot read a ``.gguf`` path, and the tokenizer comes with it."""
    from tiny_gguf import write_tiny_gguf

    from hf_lsad.capture.gguf import CACHE_ENV
    from hf_lsad.capture.pretrained import load_model

    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    gguf = write_tiny_gguf(tmp_path / "tiny.gguf")
    guard = fresh_guard("prompt_last")
    if saved:
        model, _ = load_model(str(gguf))
        GuardedModelForCausalLM(model, guard, allow_base_model_mismatch=True).save_pretrained(tmp_path / "guarded")
        loaded = GuardedModelForCausalLM.from_pretrained(tmp_path / "guarded", allow_base_model_mismatch=True)
    else:
        loaded = GuardedModelForCausalLM.from_pretrained(gguf, guard=guard, allow_base_model_mismatch=True)
    model, tokenizer = load_model(str(gguf))
    assert loaded.model.config.name_or_path == str(gguf)
    assert loaded.tokenizer is not None and loaded.tokenizer("the cat").input_ids == tokenizer("the cat").input_ids
    reference, state = model.state_dict(), loaded.model.state_dict()
    assert all(torch.equal(state[name], reference[name]) for name in reference)
    inputs = encode_prompts(tokenizer, ["the cat", "hello there"])
    output = loaded.generate(
        **inputs, max_new_tokens=3, do_sample=False, on_flag="stop", refusal="no", return_dict_in_generate=True
    )
    assert len(output.safety) == 2
