"""hf_lsad.core.prompt_inputs: guards record how their prompts were formatted and how long they were; generate warns on
inputs unlike them."""

from __future__ import annotations

import copy
import json
import warnings

import pytest
import torch
from tiny import LAYER, MIXED_BATCH, PROMPTS, fresh_guard, tiny_guard

from hf_lsad import GuardedModelForCausalLM
from hf_lsad.capture.collect import collect_activations, collect_prompt_features, encode_prompts
from hf_lsad.core.hook_point import HookPoint
from hf_lsad.core.prompt_inputs import LONG_PROMPT_FACTOR, InputProfile, input_warnings, template_markers
from hf_lsad.data.store import ActivationStore, load_activations, save_activations
from hf_lsad.errors import GuardFormatError, GuardMismatchError
from hf_lsad.guard import SafetyGuard
from hf_lsad.guard.fitting import fit_guard


def guarded_with(profile: InputProfile | None) -> tuple[GuardedModelForCausalLM, object]:
    model, tokenizer, _ = tiny_guard("prompt_last")
    guard = fresh_guard("prompt_last")
    guard.inputs = profile
    return GuardedModelForCausalLM(model, guard, tokenizer=tokenizer), tokenizer


def generate_warnings(guarded: GuardedModelForCausalLM, inputs: dict) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        guarded.generate(**inputs, max_new_tokens=1, do_sample=False)
    return [str(w.message) for w in caught if any(kind in str(w.message) for kind in INPUT_WARNINGS)]


INPUT_WARNINGS = ("fitting prompts", "longest prompt", "another system turn", "the pad token")


def test_template_markers_of_the_tiny_chat_template():
    _, tokenizer, _ = tiny_guard("prompt_last")
    markers = template_markers(tokenizer)
    assert markers.start == tokenizer.convert_tokens_to_ids("<|user|>")
    assert markers.generation_prompt == (tokenizer.convert_tokens_to_ids("<|assistant|>"),)
    plain = copy.deepcopy(tokenizer)
    plain.chat_template = None
    assert template_markers(plain) is None


def test_collection_records_the_profile_and_the_fitted_guard_keeps_it(tmp_path):
    model, tokenizer, _ = tiny_guard("prompt_last")
    collected = collect_activations(model, tokenizer, PROMPTS[:20], layer=LAYER, position="prompt_last", progress=False)
    longest = max(int(encode_prompts(tokenizer, [p])["attention_mask"].sum()) for p in PROMPTS[:20])
    assert collected.inputs == InputProfile("chat_template", longest)
    raw = collect_activations(
        model, tokenizer, PROMPTS[:4], layer=LAYER, position="prompt_last", chat_template=False, progress=False
    )
    assert raw.inputs.prompt_format == "raw"

    hook = HookPoint.from_model(model, LAYER, "prompt_last", base_model="tiny-llama")
    records = [{"id": str(i)} for i in range(20)]
    save_activations(tmp_path / "store", collected.activations, records, hook, inputs=collected.inputs)
    assert load_activations(tmp_path / "store").inputs == collected.inputs
    store = ActivationStore(tmp_path / "store")
    assert store.inputs == collected.inputs
    guard = fit_guard(store, hook, "mahalanobis", _mahalanobis_config(), None, progress=False).guard
    assert guard.inputs == collected.inputs
    guard.save_pretrained(tmp_path / "guard")
    assert SafetyGuard.from_pretrained(tmp_path / "guard").inputs == collected.inputs


def _mahalanobis_config():
    from hf_lsad.detectors import detector_class

    return detector_class("mahalanobis").config_class()


def test_a_store_without_a_profile_gives_a_guard_without_one(tmp_path):
    model, _, _ = tiny_guard("prompt_last")
    hook = HookPoint.from_model(model, LAYER, "prompt_last", base_model="tiny-llama")
    save_activations(tmp_path / "store", torch.randn(30, hook.hidden_size), [{"id": str(i)} for i in range(30)], hook)
    guard = fit_guard(
        ActivationStore(tmp_path / "store"), hook, "mahalanobis", _mahalanobis_config(), None, progress=False
    )
    assert guard.guard.inputs is None
    guarded = GuardedModelForCausalLM(model, guard.guard, tokenizer=tiny_guard("prompt_last")[1])
    assert generate_warnings(guarded, encode_prompts(guarded.tokenizer, ["no profile, no check"])) == []


def test_templated_prompts_pass_and_raw_ones_warn():
    guarded, tokenizer = guarded_with(InputProfile("chat_template", 200))
    assert generate_warnings(guarded, encode_prompts(tokenizer, MIXED_BATCH)) == []
    raw = dict(tokenizer(MIXED_BATCH, padding=True, return_tensors="pt"))  # how a transformers user often tokenizes
    (message,) = generate_warnings(guarded, raw)
    assert "rows [0, 1, 2]" in message and "'<|assistant|>'" in message and "apply_chat_template" in message


