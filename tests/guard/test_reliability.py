"""No silent wrong verdicts: one row per case a careless or hostile user tried.

Each row either asserts the error type and that the message names the offending
file / key / value, or asserts the correct result where the case is now supported.
"""

from __future__ import annotations

import json
import math
import struct
import time
import warnings
from pathlib import Path

import pytest
import torch
from tiny import LAYER, MIXED_BATCH, fresh_guard, last_layer_output, tiny_guard

import hf_lsad
from hf_lsad import (
    GuardFormatError,
    GuardMismatchError,
    InputError,
    ModelMismatchError,
    SafetyGuard,
    UnsafeGuardFileError,
)
from hf_lsad.capture.collect import encode_prompts
from hf_lsad.capture.recorder import generate_with_activations
from hf_lsad.generation.model import GuardedModelForCausalLM
from hf_lsad.guard import DEFAULT_GUARD, upgrade_guard_folder
from hf_lsad.guard.files import PAPER_GUARD
from hf_lsad.testing import tiny_model


@pytest.fixture
def saved(tmp_path):
    """A freshly saved tiny guard folder (and the guard)."""
    guard = fresh_guard()
    guard.save_pretrained(tmp_path / "guard")
    return guard, tmp_path / "guard"


def edit_config(path: Path, edit) -> None:
    config = json.loads((path / "config.json").read_text())
    result = edit(config)
    (path / "config.json").write_text(json.dumps(result if isinstance(result, list) else config))


def nudge_tensor(file: Path, name: str) -> None:
    """Change the first float of tensor ``name`` by one ulp, in place: still finite, still well-formed."""
    data = bytearray(file.read_bytes())
    (header_len,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + header_len])
    start = 8 + header_len + header[name]["data_offsets"][0]
    (value,) = struct.unpack("<f", data[start : start + 4])
    bits = struct.unpack("<I", struct.pack("<f", value))[0] ^ 1
    data[start : start + 4] = struct.pack("<I", bits)
    assert math.isfinite(struct.unpack("<f", data[start : start + 4])[0])
    file.write_bytes(bytes(data))


