"""A model running peft adapters: read with them, named by their weights, and warned about when the guard's
thresholds were set without them (:mod:`hf_lsad.capture.adapters`, :func:`hf_lsad.capture.pretrained.load_model`)."""

from __future__ import annotations

import json
import shutil
import warnings

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from tiny import MIXED_BATCH, PROMPTS, two_headed_guard
from transformers import AutoModelForCausalLM
from transformers.utils import find_adapter_config_file

from hf_lsad import (
    AdapterWarning,
    GuardedModelForCausalLM,
    ModelMismatchError,
    SafetyGuard,
    encode_prompts,
    fit_budget_on_prompts,
)
from hf_lsad.capture.adapters import adapter_digest
from hf_lsad.capture.pretrained import load_model, load_tokenizer
from hf_lsad.cli.main import entry
from hf_lsad.core.prompt_inputs import InputProfile
from hf_lsad.guard.heads.bundled import bundled_features, release_rows
from hf_lsad.testing import tiny_model

LORA_TARGETS = ["q_proj", "v_proj"]


def adapted(seed: int, *, identity: bool = False, name: str = "default") -> PeftModel:
    """A fresh tiny model (the tiny guards' base) under a LoRA adapter: ``identity`` starts it as peft does (its
    ``B`` at zero: the base model's outputs), else with weights drawn from ``seed``."""
    model, _ = tiny_model("llama", seed=0)
    torch.manual_seed(seed)
    config = LoraConfig(target_modules=LORA_TARGETS, r=4, init_lora_weights=identity)
    return get_peft_model(model, config, adapter_name=name).eval()


def guarded_reports(model, guard, tokenizer, *, mismatch: bool) -> list:
    """The reports of a stopping ``generate`` through ``model``; with a ``mismatch`` of adapters, refused unless
    allowed, and then with a warning."""
    if mismatch:
        with pytest.raises(ModelMismatchError, match="pass allow_adapter_mismatch=True"):
            GuardedModelForCausalLM(model, guard, tokenizer=tokenizer)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        guarded = GuardedModelForCausalLM(model, guard, tokenizer=tokenizer, allow_adapter_mismatch=mismatch)
    assert any(issubclass(w.category, AdapterWarning) for w in caught) == mismatch
    inputs = encode_prompts(tokenizer, MIXED_BATCH)
    out = guarded.generate(**inputs, max_new_tokens=3, do_sample=False, return_dict_in_generate=True, on_flag="stop")
    return out.safety


def head_scores(reports) -> torch.Tensor:
    return torch.tensor([[head.score for head in report.heads] for report in reports])


def test_a_peft_model_is_read_through_its_adapter_and_refused_at_thresholds_set_without_it():
    """A ``PeftModel`` was refused ("cannot locate the decoder layers of PeftModel"); a model with adapters loaded
    by transformers was guarded silently, at thresholds set on the model without them."""
    base, tokenizer = tiny_model("llama", seed=0)
    guard = two_headed_guard()
    plain = guarded_reports(base, guard, tokenizer, mismatch=False)
    identity = guarded_reports(adapted(0, identity=True), guard, tokenizer, mismatch=True)
    assert torch.allclose(head_scores(identity), head_scores(plain), atol=1e-6)  # the same blocks, read alike
    changed = guarded_reports(adapted(1), guard, tokenizer, mismatch=True)
    assert not torch.allclose(head_scores(changed), head_scores(plain), atol=1e-3)  # the adapter's residual stream
    model = adapted(1)
    with model.disable_adapter():
        assert adapter_digest(model) is None
        disabled = guarded_reports(model, guard, tokenizer, mismatch=False)
        assert torch.allclose(head_scores(disabled), head_scores(plain))