def test_template_without_generation_prompt_warns():
    guarded, tokenizer = guarded_with(InputProfile("chat_template", 200))
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False) for p in MIXED_BATCH]
    inputs = dict(tokenizer(texts, padding=True, padding_side="left", return_tensors="pt", add_special_tokens=False))
    (message,) = generate_warnings(guarded, inputs)
    assert "rows [0, 1, 2]" in message


def test_raw_guard_warns_on_templated_prompts_only():
    guarded, tokenizer = guarded_with(InputProfile("raw", 200))
    assert generate_warnings(guarded, encode_prompts(tokenizer, MIXED_BATCH, chat_template=False)) == []
    (message,) = generate_warnings(guarded, encode_prompts(tokenizer, MIXED_BATCH))
    assert "fitted on raw prompts" in message


def test_prompts_far_longer_than_in_fitting_warn_with_the_numbers():
    guarded, tokenizer = guarded_with(InputProfile("chat_template", 20))
    inputs = encode_prompts(tokenizer, ["short", "x" * 60])
    (message,) = generate_warnings(guarded, inputs)
    assert "rows [1]" in message and "20 tokens" in message and f"{LONG_PROMPT_FACTOR:g}x" in message
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        screened = guarded.screen(["x" * 60])
    assert len(screened) == 1 and any("longest prompt" in str(w.message) for w in caught)


@pytest.mark.parametrize("side", ["left", "right"])
def test_a_padded_batch_without_its_attention_mask_warns_that_the_padding_is_read(side):
    guarded, tokenizer = guarded_with(None)  # a guard with no recorded profile warns too
    inputs = encode_prompts(tokenizer, MIXED_BATCH, padding_side=side)
    padded = (inputs["attention_mask"] == 0).any(1).nonzero().flatten().tolist()
    assert padded  # the shorter rows carry padding on that side
    (message,) = generate_warnings(guarded, {"input_ids": inputs["input_ids"]})
    assert f"rows {padded} open or close with the pad token (id {tokenizer.pad_token_id})" in message
    assert generate_warnings(guarded, dict(inputs)) == []  # with its mask, the padding is not read
    one = encode_prompts(tokenizer, MIXED_BATCH[:1])  # one row holds no padding: transformers' own rule
    assert generate_warnings(guarded, {"input_ids": one["input_ids"]}) == []


def test_right_padding_is_read_between_the_real_tokens():
    _, tokenizer, _ = tiny_guard("prompt_last")
    markers = template_markers(tokenizer)
    left = encode_prompts(tokenizer, MIXED_BATCH)
    texts = [
        tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False)
        for p in MIXED_BATCH
    ]
    right = tokenizer(texts, padding=True, padding_side="right", return_tensors="pt", add_special_tokens=False)
    profile = InputProfile("chat_template", 200)
    assert input_warnings(profile, markers, left["input_ids"], left["attention_mask"]) == []
    assert input_warnings(profile, markers, right["input_ids"], right["attention_mask"]) == []


def test_encode_prompts_gives_the_two_generation_inputs_padded_and_placed():
    _, tokenizer, _ = tiny_guard("prompt_last")
    for side in ("left", "right"):
        inputs = encode_prompts(tokenizer, MIXED_BATCH, padding_side=side, device="meta")
        assert set(inputs) == {"input_ids", "attention_mask"}  # nothing else goes to generate(**inputs)
        assert inputs["input_ids"].device.type == inputs["attention_mask"].device.type == "meta"
        on_cpu = encode_prompts(tokenizer, MIXED_BATCH, padding_side=side)
        assert on_cpu["input_ids"].device.type == "cpu" and on_cpu["input_ids"].shape == inputs["input_ids"].shape
        lengths = on_cpu["attention_mask"].sum(1)
        assert len(set(lengths.tolist())) > 1  # a batch of several lengths, so padding shows
        pads = on_cpu["attention_mask"][:, 0 if side == "left" else -1] == 0
        assert bool(pads[lengths < lengths.max()].all())  # the shorter rows are padded on that side
    with pytest.raises(ValueError, match="padding_side"):
        encode_prompts(tokenizer, MIXED_BATCH, padding_side="middle")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "inputs, key",
    [
        ({"prompt_format": "html", "max_prompt_tokens": 5}, "prompt_format"),
        ({"prompt_format": "raw", "max_prompt_tokens": "5"}, "max_prompt_tokens"),
        ({"prompt_format": "raw", "max_prompt_tokens": 0}, "max_prompt_tokens"),
        ({"prompt_format": "raw"}, "max_prompt_tokens"),
        ({"prompt_format": "raw", "max_prompt_tokens": 5, "extra": 1}, "extra"),
        ({"prompt_format": "raw", "max_prompt_tokens": 5, "system": "You are terse."}, "system"),
        ({"prompt_format": "chat_template", "max_prompt_tokens": 5, "system": " "}, "system"),
        ({"prompt_format": "chat_template", "max_prompt_tokens": 5, "system": 3}, "system"),
    ],
)
def test_bad_inputs_block_fails_at_load_naming_the_key(tmp_path, inputs, key):
    guard = fresh_guard("prompt_last")
    guard.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["inputs"] = inputs
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(GuardFormatError, match=key):
        SafetyGuard.from_pretrained(tmp_path)


