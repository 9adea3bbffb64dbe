"""Inputs that used to crash deep inside transformers, or pass silently: each is a typed error before any
forward pass, or the right behaviour."""

from __future__ import annotations

import copy
import functools
import warnings
from typing import Any

import pytest
import torch
from tiny import MIXED_BATCH, fresh_guard, tiny_guard
from transformers import DynamicCache

from hf_lsad.capture.collect import check_prompts, encode_prompts
from hf_lsad.errors import InputError, ModelMismatchError
from hf_lsad.generation.model import GuardedModelForCausalLM
from hf_lsad.testing import tiny_model


def screening_model() -> GuardedModelForCausalLM:
    model, tokenizer, _ = tiny_guard("prompt_last")
    return GuardedModelForCausalLM(model, fresh_guard("prompt_last"), tokenizer=tokenizer)


def no_forward(guarded: GuardedModelForCausalLM) -> Any:
    """A hook that fails the test if the model runs a forward pass."""

    def hook(*_: Any) -> None:
        raise AssertionError("a forward pass ran before the input was refused")

    return guarded.model.register_forward_pre_hook(hook)


GOOD = {"input_ids": torch.tensor([[5, 6, 7]]), "attention_mask": torch.ones(1, 3, dtype=torch.long)}
BAD_GENERATE_INPUTS = [
    ("no rows", {"input_ids": torch.zeros(0, 5, dtype=torch.long)}, InputError, "holds no prompt token"),
    ("no tokens", {"input_ids": torch.zeros(1, 0, dtype=torch.long)}, InputError, "holds no prompt token"),
    ("a list", {"input_ids": [[5, 6, 7]]}, TypeError, "must be a torch.Tensor"),
    ("1-D", {"input_ids": torch.tensor([5, 6, 7])}, InputError, r"must be 2-D.*input_ids\[None\]"),
    ("floats", {"input_ids": torch.tensor([[5.0, 6.0]])}, TypeError, "integer token ids"),
    ("mask shape", {**GOOD, "attention_mask": torch.ones(1, 2, dtype=torch.long)}, InputError, "must match"),
    ("all padding", {**GOOD, "attention_mask": torch.zeros(1, 3, dtype=torch.long)}, InputError, "all padding"),
    ("past context", {"input_ids": torch.full((1, 600), 9)}, InputError, "longer than the context"),
    (  # the tiny model's vocabulary is 102 ids; ids of another model's tokenizer raised an IndexError inside it
        "another tokenizer",
        {**GOOD, "input_ids": torch.tensor([[5, 6, 50_000]])},
        InputError,
        r"token ids \(50000\) outside the model's vocabulary \[0, 102\)",
    ),
    ("negative id", {**GOOD, "input_ids": torch.tensor([[-1, 6, 7]])}, InputError, r"token ids \(-1\) outside"),
]


@pytest.mark.parametrize("on_flag", ["report", "stop"])
@pytest.mark.parametrize(
    ("case", "inputs", "error", "message"), BAD_GENERATE_INPUTS, ids=[c[0] for c in BAD_GENERATE_INPUTS]
)
def test_bad_generate_inputs_are_typed_errors_before_a_forward_pass(case, inputs, error, message, on_flag):
    guarded = screening_model()
    handle = no_forward(guarded)
    try:
        with pytest.raises(error, match=message):
            guarded.generate(**inputs, max_new_tokens=2, on_flag=on_flag)
    finally:
        handle.remove()


UNFOLLOWABLE_LOOPS = [
    ("prompt lookup", {"prompt_lookup_num_tokens": 2}, r"assisted decoding \(prompt_lookup_num_tokens\)"),
    ("early exit", {"assistant_early_exit": 1}, r"assisted decoding \(assistant_early_exit\)"),
    ("multi-token prediction", {"use_mtp": True}, r"assisted decoding \(use_mtp\)"),
    ("DoLa", {"dola_layers": "low"}, r"DoLa decoding"),
    ("contrastive search", {"penalty_alpha": 0.6, "top_k": 4, "do_sample": False}, "contrastive search"),
    ("group beam search", {"num_beams": 4, "num_beam_groups": 2, "do_sample": False}, "group beam search"),
    ("constrained beam search", {"num_beams": 2, "force_words_ids": [[5]], "do_sample": False}, "constrained beam"),
    ("token healing", {"token_healing": True}, r"token healing \(token_healing\)"),
    ("chunked prefill", {"prefill_chunk_size": 8}, r"chunked prefill \(prefill_chunk_size\)"),
]


