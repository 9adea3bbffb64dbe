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
from hf_lsad.capture.collect import collect_prompt_features
from hf_lsad.cli.main import entry
from hf_lsad.errors import AdapterWarning, GuardFormatError, GuardMismatchError, ModelMismatchError
from hf_lsad.guard import SafetyGuard
from hf_lsad.guard.calibration import AffineCalibration
from hf_lsad.guard.fingerprint import (
    PROBE_PROMPTS,
    RATE_TOLERANCE,
    SHIFT_TOLERANCE,
    boundary_flag_rate,
    boundary_indices,
    record_fingerprint,
    score_shift,
)
from hf_lsad.guard.heads.budget import fit_budget_on_prompts, released_threshold_prompts
from hf_lsad.testing import tiny_model


def fingerprinted(kind: str = "two heads") -> tuple:
    """The tiny model, its tokenizer and a guard (two heads, or the anomaly head alone) fingerprinted on it."""
    model, tokenizer, _ = tiny_guard("prompt_last")
    guard = two_headed_guard() if kind == "two heads" else fresh_guard("prompt_last")
    record_fingerprint(model, tokenizer, guard)
    return model, tokenizer, guard


def bounded(kind: str = "two heads") -> tuple:
    """As :func:`fingerprinted`, with the rows of ``PROMPTS`` nearest the thresholds kept (4 a side)."""
    model, tokenizer, _ = tiny_guard("prompt_last")
    guard = two_headed_guard() if kind == "two heads" else fresh_guard("prompt_last")
    record_fingerprint(model, tokenizer, guard, benign_prompts=PROMPTS, rows="tiny benign", per_side=4, progress=False)
    return model, tokenizer, guard


def scaled_embedding(model, scale: float):
    """``model`` with its token embedding scaled: every residual moves a little, in one direction."""
    scaled = copy.deepcopy(model)
    with torch.no_grad():
        scaled.get_input_embeddings().weight.mul_(scale)
    return scaled


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


@pytest.mark.parametrize("make", [fingerprinted, bounded], ids=["probes", "with boundary rows"])
def test_the_fingerprint_round_trips_through_the_folder_bit_exact(tmp_path, make):
    model, _, guard = make()
    guard.save_pretrained(tmp_path / "guard")
    loaded = SafetyGuard.from_pretrained(tmp_path / "guard")

    def equal(got, expected) -> bool:
        if isinstance(got, torch.Tensor):
            return torch.equal(got, expected)
        if isinstance(got, tuple) and hasattr(got, "_fields"):  # the boundary rows
            return all(equal(a, b) for a, b in zip(got, expected))
        return got == expected

    assert all(equal(got, expected) for got, expected in zip(loaded.fingerprint, guard.fingerprint))
    assert (loaded.fingerprint.boundary is None) == (make is fingerprinted)
    assert score_shift(model, loaded) == score_shift(model, guard)
    assert boundary_flag_rate(model, loaded) == boundary_flag_rate(model, guard)
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
    refusal = capsys.readouterr().err
    assert "score its probe prompts otherwise" in refusal and "(--allow-score-shift in the CLI)" in refusal
    entry([*argv, "--allow-score-shift"])
    captured = capsys.readouterr()
    assert "hello there" in captured.out and "warning: ScoreShiftWarning: the guard's heads score" in captured.err


def test_the_rows_nearest_each_threshold_are_kept_with_their_verdicts():
    model, tokenizer, guard = bounded()
    boundary = guard.fingerprint.boundary
    features, _ = collect_prompt_features(model, tokenizer, PROMPTS, guard.reads, progress=False)
    deciding, thresholds = guard.deciding_scores(features), guard.head_thresholds()
    kept = boundary_indices(guard, features, 4)
    assert boundary.input_ids.shape[0] == len(kept) <= 2 * 2 * 4  # two heads, two sides, four rows
    assert boundary.n_rows == len(PROMPTS) and boundary.rows == "tiny benign"
    outside = torch.ones(len(PROMPTS), dtype=torch.bool)
    outside[kept] = False  # the kept rows count with the verdicts read in their own batches (round-off apart)
    assert boundary.flagged_rows == int(guard(features).flagged[outside].sum()) + int(boundary.flagged.sum())
    assert 0 < int(boundary.flagged.sum()) < len(kept)  # rows on both sides
    for name in guard.head_names:  # the four rows it flags with the lowest scores, and the four highest below
        over = deciding[name] > thresholds[name]
        others = torch.stack([deciding[o] > thresholds[o] for o in guard.head_names if o != name]).any(0)
        for side in (over & ~others, ~over & ~others):
            rows = side.nonzero().flatten()
            nearest = rows[(deciding[name][rows] - thresholds[name]).abs().argsort()[:4]]
            assert set(nearest.tolist()) <= set(kept)
    assert boundary_flag_rate(model, guard) == (boundary.flagged_rows / len(PROMPTS),) * 2
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        GuardedModelForCausalLM(model, guard, tokenizer=tokenizer)