# ---------------------------------------------------------------------------------------------
# config.json: (id, edit, error type, regex the message must match: file, key, value, expectation)
CONFIG_CASES = [
    # silent wrong results on the original code
    (
        "threshold-nan",
        lambda c: c["guard"].update(threshold=float("nan")),
        GuardFormatError,
        r"config\.json:guard: key 'threshold' is nan .*finite number",
    ),
    (
        "threshold-inf",
        lambda c: c["guard"].update(threshold=float("inf")),
        GuardFormatError,
        r"config\.json:guard: key 'threshold' is inf .*finite",
    ),
    (
        "score-metric-edited",
        lambda c: c["detector"].update(score_metric="l2"),
        GuardMismatchError,
        r"config\.json: .*detector\.score_metric is 'l2' now but was 'l1'",
    ),
    (
        "threshold-edited",
        lambda c: c["guard"].update(threshold=c["guard"]["threshold"] * 2),
        GuardMismatchError,
        r"guard\.threshold is .* now but was",
    ),
    (
        "mask-scope-edited",
        lambda c: c["detector"].update(mask_scope="local"),
        GuardMismatchError,
        r"detector\.mask_scope is 'local' now but was 'global'",
    ),
    (
        "position-edited",
        lambda c: c["guard"]["hook"].update(position="prompt_last"),
        GuardMismatchError,
        r"guard\.hook\.position is 'prompt_last' now but was 'response_last'",
    ),
    (
        "settings-record-edited-too",
        lambda c: (
            c["detector"].update(score_metric="l2"),
            c["integrity"]["settings"]["detector"].update(score_metric="l2"),
        ),
        GuardMismatchError,
        r"integrity\.settings: the recorded settings were edited",
    ),
    # unclear or late errors on the original code
    (
        "threshold-string",
        lambda c: c["guard"].update(threshold="204.5"),
        GuardFormatError,
        r"config\.json:guard: key 'threshold' is '204\.5' \(str\), expected a finite number",
    ),
    (
        "layer-string",
        lambda c: c["guard"]["hook"].update(layer="2"),
        GuardFormatError,
        r"config\.json:guard:hook: key 'layer' is '2' \(str\), expected an integer",
    ),
    (
        "hidden-size-string",
        lambda c: c["guard"]["hook"].update(hidden_size="32"),
        GuardFormatError,
        r"key 'hidden_size' is '32' \(str\), expected an integer",
    ),
    ("config-is-a-list", lambda c: [c], GuardFormatError, r"config\.json: expected a JSON object .*got a JSON list"),
    (
        "unknown-top-level-key",
        lambda c: c.update(surprise=1),
        GuardFormatError,
        r"config\.json: unknown key\(s\) \['surprise'\]",
    ),
    (
        "missing-versions",
        lambda c: c.pop("versions"),
        GuardFormatError,
        r"config\.json: missing key\(s\) \['versions'\]",
    ),
    (
        "unknown-versions-key",
        lambda c: c["versions"].update(numpy="2"),
        GuardFormatError,
        r"config\.json:versions: unknown key\(s\) \['numpy'\]",
    ),
    (
        "versions-not-strings",
        lambda c: c["versions"].update(torch=2),
        GuardFormatError,
        r"versions: key 'torch' is 2 \(int\), expected a string",
    ),
    (
        "unknown-nested-key",
        lambda c: c["detector"]["kmeans"].update(surprise=1),
        GuardFormatError,
        r"config\.json:detector.*kmeans.*unknown config key\(s\) \['surprise'\]",
    ),
    ("layer-bool", lambda c: c["guard"]["hook"].update(layer=True), GuardFormatError, r"key 'layer' is True"),
    (
        "layer-out-of-range",
        lambda c: c["guard"]["hook"].update(layer=7),
        GuardFormatError,
        r"key 'layer' is 7, expected a layer index below num_hidden_layers=4",
    ),
    (
        "negative-hidden-size",
        lambda c: c["guard"]["hook"].update(hidden_size=-32),
        GuardFormatError,
        r"key 'hidden_size' is -32, expected a positive integer",
    ),
    (
        "target-fpr-out-of-range",
        lambda c: c["guard"].update(target_fpr=1.5),
        GuardFormatError,
        r"key 'target_fpr' is 1\.5, expected a number in \(0, 1\)",
    ),
    (
        "zero-clusters",
        lambda c: c["detector"]["kmeans"].update(n_clusters=0),
        GuardFormatError,
        r"detector:kmeans: key 'n_clusters' is 0, expected a positive integer",
    ),
    (
        "unknown-enum",
        lambda c: c["detector"].update(score_metric="cosine"),
        GuardFormatError,
        r"config\.json:detector.*score_metric.*'cosine'",
    ),
    (
        "unknown-position",
        lambda c: c["guard"]["hook"].update(position="middle"),
        GuardFormatError,
        r"unknown position 'middle'",
    ),
    (
        "unknown-method",
        lambda c: c["guard"].update(method="nope"),
        GuardFormatError,
        r"config\.json:guard: key 'method': unknown detector method 'nope'",
    ),
    (
        "d-sae-string",
        lambda c: c.update(d_sae="64"),
        GuardFormatError,
        r"key 'd_sae' is '64' \(str\), expected an integer",
    ),
    (
        "d-sae-null-for-an-sae-method",
        lambda c: c.update(d_sae=None),
        GuardFormatError,
        r"key 'd_sae' is None, but freqmask-km reads SAE codes",
    ),
    (
        "mask-larger-than-sae",
        lambda c: c["detector"].update(mask_size=65),
        GuardFormatError,
        r"config\.json(:detector)?: mask_size=65 exceeds the SAE width d_sae=64",
    ),
    ("format-version", lambda c: c.update(format_version=2), GuardFormatError, r"format_version 2, expected 1"),
    (
        "no-integrity-record",
        lambda c: c.pop("integrity"),
        GuardFormatError,
        r"config\.json: no 'integrity' record .*upgrade_guard_folder",
    ),
    (
        "integrity-file-list",
        lambda c: c["integrity"]["files"].pop("sae/sae.safetensors"),
        GuardFormatError,
        r"integrity\.files: records \['detector\.safetensors', 'threshold\.safetensors'\], but this guard reads",
    ),
    (
        "integrity-unknown-key",
        lambda c: c["integrity"].update(note="x"),
        GuardFormatError,
        r"config\.json:integrity: .*unknown key\(s\) \['note'\]",
    ),
    (
        "integrity-bad-digest",
        lambda c: c["integrity"]["files"].update({"detector.safetensors": "abc"}),
        GuardFormatError,
        r"integrity\.files: expected .*SHA-256",
    ),
]


@pytest.mark.parametrize("case, edit, error, message", CONFIG_CASES, ids=[c[0] for c in CONFIG_CASES])
def test_bad_guard_config_is_refused_at_load(saved, case, edit, error, message):
    _, path = saved
    edit_config(path, edit)
    with pytest.raises(error, match=message) as info:
        SafetyGuard.from_pretrained(path)
    assert str(path / "config.json") in str(info.value)


def _write_nan(path: Path) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(path / "detector.safetensors")
    tensors["centroids"][0, 0] = float("nan")
    save_file(tensors, path / "detector.safetensors")


def _drop_tensor(path: Path) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(path / "detector.safetensors")
    del tensors["centroids"]
    save_file(tensors, path / "detector.safetensors")


