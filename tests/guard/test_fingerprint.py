"""A guard's fingerprint of the model its thresholds were set through: recorded, saved, checked, and a model whose
weights differ (a merged adapter, a fine-tune) refused where no name or module tells it apart."""

from __future__ import annotations

import copy
import json
import warnings

import pytest
import torch
from peft import LoraConfig, get_peft_model
from safetensors.torch import load_file, save_file
from tiny import PROMPTS, fresh_guard, tiny_guard, two_headed_guard

from hf_lsad import GuardedModelForCausalLM, ScoreShiftWarning
from hf_lsad.cli.main import entry
from hf_lsad.errors import AdapterWarning, GuardFormatError, GuardMismatchError, ModelMismatchError
from hf_lsad.guard import SafetyGuard
from hf_lsad.guard.calibration import AffineCalibration
from hf_lsad.guard.fingerprint import PROBE_PROMPTS, SHIFT_TOLERANCE, record_fingerprint, score_shift
from hf_lsad.guard.heads.training import fit_budget_on_prompts
from hf_lsad.testing import tiny_model


def fingerprinted(kind: str = "two heads") -> tuple:
    """The tiny model, its tokenizer and a guard (two heads, or the anomaly head alone) fingerprinted on it."""
    model, tokenizer, _ = tiny_guard("prompt_last")
    guard = two_headed_guard() if kind == "two heads" else fresh_guard("prompt_last")
    record_fingerprint(model, tokenizer, guard)
    return model, tokenizer, guard


def merged_lora(model):
    """``model`` with a LoRA adapter (its weights drawn, as after training) merged into its weights and unloaded:
    the base model's name and modules, other weights."""
    torch.manual_seed(0)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    return get_peft_model(copy.deepcopy(model), config).merge_and_unload()


@pytest.mark.parametrize("kind", ["two heads", "anomaly head alone"])
def test_the_model_the_thresholds_were_set_through_is_guarded(kind):
    model, tokenizer, guard = fingerprinted(kind)
    assert guard.fingerprint.heads == tuple(guard.head_names)
    assert guard.fingerprint.input_ids.shape[0] == len(PROBE_PROMPTS)
    assert all(shift == 0.0 for shift in score_shift(model, guard).values())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        guarded = GuardedModelForCausalLM(model, guard, tokenizer=tokenizer)
    assert len(guarded.screen(["hello there"])) == 1


@pytest.mark.parametrize("kind", ["two heads", "anomaly head alone"])
@pytest.mark.parametrize("change", ["merged adapter", "another fine-tune"])
def test_a_model_whose_weights_differ_is_refused_unless_allowed(kind, change):
    model, tokenizer, guard = fingerprinted(kind)
    other = merged_lora(model) if change == "merged adapter" else tiny_model("llama", seed=1)[0]
    assert other.config.name_or_path == model.config.name_or_path  # nothing but the weights tells them apart
    assert max(score_shift(other, guard).values()) > SHIFT_TOLERANCE
    with pytest.raises(ModelMismatchError, match=r"score its probe prompts otherwise .*allow_score_shift=True"):
        GuardedModelForCausalLM(other, guard, tokenizer=tokenizer)
    with pytest.warns(ScoreShiftWarning, match="guarding it anyway"):
        guarded = GuardedModelForCausalLM(other, guard, tokenizer=tokenizer, allow_score_shift=True)
    assert len(guarded.screen(["hello there"])) == 1


def test_the_same_weights_in_bfloat16_are_the_same_model():
    model, tokenizer, guard = fingerprinted()
    half = copy.deepcopy(model).to(torch.bfloat16)
    assert max(score_shift(half, guard).values()) < SHIFT_TOLERANCE
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        GuardedModelForCausalLM(half, guard, tokenizer=tokenizer)


def test_a_model_that_gives_nan_is_refused():
    model, tokenizer, guard = fingerprinted()
    broken = copy.deepcopy(model)
    with torch.no_grad():
        broken.model.layers[0].mlp.down_proj.weight.fill_(float("nan"))
    assert all(shift != shift for shift in score_shift(broken, guard).values())  # nan
    with pytest.raises(ModelMismatchError, match="shift anomaly nan, harm nan"):
        GuardedModelForCausalLM(broken, guard, tokenizer=tokenizer)


def test_a_model_with_a_smaller_vocabulary_is_refused_before_reading_the_probes():
    model, tokenizer, guard = fingerprinted()
    smaller = copy.deepcopy(model)
    smaller.resize_token_embeddings(10)
    with pytest.raises(ModelMismatchError, match="beyond this model's vocabulary of 10"):
        GuardedModelForCausalLM(smaller, guard, tokenizer=tokenizer)


def test_other_adapters_allowed_are_not_checked_again():
    """The user allowed a model that runs another adapter, which moves the scores: the adapter's warning says so."""
    model, tokenizer, guard = fingerprinted()
    torch.manual_seed(0)
    adapted = get_peft_model(copy.deepcopy(model), LoraConfig(r=4, target_modules=["q_proj"], init_lora_weights=False))
    with pytest.raises(ModelMismatchError, match="peft adapter"):
        GuardedModelForCausalLM(adapted, guard, tokenizer=tokenizer)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        GuardedModelForCausalLM(adapted, guard, tokenizer=tokenizer, allow_adapter_mismatch=True)
    assert [w.category for w in caught] == [AdapterWarning]