def test_a_model_the_probes_pass_is_refused_when_the_rows_nearest_the_thresholds_move():
    """The gap the boundary rows close: a small change in one direction (as another quantisation of the same
    weights) moves the probes little and carries rows just below a threshold across it."""
    model, tokenizer, guard = bounded()
    scaled = scaled_embedding(model, 0.99)  # the probes move by 0.04 of their spread, 6 of 96 verdicts cross
    assert max(score_shift(scaled, guard).values()) <= SHIFT_TOLERANCE  # the probes alone pass it
    recorded, estimated = boundary_flag_rate(scaled, guard)
    assert abs(estimated - recorded) > RATE_TOLERANCE * recorded
    against = rf"against {recorded:.2%}"  # the rate recorded through the model, named in the refusal
    with pytest.raises(ModelMismatchError, match=rf"would flag about .* of tiny benign \(96 rows\), {against}"):
        GuardedModelForCausalLM(scaled, guard, tokenizer=tokenizer)
    with pytest.warns(ScoreShiftWarning, match="guarding it anyway"):
        GuardedModelForCausalLM(scaled, guard, tokenizer=tokenizer, allow_score_shift=True)
    fingerprinted_only = copy.deepcopy(guard)
    fingerprinted_only.set_fingerprint(guard.fingerprint._replace(boundary=None))
    GuardedModelForCausalLM(scaled, fingerprinted_only, tokenizer=tokenizer)  # the probes alone let it through


def test_new_thresholds_drop_the_boundary_rows_and_keep_the_probes():
    model, tokenizer, guard = bounded()
    probes = guard.fingerprint.scores
    features, _ = collect_prompt_features(model, tokenizer, PROMPTS, guard.reads, progress=False)
    guard.fit_budget(features, target_fpr=0.1)  # the kept verdicts were at the old thresholds
    assert guard.fingerprint.boundary is None and torch.equal(guard.fingerprint.scores, probes)
    _, _, single = bounded("anomaly head alone")
    calibration = AffineCalibration(slopes=[0.1, 0.2, 0.3], intercepts=[-1.0, 0.0, 1.0], anchor=[0.1, 0.0], lam=1.0)
    single.set_calibration(calibration)
    assert single.fingerprint.boundary is None


def test_thresholds_on_the_users_prompts_keep_none_of_them_and_on_the_bundled_rows_keep_the_nearest():
    model, tokenizer, _ = tiny_guard("prompt_last")
    guard = two_headed_guard()
    fit_budget_on_prompts(model, tokenizer, guard, PROMPTS, target_fpr=0.25, confidence=None, progress=False)
    assert guard.fingerprint is not None and guard.fingerprint.boundary is None  # the user's text stays theirs
    fit_budget_on_prompts(model, tokenizer, guard, target_fpr=0.25, confidence=None, progress=False)
    boundary = guard.fingerprint.boundary
    assert boundary.n_rows == len(released_threshold_prompts()) and boundary.rows == "validation chat"
    assert int(boundary.attention_mask.sum(dim=1).max()) <= 96
    assert boundary_flag_rate(model, guard) == (boundary.flagged_rows / boundary.n_rows,) * 2


@pytest.mark.parametrize(
    ("damage", "match"),
    [
        (lambda t: t.pop("boundary_flagged"), "expected tensors"),
        (lambda t: t.update(boundary_flagged=t["boundary_flagged"] * 2), "boundary flagged must be int64 0/1"),
        (lambda t: t.update(boundary_flagged=t["boundary_flagged"][:-1]), "boundary flagged must be int64 0/1"),
    ],
    ids=["missing tensor", "not 0/1", "wrong shape"],
)
def test_broken_boundary_rows_are_a_format_error(tmp_path, damage, match):
    _, _, guard = bounded()
    folder = tmp_path / "guard"
    guard.save_pretrained(folder)
    edit_fingerprint(folder, damage)
    with pytest.raises(GuardFormatError, match=match):
        SafetyGuard.from_pretrained(folder)


@pytest.mark.parametrize(
    "counts",
    [{"n_rows": 96, "flagged_rows": 24}, {"n_rows": "96", "flagged_rows": 24, "rows": "x"}, ["x"]],
    ids=["missing key", "text count", "not an object"],
)
def test_boundary_counts_of_the_wrong_form_are_a_format_error(tmp_path, counts):
    _, _, guard = bounded()
    folder = tmp_path / "guard"
    guard.save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    config["fingerprint"]["boundary"] = counts
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(GuardFormatError, match="'boundary' must be an object"):
        SafetyGuard.from_pretrained(folder)


def test_boundary_rows_need_a_name_short_prompts_and_the_models_vocabulary():
    model, tokenizer, _ = tiny_guard("prompt_last")
    guard = two_headed_guard()
    with pytest.raises(ValueError, match="say what the benign prompts are"):
        record_fingerprint(model, tokenizer, guard, benign_prompts=PROMPTS, progress=False)
    long = [" ".join(["word"] * 120) + f" {i}" for i in range(8)]
    with pytest.raises(ValueError, match="none of the 8 prompts is of at most 96 tokens"):
        record_fingerprint(model, tokenizer, guard, benign_prompts=long, rows="long", progress=False)
    _, _, guard = bounded()
    boundary = guard.fingerprint.boundary
    beyond = boundary.input_ids.clone()
    beyond[0, -1] = model.get_input_embeddings().weight.shape[0]  # a token this model does not have
    guard.set_fingerprint(guard.fingerprint._replace(boundary=boundary._replace(input_ids=beyond)))
    with pytest.raises(ModelMismatchError, match="boundary rows hold token id"):
        boundary_flag_rate(model, guard)