def _add_pickle(path: Path) -> None:
    torch.save({"x": torch.zeros(1)}, path / "sae" / "extra.pt")


# tensor files and folder contents: (id, edit, error type, regex)
FILE_CASES = [
    (
        "detector-value-changed",
        lambda p: nudge_tensor(p / "detector.safetensors", "centroids"),
        GuardMismatchError,
        r"detector\.safetensors: SHA-256 .* differs .*modified or corrupted",
    ),
    (
        "sae-value-changed",
        lambda p: nudge_tensor(p / "sae" / "sae.safetensors", "encoder.weight"),
        GuardMismatchError,
        r"sae/sae\.safetensors: SHA-256 .* differs",
    ),
    (
        "truncated-safetensors",
        lambda p: (p / "detector.safetensors").write_bytes((p / "detector.safetensors").read_bytes()[:100]),
        GuardFormatError,
        r"detector\.safetensors is not a readable safetensors file",
    ),
    (
        "empty-safetensors",
        lambda p: (p / "detector.safetensors").write_bytes(b""),
        GuardFormatError,
        r"detector\.safetensors is not a readable safetensors file",
    ),
    ("nan-tensor", _write_nan, GuardFormatError, r"detector\.safetensors: tensor 'centroids' holds NaN or inf"),
    ("missing-tensor", _drop_tensor, GuardFormatError, r"detector\.safetensors: missing tensors \['centroids'\]"),
    (
        "missing-file",
        lambda p: (p / "sae" / "sae.safetensors").unlink(),
        GuardFormatError,
        r"missing file .*sae/sae\.safetensors",
    ),
    (
        "sae-config-unknown-key",
        lambda p: (p / "sae" / "config.json").write_text(
            json.dumps({"format_version": 1, "sae": {"d_in": 32, "d_sae": 64}, "extra": 1})
        ),
        GuardFormatError,
        r"sae/config\.json: unknown key\(s\) \['extra'\]",
    ),
    (
        "sae-config-string-size",
        lambda p: (p / "sae" / "config.json").write_text(
            json.dumps({"format_version": 1, "sae": {"d_in": "32", "d_sae": 64}})
        ),
        GuardFormatError,
        r"sae/config\.json: key 'd_in' is '32' \(str\), expected an integer",
    ),
    ("pickle-file", _add_pickle, UnsafeGuardFileError, r"pickle files.*sae/extra\.pt"),
    (
        "symlink-outside",
        lambda p: (p / "notes.md").symlink_to("/etc/hostname"),
        UnsafeGuardFileError,
        r"notes\.md links to /etc/hostname, outside the guard folder",
    ),
    (
        "symlink-loop",
        lambda p: ((p / "a").symlink_to(p / "b"), (p / "b").symlink_to(p / "a")),
        UnsafeGuardFileError,
        r"link .*[ab] is broken or loops",
    ),
    (
        "symlink-dev-zero",
        lambda p: ((p / "detector.safetensors").unlink(), (p / "detector.safetensors").symlink_to("/dev/zero")),
        UnsafeGuardFileError,
        r"detector\.safetensors links to /dev/zero, outside the guard folder",
    ),
    (
        "symlinked-folder-outside",
        lambda p: (p / "more").symlink_to(p.parent.parent, target_is_directory=True),
        UnsafeGuardFileError,
        r"more links to .*, outside the guard folder",
    ),
]


@pytest.mark.parametrize("case, edit, error, message", FILE_CASES, ids=[c[0] for c in FILE_CASES])
def test_bad_guard_files_are_refused_at_load(saved, case, edit, error, message):
    _, path = saved
    edit(path)
    with pytest.raises(error, match=message):
        SafetyGuard.from_pretrained(path)


def test_symlink_inside_the_folder_is_accepted(saved, tmp_path):
    guard, path = saved
    (path / "card.md").write_text("notes")
    (path / "README.md").symlink_to(path / "card.md")
    reloaded = SafetyGuard.from_pretrained(path)
    x = torch.randn(5, 32)
    assert torch.equal(reloaded(x).scores, guard(x).scores)


def test_a_folder_that_is_not_a_guard_fails_fast():
    start = time.perf_counter()
    with pytest.raises(GuardFormatError, match=r"'/usr' is not a guard folder: it has no config\.json at its root"):
        SafetyGuard.from_pretrained("/usr")
    assert time.perf_counter() - start < 1.0