def test_thresholds_set_through_a_model_record_its_fingerprint():
    model, tokenizer, _ = tiny_guard("prompt_last")
    other = merged_lora(model)
    guard = two_headed_guard()
    assert guard.fingerprint is None  # thresholds set from activations: nothing to check a model against
    GuardedModelForCausalLM(other, guard, tokenizer=tokenizer)
    fit_budget_on_prompts(other, tokenizer, guard, PROMPTS, target_fpr=0.25, confidence=None, progress=False)
    GuardedModelForCausalLM(other, guard, tokenizer=tokenizer)  # the model it was set through
    with pytest.raises(ModelMismatchError, match="score its probe prompts otherwise"):
        GuardedModelForCausalLM(model, guard, tokenizer=tokenizer)


def test_a_new_head_drops_the_fingerprint_and_a_calibration_keeps_it():
    model, _, guard = fingerprinted("anomaly head alone")
    recorded = guard.fingerprint
    guard.add_head(copy.deepcopy(two_headed_guard().heads["harm"]))
    assert guard.fingerprint is None  # the new head's scores were never recorded
    with pytest.raises(ValueError, match=r"recorded for heads \['anomaly'\], the guard has \['anomaly', 'harm'\]"):
        guard.set_fingerprint(recorded)
    _, _, guard = fingerprinted("anomaly head alone")
    calibration = AffineCalibration(slopes=[0.1, 0.2, 0.3], intercepts=[-1.0, 0.0, 1.0], anchor=[0.1, 0.0], lam=1.0)
    guard.set_calibration(calibration)  # the anomaly head is compared before any calibration
    assert torch.equal(guard.fingerprint.scores, recorded.scores)
    assert score_shift(model, guard) == {"anomaly": 0.0}


def test_the_fingerprint_round_trips_through_the_folder_bit_exact(tmp_path):
    model, _, guard = fingerprinted()
    guard.save_pretrained(tmp_path / "guard")
    loaded = SafetyGuard.from_pretrained(tmp_path / "guard")
    for got, expected in zip(loaded.fingerprint, guard.fingerprint):
        assert torch.equal(got, expected) if isinstance(got, torch.Tensor) else got == expected
    assert score_shift(model, loaded) == score_shift(model, guard)
    unfingerprinted = copy.deepcopy(loaded)
    unfingerprinted.set_fingerprint(None)
    unfingerprinted.save_pretrained(tmp_path / "guard")  # saved over: the file it no longer has is removed
    assert not (tmp_path / "guard" / "fingerprint.safetensors").exists()
    assert SafetyGuard.from_pretrained(tmp_path / "guard").fingerprint is None


def edit_fingerprint(folder, edit) -> None:
    file = folder / "fingerprint.safetensors"
    tensors = load_file(str(file))
    edit(tensors)
    save_file(tensors, str(file))


@pytest.mark.parametrize(
    ("damage", "error", "match"),
    [
        (lambda f: (f / "fingerprint.safetensors").unlink(), GuardFormatError, "fingerprint's .* missing"),
        (lambda f: edit_fingerprint(f, lambda t: t.pop("scores")), GuardFormatError, "expected tensors"),
        (
            lambda f: edit_fingerprint(f, lambda t: t.update(scores=t["scores"][:1])),
            GuardFormatError,
            r"scores must be float64 \(2, 16\)",
        ),
        (
            lambda f: edit_fingerprint(f, lambda t: t["scores"].__setitem__((0, 0), float("nan"))),
            GuardFormatError,
            "must be finite",
        ),
        (
            lambda f: edit_fingerprint(f, lambda t: t["scores"].__setitem__((0, 0), 1.0)),
            GuardMismatchError,
            "fingerprint.safetensors",
        ),
    ],
    ids=["missing file", "missing tensor", "wrong shape", "nan score", "edited score"],
)
def test_a_broken_fingerprint_is_a_format_error(tmp_path, damage, error, match):
    _, _, guard = fingerprinted()
    folder = tmp_path / "guard"
    guard.save_pretrained(folder)
    damage(folder)
    with pytest.raises(error, match=match):
        SafetyGuard.from_pretrained(folder)


def test_a_fingerprint_of_other_heads_in_the_config_is_a_format_error(tmp_path):
    _, _, guard = fingerprinted()
    folder = tmp_path / "guard"
    guard.save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    config["fingerprint"]["heads"] = ["anomaly", "other"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(GuardFormatError, match=r"recorded for heads \['anomaly', 'other'\]"):
        SafetyGuard.from_pretrained(folder)


def test_the_cli_refuses_a_fine_tune_under_the_base_models_name_unless_allowed(model_dir, tmp_path, capsys):
    _, tokenizer, guard = fingerprinted()
    guard.save_pretrained(tmp_path / "guard")
    other, _ = tiny_model("llama", seed=1)
    fine_tune = tmp_path / "fine-tunes" / model_dir.name  # the base model's name, other weights
    other.save_pretrained(fine_tune)
    tokenizer.save_pretrained(fine_tune)
    guard_dir = str(tmp_path / "guard")
    argv = ["generate", "--model", str(fine_tune), "--guard", guard_dir, "--max-new-tokens", "2", "hello there"]
    with pytest.raises(SystemExit):
        entry(argv)
    assert "score its probe prompts otherwise" in capsys.readouterr().err
    entry([*argv, "--allow-score-shift"])
    captured = capsys.readouterr()
    assert "hello there" in captured.out and "warning: ScoreShiftWarning: the guard's heads score" in captured.err