def test_thresholds_set_through_an_adapter_record_it_and_guard_that_model_alone(tmp_path):
    _, tokenizer = tiny_model("llama", seed=0)
    model, guard = adapted(1), two_headed_guard()
    budget = fit_budget_on_prompts(model, tokenizer, guard, PROMPTS, target_fpr=0.25, confidence=None, progress=False)
    digest = adapter_digest(model)
    assert digest is not None and guard.inputs.adapter == digest and digest[:19] in budget.rows
    guarded_reports(model, guard, tokenizer, mismatch=False)
    with pytest.raises(
        ModelMismatchError, match=r"set through the peft adapter sha256:\w{12}, which this model does not run"
    ):
        GuardedModelForCausalLM(tiny_model("llama", seed=0)[0], guard)
    with pytest.raises(
        ModelMismatchError, match=r"runs the peft adapter sha256:.*; the guard's thresholds were set through another"
    ):
        GuardedModelForCausalLM(adapted(2), guard)
    guard.save_pretrained(tmp_path / "guard")
    loaded = SafetyGuard.from_pretrained(tmp_path / "guard")
    assert loaded.inputs == guard.inputs
    assert f"the adapter `{digest}`" in str(guard.model_card())


def test_the_digest_names_the_adapters_weights_not_how_or_under_what_name_it_was_loaded(model_dir, tmp_path):
    base = AutoModelForCausalLM.from_pretrained(model_dir)
    peft_model = get_peft_model(base, LoraConfig(target_modules=LORA_TARGETS, r=4, init_lora_weights=False))
    peft_model.save_pretrained(tmp_path / "adapter")
    by_peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir), tmp_path / "adapter", "mine")
    by_transformers, _ = load_model(str(tmp_path / "adapter"))
    digest = adapter_digest(peft_model)
    assert digest is not None and adapter_digest(by_peft) == digest == adapter_digest(by_transformers)
    assert adapter_digest(adapted(1)) != adapter_digest(adapted(2))  # other weights
    assert adapter_digest(AutoModelForCausalLM.from_pretrained(model_dir)) is None