def test_a_huge_folder_fails_without_walking_it_all(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    for i in range(hf_lsad.core.integrity.MAX_GUARD_ENTRIES + 1):
        (tmp_path / f"f{i}").touch()
    with pytest.raises(GuardFormatError, match=r"more than 10000 files and folders: not a guard folder"):
        SafetyGuard.from_pretrained(tmp_path)


def test_save_pretrained_output_round_trips_with_its_integrity_record(saved):
    guard, path = saved
    config = json.loads((path / "config.json").read_text())
    assert set(config["integrity"]) == {"files", "settings", "settings_sha256"}
    assert sorted(config["integrity"]["files"]) == [
        "detector.safetensors",
        "sae/sae.safetensors",
        "threshold.safetensors",
    ]
    assert config["integrity"]["settings"]["detector"]["score_metric"] == "l1"
    reloaded = SafetyGuard.from_pretrained(path)
    x = torch.randn(9, 32)
    assert torch.equal(reloaded(x).scores, guard(x).scores)
    # A setting changed on purpose in Python and re-saved is a new, consistent guard.
    reloaded.config.threshold = 123.0
    reloaded.save_pretrained(path)
    assert SafetyGuard.from_pretrained(path).threshold == 123.0


def test_an_older_guard_is_upgraded_only_explicitly(saved):
    guard, path = saved
    edit_config(path, lambda c: c.pop("integrity"))
    with pytest.raises(GuardFormatError, match="no 'integrity' record"):
        SafetyGuard.from_pretrained(path)
    before = {p: p.read_bytes() for p in path.rglob("*.safetensors")}
    upgrade_guard_folder(path)
    assert {p: p.read_bytes() for p in path.rglob("*.safetensors")} == before  # tensors untouched
    x = torch.randn(9, 32)
    assert torch.equal(SafetyGuard.from_pretrained(path)(x).scores, guard(x).scores)


@pytest.mark.parametrize(
    ("name", "folder", "heads"), [("default", DEFAULT_GUARD, ["harm"]), ("paper", PAPER_GUARD, [])]
)
def test_the_bundled_guards_load_with_their_integrity_records(name, folder, heads):
    guard = SafetyGuard.from_pretrained(name)
    config = json.loads((folder / "config.json").read_text())
    assert sorted(config["integrity"]["files"]) == sorted(
        ["detector.safetensors", "sae/sae.safetensors", "threshold.safetensors", "fingerprint.safetensors"]
        + [f"heads/{head}.safetensors" for head in heads]
    )
    assert guard.config.hook.position == "prompt_last" and math.isfinite(guard.threshold)
    assert list(guard.heads) == heads and (guard.budget is not None) == bool(heads)
    assert guard.fingerprint is not None and list(guard.fingerprint.heads) == ["anomaly", *heads]


def test_exceptions_are_public_and_value_errors():
    for name in ("GuardFormatError", "GuardMismatchError", "UnsafeGuardFileError", "ModelMismatchError", "InputError"):
        assert name in hf_lsad.__all__ and issubclass(getattr(hf_lsad, name), ValueError)
    assert issubclass(GuardMismatchError, GuardFormatError) and issubclass(UnsafeGuardFileError, GuardFormatError)


def test_wrong_model_is_a_model_mismatch_error():
    other, _ = tiny_model("llama")
    other.config.hidden_size = 48
    with pytest.raises(ModelMismatchError, match=r"hidden size 32.*has hidden size 48"):
        GuardedModelForCausalLM(other, fresh_guard())


# ---------------------------------------------------------------------------------------------
# inputs as transformers users pass them


def right_padded(tokenizer, prompts):
    """What `tok(prompts, padding=True, return_tensors="pt")` gives a transformers user: the tokenizer's own side."""
    assert tokenizer.padding_side == "right"
    texts = [
        tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False)
        for p in prompts
    ]
    return dict(tokenizer(texts, padding=True, return_tensors="pt", add_special_tokens=False))


def test_right_padded_prompt_last_scores_equal_left_padded():
    model, tokenizer, guard = tiny_guard("prompt_last")
    guarded = GuardedModelForCausalLM(model, guard)
    right = right_padded(tokenizer, MIXED_BATCH)
    assert (right["attention_mask"][:, -1] == 0).any()  # really right-padded
    left = encode_prompts(tokenizer, MIXED_BATCH)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # transformers warns about right padding for generation
        got = guarded.generate(**right, max_new_tokens=2, do_sample=False, return_dict_in_generate=True).safety
    want = guarded.generate(**left, max_new_tokens=2, do_sample=False, return_dict_in_generate=True).safety
    for g, w in zip(got, want):
        assert abs(g.score - w.score) <= 1e-4 and g.flagged == w.flagged and g.cluster == w.cluster