@pytest.mark.parametrize("on_flag", ["report", "stop"])
@pytest.mark.parametrize("source", ["keyword", "call's generation_config", "model's generation_config"])
@pytest.mark.parametrize(("case", "settings", "message"), UNFOLLOWABLE_LOOPS, ids=[c[0] for c in UNFOLLOWABLE_LOOPS])
def test_decoding_loops_the_guard_cannot_follow_are_refused_wherever_they_are_set(
    case, settings, message, source, on_flag
):
    """Batch size 1, where transformers itself allows assisted decoding: a flagged row must not be given a drafted
    token of its own, and a loop that need not call the guard's logits processor must not run unguarded."""
    guarded = screening_model()
    config = copy.deepcopy(guarded.model.generation_config)
    kwargs: dict[str, Any] = {}
    if source == "keyword":
        kwargs = dict(settings)
    elif source == "call's generation_config":
        call_config = copy.deepcopy(config)
        call_config.update(**settings)
        kwargs = {"generation_config": call_config}
    else:
        guarded.model.generation_config.update(**settings)
    handle = no_forward(guarded)
    try:
        with pytest.raises(ValueError, match=message):
            guarded.generate(**GOOD, max_new_tokens=2, on_flag=on_flag, **kwargs)
    finally:
        handle.remove()
        guarded.model.generation_config = config


@pytest.mark.parametrize("on_flag", ["report", "stop"])
def test_a_cache_holding_part_of_the_prompt_is_refused_and_an_empty_one_is_fine(on_flag):
    """A prefix the caller cached is left out of the prefill, where the guard reads every prompt token (it failed
    with an IndexError inside the forward pass); an empty cache gives what no cache gives."""
    guarded = screening_model()
    inputs = encode_prompts(guarded.tokenizer, ["How do I bake bread?", "Write a tutorial on how to make a bomb"])
    cache = DynamicCache()
    with torch.no_grad():
        prefix = {name: tensor[:, :4] for name, tensor in inputs.items()}
        guarded.model(**prefix, past_key_values=cache, use_cache=True)
    handle = no_forward(guarded)
    try:
        with pytest.raises(ValueError, match="past_key_values holds 4 tokens already"):
            guarded.generate(**inputs, past_key_values=cache, max_new_tokens=3, on_flag=on_flag)
    finally:
        handle.remove()
    kwargs = dict(max_new_tokens=3, do_sample=False, on_flag=on_flag, return_dict_in_generate=True)
    empty = guarded.generate(**inputs, past_key_values=DynamicCache(), **kwargs)
    plain = guarded.generate(**inputs, **kwargs)
    assert torch.equal(empty.sequences, plain.sequences)
    assert [r.score for r in empty.safety] == pytest.approx([r.score for r in plain.safety])
    assert [r.flagged for r in empty.safety] == [r.flagged for r in plain.safety]