def test_an_edited_profile_is_an_integrity_mismatch(tmp_path):
    guard = fresh_guard("prompt_last")
    guard.inputs = InputProfile("chat_template", 40)
    guard.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["inputs"]["prompt_format"] = "raw"
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(GuardMismatchError, match="inputs"):
        SafetyGuard.from_pretrained(tmp_path)


def test_encode_prompts_puts_a_system_turn_before_each_user_turn():
    _, tokenizer, _ = tiny_guard("prompt_last")
    with_system = encode_prompts(tokenizer, ["hello there", "hi"], system="You are terse.")
    plain = encode_prompts(tokenizer, ["hello there", "hi"])
    first = tokenizer.decode(with_system["input_ids"][0], skip_special_tokens=False).replace(" ", "")
    assert first.startswith("<|system|>Youareterse.<|end|><|user|>hellothere")
    assert with_system["input_ids"].shape[1] > plain["input_ids"].shape[1]
    with pytest.raises(ValueError, match="needs the tokenizer's chat template"):
        encode_prompts(tokenizer, ["hello"], chat_template=False, system="You are terse.")
    with pytest.raises(ValueError, match="non-empty string"):
        encode_prompts(tokenizer, ["hello"], system="  ")


SYSTEM = "You are the support assistant of a bank."


def test_rows_under_another_system_turn_than_the_thresholds_warn():
    guarded, tokenizer = guarded_with(InputProfile("chat_template", 200))
    assert generate_warnings(guarded, encode_prompts(tokenizer, [*MIXED_BATCH, "\nstarts with a newline"])) == []
    (message,) = generate_warnings(guarded, encode_prompts(tokenizer, MIXED_BATCH, system=SYSTEM))
    assert "rows [0, 1, 2]" in message and "the chat template's default" in message and "--system" in message

    guarded.guard.inputs = InputProfile("chat_template", 200, SYSTEM)  # thresholds set under the bank's turn
    assert generate_warnings(guarded, encode_prompts(tokenizer, MIXED_BATCH, system=SYSTEM)) == []
    (message,) = generate_warnings(guarded, encode_prompts(tokenizer, MIXED_BATCH))
    assert "rows [0, 1, 2]" in message and repr(SYSTEM) in message
    other = encode_prompts(tokenizer, MIXED_BATCH[:1], system="You are a pirate.")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        guarded.screen(other["input_ids"], other["attention_mask"])
    assert any("another system turn" in str(w.message) for w in caught)


def test_screen_formats_strings_under_a_system_turn_as_encode_prompts_does():
    guarded, tokenizer = guarded_with(InputProfile("chat_template", 200, SYSTEM))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # under the guard's own turn: nothing to warn about
        by_text = guarded.screen(MIXED_BATCH, system=SYSTEM)
    inputs = encode_prompts(tokenizer, MIXED_BATCH, system=SYSTEM)
    by_ids = guarded.screen(inputs["input_ids"], inputs["attention_mask"])
    assert [r.score for r in by_text] == pytest.approx([r.score for r in by_ids], abs=1e-5)
    default = guarded_with(InputProfile("chat_template", 200))[0].screen(MIXED_BATCH)
    assert [r.score for r in by_text] != pytest.approx([r.score for r in default], abs=1e-3)
    with pytest.raises(ValueError, match="formatted already"):
        guarded.screen(inputs["input_ids"], inputs["attention_mask"], system=SYSTEM)


def test_a_profile_records_its_system_turn_and_older_ones_load_without(tmp_path):
    model, tokenizer, _ = tiny_guard("prompt_last")
    _, profile = collect_prompt_features(model, tokenizer, PROMPTS[:4], [(LAYER, "prompt_last")], system=SYSTEM)
    assert profile.system == SYSTEM and profile.prompt_format == "chat_template"
    guard = fresh_guard("prompt_last")
    guard.inputs = profile
    guard.save_pretrained(tmp_path / "guard")
    assert SafetyGuard.from_pretrained(tmp_path / "guard").inputs == profile
    older = {"prompt_format": "chat_template", "max_prompt_tokens": 40}  # written before the field existed
    assert InputProfile.from_dict(older, source="old") == InputProfile("chat_template", 40, None)
    with pytest.raises(ValueError, match="chat_template"):
        InputProfile("raw", 40, SYSTEM)