def test_right_padded_response_last_scores_the_final_consumed_token():
    model, tokenizer, _ = tiny_guard()
    right = right_padded(tokenizer, MIXED_BATCH)
    prompt_length = right["input_ids"].shape[1]
    eos = tokenizer.eos_token_id
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for new in (1, 4):  # with 1 new token the scored token is each row's last real prompt token
            output, activations = generate_with_activations(
                model, LAYER, "response_last", **right, max_new_tokens=new, do_sample=False
            )
            for row in range(len(MIXED_BATCH)):
                prompt = right["input_ids"][row][right["attention_mask"][row].bool()]
                response = output[row, prompt_length:].tolist()
                n = response.index(eos) + 1 if eos in response else len(response)
                consumed = torch.cat([prompt, torch.tensor(response[: n - 1], dtype=prompt.dtype)])
                torch.testing.assert_close(activations[row], last_layer_output(model, consumed), atol=5e-4, rtol=1e-3)


def test_smollm2_tokenizer_default_padding_is_right_and_supported():
    """The SmolLM2 tokenizer as a transformers user gets it (right padding, no chat template) on a small model."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from hf_lsad.capture.pretrained import GGUF_FILE, bundled_model_dir

    tokenizer = AutoTokenizer.from_pretrained(bundled_model_dir(), gguf_file=GGUF_FILE)
    assert tokenizer.padding_side == "right"
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
    config = AutoConfig.for_model(
        "llama",
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    guarded = GuardedModelForCausalLM(model, fresh_guard("prompt_last"))
    right = dict(tokenizer(MIXED_BATCH, padding=True, return_tensors="pt"))  # the usual way
    assert (right["attention_mask"][:, -1] == 0).any()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        together = guarded.generate(**right, max_new_tokens=1, do_sample=False, return_dict_in_generate=True).safety
    for i, prompt in enumerate(MIXED_BATCH):
        alone = guarded.generate(**tokenizer([prompt], return_tensors="pt"), max_new_tokens=1, do_sample=False)
        assert abs(guarded.last_safety[0].score - together[i].score) <= 1e-4, (i, alone)


def test_prompt_longer_than_the_context_is_an_input_error():
    model, tokenizer, guard = tiny_guard()
    guarded = GuardedModelForCausalLM(model, guard)
    long = encode_prompts(tokenizer, ["x" * 600])  # 600 character tokens against 512 positions
    with pytest.raises(InputError, match=r"row 0 holds a prompt of 6\d\d tokens, longer than the context .*512"):
        guarded.generate(**long, max_new_tokens=2, do_sample=False)
    near = encode_prompts(tokenizer, ["x" * 490])
    with pytest.warns(UserWarning, match=r"max_new_tokens=40 exceeds the context"):
        guarded.generate(**near, max_new_tokens=40, do_sample=False)


def test_all_padding_row_is_an_input_error():
    model, tokenizer, guard = tiny_guard()
    inputs = encode_prompts(tokenizer, ["hello", "hi"])
    inputs["attention_mask"][1] = 0
    with pytest.raises(InputError, match=r"rows \[1\] of attention_mask hold no real token"):
        GuardedModelForCausalLM(model, guard).generate(**inputs, max_new_tokens=2, do_sample=False)


# ---------------------------------------------------------------------------------------------
# fail closed, lose nothing


def test_nan_activation_row_fails_closed_and_keeps_the_batch():
    model, tokenizer, guard = tiny_guard()
    guarded = GuardedModelForCausalLM(model, guard)
    inputs = encode_prompts(tokenizer, MIXED_BATCH)
    clean = guarded.generate(**inputs, max_new_tokens=4, do_sample=False, return_dict_in_generate=True)

    def poison_row_1(module, args, output):  # a user's own hook (or a numerical blow-up) on the read block
        hidden = output[0] if isinstance(output, tuple) else output
        hidden[1] = float("nan")
        return output

    _, block = hf_lsad.capture.recorder.decoder_layer(model, LAYER)
    handle = block.register_forward_hook(poison_row_1)
    try:
        with pytest.warns(RuntimeWarning, match=r"rows \[1\] hold NaN or inf"):
            out = guarded.generate(**inputs, max_new_tokens=4, do_sample=False, return_dict_in_generate=True)
    finally:
        handle.remove()
    assert out.sequences.shape[0] == 3  # all text returned
    assert torch.equal(out.sequences[[0, 2]], clean.sequences[[0, 2]])
    bad = out.safety[1]
    assert bad.flagged and math.isnan(bad.score) and bad.cluster == -1 and "NaN or inf" in bad.error
    for i in (0, 2):
        assert out.safety[i] == clean.safety[i] and out.safety[i].error is None


def test_to_bfloat16_casts_the_model_and_keeps_the_guard_in_float32():
    model, tokenizer = tiny_model("llama", seed=0)
    guarded = GuardedModelForCausalLM(model, fresh_guard())
    guarded.to(torch.bfloat16)
    assert model.dtype == torch.bfloat16
    assert all(p.dtype != torch.bfloat16 for p in guarded.guard.state_dict().values())
    out = guarded.generate(**encode_prompts(tokenizer, MIXED_BATCH), max_new_tokens=3, do_sample=False)
    assert out.shape[0] == 3 and all(math.isfinite(r.score) for r in guarded.last_safety)
    guarded.float()
    assert model.dtype == torch.float32


# ---------------------------------------------------------------------------------------------
# degenerate fits say so, with the number


def test_sae_that_explains_little_variance_warns():
    from hf_lsad.sae.training import SAETrainConfig, train_sae

    noise = torch.randn(256, 16, generator=torch.Generator().manual_seed(0))
    with pytest.warns(hf_lsad.errors.DegenerateFitWarning, match=r"explains -?\d\.\d+ of the variance .*below 0\.5"):
        train_sae(noise, 4, SAETrainConfig(epochs=1, l1_coefficient=10.0), progress=False)


def test_clusters_too_small_for_the_fit_warn():
    from hf_lsad.detectors import FreqMaskConfig, FreqMaskKM
    from hf_lsad.detectors.clustering import KMeansConfig

    _, _, guard = tiny_guard()
    x = torch.randn(30, 32, generator=torch.Generator().manual_seed(0))
    detector = FreqMaskKM(FreqMaskConfig(kmeans=KMeansConfig(n_clusters=10), mask_size=8), 32, guard.sae.config.d_sae)
    with pytest.warns(
        hf_lsad.errors.DegenerateFitWarning, match=r"cluster\(s\) with fewer than \d+ rows .*smallest: \d+"
    ):
        detector.fit(x, guard.sae, progress=False)


# ---------------------------------------------------------------------------------------------
# the command line: checks before any model is loaded, one-line errors, --debug


def cli(capsys, *argv):
    from hf_lsad.cli.main import entry

    with pytest.raises(SystemExit) as info:
        entry(list(argv))
    err = capsys.readouterr().err
    return info.value.code, err


@pytest.fixture
def weightless_model(tmp_path):
    """A model folder with a config and no weights: any attempt to load the model would fail differently."""
    model, _ = tiny_model("llama")
    model.config.save_pretrained(tmp_path / "tiny-llama")
    return tmp_path / "tiny-llama"


def test_cli_layer_out_of_range_is_a_usage_error_before_loading(capsys, weightless_model, tmp_path):
    code, err = cli(
        capsys,
        "collect",
        "--model",
        str(weightless_model),
        "--pool",
        "harmful",
        "--layer",
        "9",
        "--out",
        str(tmp_path / "x"),
    )
    assert code == 2 and err.strip().splitlines()[-1] == (
        f"hf-lsad collect: error: argument --layer: layer 9 is out of range: {weightless_model} has 4 decoder layers"
    )


def test_cli_reads_the_models_depth_once_for_all_its_layers(capsys, weightless_model, tmp_path, monkeypatch):
    """Each read of a GGUF file's config parses its whole header (seconds), so several ``--layer`` values share one."""
    import transformers

    reads = []
    from_pretrained = transformers.AutoConfig.from_pretrained.__func__

    def counted(cls, *args, **kwargs):
        reads.append(args[0])
        return from_pretrained(cls, *args, **kwargs)

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", classmethod(counted))
    code, err = cli(
        capsys,
        "collect",
        "--model",
        str(weightless_model),
        "--pool",
        "harmful",
        "--layer",
        "0",
        "3",
        "9",
        "--position",
        "prompt_mean",
        "--out",
        str(tmp_path / "x"),
    )
    assert code == 2 and err.strip().splitlines()[-1] == (
        f"hf-lsad collect: error: argument --layer: layer 9 is out of range: {weightless_model} has 4 decoder layers"
    )
    assert len(reads) == 1, reads


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["fit", "--activations", "no-such-store", "--sae", "x", "--out", "g"],
            "argument --activations: no activation store folder 'no-such-store'",
        ),
        (
            ["train-sae", "--activations", ".", "--d-sae", "0", "--out", "s"],
            "argument --d-sae: 0 is not a positive integer",
        ),
        (
            ["evaluate", "--guard", "default", "--safe", ".", "--unsafe", ".", "--benign-ood", "missing"],
            "argument --benign-ood: no activation store folder 'missing'",
        ),
        (["generate", "--guard", "/usr", "hi"], "argument --guard: '/usr' is not a guard folder"),
        (["generate", "--max-new-tokens", "-1", "hi"], "argument --max-new-tokens: -1 is not a positive integer"),
        (
            ["collect", "--model", "./nowhere", "--pool", "harmful", "--out", "x"],
            "argument --model: no model folder, peft adapter folder or .gguf file at './nowhere'",
        ),
        # these loaded, and failed at the Hub with a message about repo ids
        (["generate", "--model", "/nonexistent", "hi"], "argument --model: no model folder, peft adapter folder or"),
        (["screen", "in.jsonl", "--model", "~/nothing", "--out", "v.jsonl"], "argument --model: no model folder"),
        (["serve", "--model", "/usr"], "argument --model: '/usr' is not a model folder (no config.json in it)"),
        (["--bogus"], "unrecognized argument '--bogus'"),
        (["--bogus", "generate", "hi"], "unrecognized arguments: --bogus"),
        (["generate", "--model", "no-such-org/no-such-model", ""], "argument prompts: prompt 0 is empty: ''"),
        (
            ["generate", "--model", "no-such-org/no-such-model", "   "],
            "argument prompts: prompt 0 is empty: whitespace only (3 characters)",
        ),
        # an unset shell variable (--out "$OUT"): '' read as a path is the current folder, which collect filled
        (["collect", "--pool", "safe", "--layer", "1", "--out", ""], "argument --out: empty"),
        (["generate", "--guard", " ", "hi"], "argument --guard: empty"),
        (["screen", "", "--out", "v.jsonl"], "argument input: empty"),
        (["pull", "org/guard", ""], "argument out: empty"),
        (
            ["evaluate", "--guard", "default", "--benign-prompts", "chat=c.txt", "", "--out", "r"],
            "argument --benign-prompts: empty",
        ),
        # '-', standard input or output elsewhere: screen --out - wrote a file called '-', screen - loaded the model
        (["screen", "in.txt", "--out", "-"], "argument --out: '-' (standard input or output) is not read or written"),
        (["screen", "-", "--out", "v.jsonl"], "argument input: '-' (standard input or output)"),
        (["add-head", "--guard", "default", "--name", "x", "--unsafe", "-", "--out", "g"], "argument --unsafe: '-'"),
        (["generate", "--guard", "-", "hi"], "argument --guard: '-' (standard input or output)"),
        (
            ["evaluate", "--guard", "default", "--unsafe-prompts", "harm=-", "--out", "r"],
            "argument --unsafe-prompts: '-' (standard input or output)",
        ),
        (  # a byte that is not UTF-8 in an argument (Python reads it as a lone surrogate)
            ["generate", "--model", "no-such-org/no-such-model", "caf\udce9"],
            "argument prompts: prompt 0 is not Unicode text: a lone surrogate (U+DCE9) at character 3",
        ),
        (
            ["generate", "--model", "no-such-org/no-such-model", "--system", "caf\udce9", "hi"],
            "argument --system: not Unicode text: a lone surrogate (U+DCE9) at character 3",
        ),
        (
            ["explain", "--model", "no-such-org/no-such-model", "--activations", "missing", "hi"],
            "argument --activations: no activation store folder 'missing'",
        ),
    ],
)
def test_cli_usage_errors_are_one_line_with_exit_code_2(capsys, argv, message):
    code, err = cli(capsys, *argv)
    prog = "hf-lsad" if argv[0].startswith("-") else f"hf-lsad {argv[0]}"  # a command's usage errors name it
    assert code == 2 and err.strip().splitlines()[-1].startswith(f"{prog}: error: {message}")