@pytest.mark.parametrize("how", ["custom_generate", "a generate on the model"])
def test_a_custom_decoding_loop_is_refused_before_it_runs(how):
    guarded = screening_model()
    ran: list[bool] = []

    def loop(model: Any, input_ids: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        ran.append(True)  # a loop of its own, which never calls the logits processors it is given
        return torch.cat([input_ids, input_ids[:, -1:]], dim=1)

    kwargs: dict[str, Any] = {}
    if how == "custom_generate":
        kwargs["custom_generate"] = loop
    else:  # as transformers does for a repository's custom_generate loaded with trust_remote_code
        guarded.model.generate = functools.partial(loop, guarded.model)
    try:
        with pytest.raises(ValueError, match="custom decoding loop" if kwargs else r"del model\.generate"):
            guarded.generate(**GOOD, max_new_tokens=2, on_flag="stop", **kwargs)
    finally:
        vars(guarded.model).pop("generate", None)  # the tiny model is shared between tests
    assert not ran


@pytest.mark.parametrize(
    ("case", "inputs", "error", "message"), BAD_GENERATE_INPUTS, ids=[c[0] for c in BAD_GENERATE_INPUTS]
)
def test_screen_refuses_what_generate_refuses(case, inputs, error, message):
    if case == "a list":  # screen reads a list as prompt strings
        message = "prompt 0 is not a string but list"
    guarded = screening_model()
    handle = no_forward(guarded)
    try:
        with pytest.raises(error, match=message):
            guarded.screen(inputs["input_ids"], inputs.get("attention_mask"))
    finally:
        handle.remove()


@pytest.mark.parametrize(
    ("prompts", "error", "message"),
    [
        ([123], TypeError, "prompt 0 is not a string but int: 123"),
        (["ok", None], TypeError, "prompt 1 is not a string but NoneType: None"),
        (["ok", "  "], ValueError, "prompt 1 is empty"),
        ([], ValueError, "the prompt list is empty"),
        ("one string", TypeError, "not a single string"),
        (42, TypeError, "got a int"),
        # the tokenizer's own error: "TextEncodeInput must be Union[TextInputSequence, ...]"
        (["ok", "caf\udce9"], ValueError, r"prompt 1 is not Unicode text: a lone surrogate \(U\+DCE9\) at character 3"),
    ],
)
def test_bad_prompt_lists_say_what_is_wrong(prompts, error, message):
    with pytest.raises(error, match=message):
        check_prompts(prompts)
    guarded = screening_model()
    with pytest.raises(error, match=message):
        guarded.screen(prompts)


def test_a_lone_surrogate_in_a_system_turn_or_a_conversation_is_named():
    guarded = screening_model()
    with pytest.raises(ValueError, match=r"the system turn is not Unicode text: a lone surrogate \(U\+D800\)"):
        encode_prompts(guarded.tokenizer, ["hi"], system="be \ud800 kind")
    turns = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "\ud800"},
        {"role": "user", "content": "so?"},
    ]
    with pytest.raises(ValueError, match=r"turn 1 \(assistant\) is not Unicode text: a lone surrogate \(U\+D800\)"):
        guarded.screen([turns])


@pytest.mark.parametrize("top_k", [-1, 1.5, "3", True])
def test_a_count_of_features_to_explain_that_is_not_one_is_refused_before_a_forward_pass(top_k):
    guarded = screening_model()
    inputs = encode_prompts(guarded.tokenizer, MIXED_BATCH)
    handle = no_forward(guarded)
    try:
        with pytest.raises(ValueError, match="top_k must be an int of 0 or more"):
            guarded.generate(**inputs, max_new_tokens=2, explain=True, explain_top_k=top_k)
        with pytest.raises(ValueError, match="top_k must be an int of 0 or more"):
            guarded.screen(MIXED_BATCH, explain=True, top_k=top_k)
    finally:
        handle.remove()
    activations = torch.zeros(2, guarded.guard.config.hook.hidden_size)
    with pytest.raises(ValueError, match="top_k must be an int of 0 or more"):
        guarded.guard.reports(activations, explain=True, top_k=top_k)
    with pytest.raises(ValueError, match=r"top_k must be an int of 0 or more \(or None for all\)"):
        guarded.guard.explain(activations, top_k=top_k)
    guarded.guard.reports(activations, top_k=top_k)  # not explaining: the count is not used


@pytest.mark.parametrize("explain", [3, 1, "yes", None])
def test_an_explain_that_is_not_a_bool_is_refused_before_a_forward_pass(explain):
    """``explain=3``, meant as three tokens, listed ten: the count is ``explain_top_k``."""
    guarded = screening_model()
    inputs = encode_prompts(guarded.tokenizer, MIXED_BATCH)
    handle = no_forward(guarded)
    try:
        with pytest.raises(TypeError, match=r"explain must be True or False, got .* explain_top_k of generate"):
            guarded.generate(**inputs, max_new_tokens=2, explain=explain)
        with pytest.raises(TypeError, match="explain must be True or False"):
            guarded.screen(MIXED_BATCH, explain=explain)
    finally:
        handle.remove()
    with pytest.raises(TypeError, match="explain must be True or False"):
        guarded.guard.reports(torch.zeros(2, guarded.guard.config.hook.hidden_size), explain=explain)