def test_load_model_puts_an_adapter_on_its_base_with_the_base_tokenizer_unless_it_has_its_own(model_dir, tmp_path):
    base = AutoModelForCausalLM.from_pretrained(model_dir)
    peft_model = get_peft_model(base, LoraConfig(target_modules=LORA_TARGETS, r=4, init_lora_weights=False)).eval()
    folder = tmp_path / "adapter"
    peft_model.save_pretrained(folder)  # peft saves no tokenizer: the base's is read
    model, tokenizer = load_model(str(folder))
    assert model.config.name_or_path == str(model_dir)  # named by its base, as guards record it
    assert tokenizer.name_or_path == str(model_dir) == load_tokenizer(str(folder)).name_or_path
    inputs = tokenizer(["a prompt about bread"], return_tensors="pt")
    with torch.no_grad():
        assert torch.allclose(model(**inputs).logits, peft_model(**inputs).logits, atol=1e-5)
    tokenizer.save_pretrained(folder)
    assert load_model(str(folder))[1].name_or_path == str(folder) == load_tokenizer(str(folder)).name_or_path

    config = json.loads((folder / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(json.dumps({**config, "base_model_name_or_path": None}))
    with pytest.raises(ValueError, match="names no base model"):
        load_model(str(folder))
    (folder / "adapter_config.json").write_text("{not json")
    assert find_adapter_config_file(str(folder)) is not None
    with pytest.raises(ValueError, match=r"adapter_config\.json is not JSON"):
        load_model(str(folder))


def test_a_cache_of_the_bundled_rows_read_through_another_adapter_is_refused(tmp_path):
    _, tokenizer = tiny_model("llama", seed=0)
    prompts, reads = release_rows("harmful", "fit")[:8], sorted(two_headed_guard().heads["harm"].reads)
    kwargs = dict(batch_size=4, progress=False, cache_dir=tmp_path / "cache")
    bundled_features(tiny_model("llama", seed=0)[0], tokenizer, prompts, reads, **kwargs)
    with pytest.raises(ValueError, match="read through no adapter, and the model runs the peft adapter sha256:"):
        bundled_features(adapted(1), tokenizer, prompts, reads, **kwargs)


def test_an_input_profile_holds_a_digest_or_none():
    assert InputProfile.from_dict({"prompt_format": "raw", "max_prompt_tokens": 3}, source="old").adapter is None
    with pytest.raises(ValueError, match="adapter must be None or 'sha256:'"):
        InputProfile("raw", 3, adapter="my-lora")


def test_the_command_takes_an_adapter_folder_as_its_model(model_dir, tmp_path, capsys):
    base = AutoModelForCausalLM.from_pretrained(model_dir)
    get_peft_model(base, LoraConfig(target_modules=LORA_TARGETS, r=4, init_lora_weights=False)).save_pretrained(
        tmp_path / "adapter"
    )
    guard = two_headed_guard()
    guard.save_pretrained(tmp_path / "guard")
    common = ["--model", str(tmp_path / "adapter"), "--guard", str(tmp_path / "guard")]
    generate = ["generate", *common, "--max-new-tokens", "2", "hi there"]
    with pytest.raises(SystemExit) as exit_info:
        entry(generate)
    err = capsys.readouterr().err
    assert exit_info.value.code == 1 and "error: ModelMismatchError: the model runs the peft adapter sha256:" in err
    assert "`hf-lsad set-budget --model ADAPTER --guard GUARD --out NEW`" in err
    entry([*generate, "--allow-adapter-mismatch"])
    captured = capsys.readouterr()
    assert captured.out.count("safety:") == 1
    assert "warning: AdapterWarning: the model runs the peft adapter sha256:" in captured.err
    assert "guarding it anyway (allow_adapter_mismatch=True)" in captured.err

    # the released operating point again, through the adapter: thresholds on the bundled validation chat
    budget = ["--target-fpr", "0.25", "--confidence", "none", "--domain-check", "0", "--harm-check", "0"]
    entry(["set-budget", *common, "--out", str(tmp_path / "through"), *budget])
    printed = capsys.readouterr().out
    assert "thresholds set on 1338 prompts of the bundled validation chat" in printed
    assert "bundled validation chat (" not in printed  # the rows the thresholds were set on: no chat check
    through = SafetyGuard.from_pretrained(tmp_path / "through")
    assert through.budget.rows.startswith("validation chat, read through the peft adapter sha256:")
    assert through.inputs.adapter is not None and through.budget.n_rows == 1338
    entry(["generate", "--model", str(tmp_path / "adapter"), "--guard", str(tmp_path / "through"), "hi there"])
    assert "warning" not in capsys.readouterr().err
    with pytest.raises(SystemExit):
        entry(["set-budget", *common, "--out", str(tmp_path / "x"), "--column", "text"])
    assert "argument --column: names the column of --benign's table; no --benign was given" in capsys.readouterr().err
    collect = ["collect", "--pool", "harmful", "--layer", "9", "--out", str(tmp_path / "acts")]
    with pytest.raises(SystemExit):  # the base model's depth, read before any model loads
        entry([*collect, "--model", str(tmp_path / "adapter")])
    assert "argument --layer: layer 9 is out of range" in capsys.readouterr().err
    shutil.copytree(tmp_path / "adapter", tmp_path / "bad")
    (tmp_path / "bad" / "adapter_config.json").write_text("[]")
    with pytest.raises(SystemExit):
        entry([*collect, "--model", str(tmp_path / "bad")])
    assert "argument --model: " in (err := capsys.readouterr().err) and "names no base model" in err


def test_a_guarded_model_loads_an_adapter_folder_and_saves_it_as_its_base_model(model_dir, tmp_path):
    base = AutoModelForCausalLM.from_pretrained(model_dir)
    peft_model = get_peft_model(base, LoraConfig(target_modules=LORA_TARGETS, r=4, init_lora_weights=False))
    peft_model.save_pretrained(tmp_path / "adapter")
    _, tokenizer = tiny_model("llama", seed=0)
    guard = two_headed_guard()
    fit_budget_on_prompts(peft_model, tokenizer, guard, PROMPTS, target_fpr=0.25, confidence=None, progress=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", AdapterWarning)  # the adapter the thresholds were set through
        guarded = GuardedModelForCausalLM.from_pretrained(str(tmp_path / "adapter"), guard=guard)
        assert guarded.tokenizer.name_or_path == str(model_dir)
        guarded.save_pretrained(tmp_path / "guarded", base_model=str(tmp_path / "adapter"))
        again = GuardedModelForCausalLM.from_pretrained(str(tmp_path / "guarded"))
    assert adapter_digest(again.model) == adapter_digest(peft_model) == again.guard.inputs.adapter