def test_cli_output_into_a_pipe_its_reader_closed_ends_quietly(monkeypatch):
    # hf-lsad generate ... | head -2: head went away, and a one-line BrokenPipeError error followed the output
    import io
    import os
    import sys

    from hf_lsad.cli.checks import run

    read, write = os.pipe()
    os.close(read)
    stderr = io.StringIO()
    with os.fdopen(write, "w") as closed_pipe:
        monkeypatch.setattr(sys, "stdout", closed_pipe)
        monkeypatch.setattr(sys, "stderr", stderr)
        with pytest.raises(SystemExit) as info:
            run(lambda argv: print("a verdict"), [])
    assert info.value.code == 1 and stderr.getvalue() == ""


def test_cli_a_broken_pipe_of_a_connection_is_still_an_error(capsys):
    from hf_lsad.cli.checks import run

    def upload(argv):
        raise BrokenPipeError(32, "Broken pipe")  # a server that went away mid-upload; stdout is fine

    with pytest.raises(SystemExit) as info:
        run(upload, [])
    assert info.value.code == 1 and "error: BrokenPipeError: [Errno 32] Broken pipe" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["fit", "add-head", "set-budget", "train-sae"])
def test_cli_refuses_to_write_over_a_models_folder_before_any_work(capsys, tmp_path, model_dir, command):
    import shutil

    from hf_lsad.core.hook_point import HookPoint
    from hf_lsad.data.store import save_activations

    shutil.copytree(model_dir, tmp_path / "model")
    (tmp_path / "prompts.txt").write_text("".join(f"prompt number {i}\n" for i in range(100)))
    hook = HookPoint("tiny/model", "llama", 4, 4, 1, "model.layers.1", "prompt_last")
    save_activations(tmp_path / "store", torch.randn(30, 4), [{"id": str(i)} for i in range(30)], hook)
    argv = {
        "fit": ["fit", "--activations", str(tmp_path / "store"), "--method", "mahalanobis"],
        "add-head": ["add-head", "--guard", "default", "--name", "x", "--unsafe", str(tmp_path / "prompts.txt")],
        "set-budget": ["set-budget", "--guard", "default", "--benign", str(tmp_path / "prompts.txt")],
        "train-sae": ["train-sae", "--activations", str(tmp_path / "store")],
    }[command]
    code, err = cli(capsys, *argv, "--out", str(tmp_path / "model"))
    assert code == 2 and "argument --out: " in err and "is not the config of a" in err