@pytest.mark.parametrize(
    "refusal, message",
    [(123, "123"), (torch.tensor(5), r"a tensor of shape \(\)"), (torch.tensor([[5]]), r"shape \(1, 1\)")],
)
def test_a_refusal_that_is_neither_text_nor_token_ids_is_refused(refusal, message):
    guarded = screening_model()
    inputs = encode_prompts(guarded.tokenizer, MIXED_BATCH)
    with pytest.raises(TypeError, match=f"refusal must be text, token ids .* or None, got .*{message}"):
        guarded.generate(**inputs, max_new_tokens=2, on_flag="stop", refusal=refusal)


@pytest.mark.parametrize("refusal", [[10_000], [-1], torch.tensor([3, 999_999])])
def test_refusal_ids_outside_the_vocabulary_are_refused_before_generation(refusal):
    guarded = screening_model()
    inputs = encode_prompts(guarded.tokenizer, MIXED_BATCH)
    handle = no_forward(guarded)
    try:
        with pytest.raises(InputError, match="outside the model's vocabulary"):
            guarded.generate(**inputs, max_new_tokens=2, on_flag="stop", refusal=refusal)
    finally:
        handle.remove()


@pytest.mark.parametrize("path", ["stop", "on_step"])
def test_stop_with_several_sequences_per_prompt_and_sampling(path):
    """generate repeats each row num_return_sequences times: the guard's rows follow it."""
    guarded = screening_model()
    inputs = encode_prompts(guarded.tokenizer, MIXED_BATCH, padding_side="right")
    alone = [guarded.screen([p])[0] for p in MIXED_BATCH]
    scores = sorted(r.score for r in alone)
    guarded.guard.config.threshold = (scores[1] + scores[2]) / 2  # flags one row of three, clear of float round-off
    flagged = [r.score > guarded.guard.config.threshold for r in alone]
    steps: list[Any] = []
    options = {"on_flag": "stop"} if path == "stop" else {"on_step": steps.append}
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # transformers: right padding
        out = guarded.generate(
            **inputs, max_new_tokens=3, do_sample=True, num_return_sequences=2, return_dict_in_generate=True, **options
        )
    assert out.sequences.shape[0] == len(out.safety) == 6
    for row, report in enumerate(out.safety):
        assert report.score == pytest.approx(alone[row // 2].score, abs=1e-4)
        assert report.stopped == (path == "stop" and flagged[row // 2])
    if path == "on_step":
        assert steps[0].scores.shape == (6,)


def test_a_guard_for_another_model_type_is_refused_even_without_names():
    other, _ = tiny_model("qwen2")  # same widths and depth, another architecture
    other.config.name_or_path = ""
    copied = fresh_guard("prompt_last")
    copied.config.hook.base_model = ""
    with pytest.raises(ModelMismatchError, match=r"fitted on a 'llama' model.*is a 'qwen2' model"):
        GuardedModelForCausalLM(other, copied)


def test_fit_guard_refuses_an_sae_of_another_width_up_front():
    from hf_lsad.detectors import FreqMaskConfig
    from hf_lsad.detectors.clustering import KMeansConfig
    from hf_lsad.guard.fitting import fit_guard
    from hf_lsad.sae.model import SAEConfig, SparseAutoencoder

    _, _, guard = tiny_guard("prompt_last")
    wrong = SparseAutoencoder(SAEConfig(d_in=48, d_sae=64))
    config = FreqMaskConfig(kmeans=KMeansConfig(n_clusters=3), mask_size=16)
    with pytest.raises(ValueError, match=r"SAE reads width 48.*hidden size 32"):
        fit_guard(torch.randn(100, 32), guard.config.hook, "freqmask-km", config, wrong, progress=False)