@pytest.mark.parametrize("command", ["add-head", "set-budget", "teach"])
def test_cli_refuses_to_write_a_card_over_a_projects_readme_before_any_work(capsys, tmp_path, command):
    (tmp_path / "README.md").write_text("# My project\n")
    (tmp_path / "prompts.txt").write_text("".join(f"prompt number {i}\n" for i in range(300)))
    argv = {
        "add-head": ["add-head", "--guard", "default", "--name", "x", "--unsafe", str(tmp_path / "prompts.txt")],
        "set-budget": ["set-budget", "--guard", "default", "--benign", str(tmp_path / "prompts.txt")],
        "teach": ["teach", "--guard", "default", "--benign", str(tmp_path / "prompts.txt")],
    }[command]
    code, err = cli(capsys, *argv, "--out", str(tmp_path))
    assert code == 2 and "argument --out: " in err and "README.md is not a model card hf-lsad wrote" in err
    assert (tmp_path / "README.md").read_text() == "# My project\n"


def test_cli_guard_with_a_nan_threshold_is_refused_before_the_model_loads(capsys, saved):
    _, path = saved
    edit_config(path, lambda c: c["guard"].update(threshold=float("nan")))
    code, err = cli(capsys, "generate", "--model", "no-such-org/no-such-model", "--guard", str(path), "hi")
    assert code == 2 and "argument --guard:" in err and "key 'threshold' is nan" in err


def test_cli_failures_are_one_line_with_exit_code_1_and_debug_shows_the_traceback(capsys, tmp_path):
    (tmp_path / "not-a-store").mkdir()
    argv = ["train-sae", "--activations", str(tmp_path / "not-a-store"), "--out", str(tmp_path / "sae")]
    code, err = cli(capsys, *argv)
    lines = err.strip().splitlines()
    assert code == 1 and len(lines) == 1
    assert lines[0].startswith("hf-lsad: error: GuardFormatError: missing file ") and "--debug" in lines[0]
    from hf_lsad.cli.main import entry

    with pytest.raises(GuardFormatError, match="missing file"):
        entry(["--debug", *argv])


def test_cli_every_option_has_help_text_and_its_default():
    import argparse

    from hf_lsad.cli.main import COMMANDS, build_parser

    for name in COMMANDS:
        subparsers = next(a for a in build_parser(name)._actions if isinstance(a, argparse._SubParsersAction))
        parser = subparsers.choices[name]
        formatter = parser._get_formatter()
        for action in parser._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            assert action.help, f"hf-lsad {name} {action.option_strings or action.dest} has no help text"
            shown = formatter._expand_help(action)
            if action.option_strings and action.default not in (None, False, []):
                assert "default" in shown, f"hf-lsad {name} {action.option_strings} does not show its default"


def test_cli_top_level_help_shows_every_command_in_plain_text():
    from hf_lsad.cli.main import COMMANDS, build_parser

    text = build_parser().format_help()
    for name in COMMANDS:
        assert f"hf-lsad {name} " in text, f"the top-level help shows no example of hf-lsad {name}"
    # it is read in a terminal: no reStructuredText markup, no notes about the module's imports
    assert "``" not in text and ":mod:" not in text and "imports" not in text


def test_cli_flags_generated_from_configs_read_as_plain_text():
    import argparse
    import re

    from hf_lsad.cli.main import build_parser
    from hf_lsad.detectors import DETECTORS

    for method in DETECTORS:
        subparsers = next(a for a in build_parser("fit", method)._actions if isinstance(a, argparse._SubParsersAction))
        text = subparsers.choices["fit"].format_help()
        assert f"{method} settings (" in text, f"{method}: its settings were not generated"
        markup = re.findall(r"``|:[a-z]+:`", text)
        assert not markup, f"hf-lsad fit --method {method} --help shows docstring markup {markup}"
