"""A GGUF model on disk is converted once and read from its conversion after: the same weights, config and tokenizer
as a load from the GGUF file, a damaged or unwritable cache never in the way."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch
from huggingface_hub import HfApi
from tiny_gguf import write_tiny_gguf

from hf_lsad.capture.gguf import CACHE_ENV, RECORD_FILE, cached_conversion, converted_folder
from hf_lsad.capture.pretrained import load_model, load_tokenizer

TEXTS = ["the cat sat", "héllo wörld 漢字 🙂\n\n  tabs\t", "<|im_start|>user\nhi<|im_end|>"]


@pytest.fixture
def gguf(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    (tmp_path / "models").mkdir()
    return write_tiny_gguf(tmp_path / "models" / "tiny.Q8_0.gguf")


def read_from_gguf(model: torch.nn.Module) -> bool:
    """Whether transformers read ``model`` from a GGUF file (it records the quantisation it undid)."""
    return getattr(model.config, "quantization_config", None) is not None


def assert_same_model(loaded: tuple, reference: tuple) -> None:
    (model, tokenizer), (model_ref, tokenizer_ref) = loaded, reference
    state, state_ref = model.state_dict(), model_ref.state_dict()
    assert state.keys() == state_ref.keys()
    assert all(torch.equal(state[name], state_ref[name]) for name in state), "weights differ"
    assert all(state[name].dtype == state_ref[name].dtype for name in state)
    aside = ("quantization_config", "_name_or_path")  # what transformers read; the name is asserted where it matters
    settings = {k: v for k, v in model.config.to_dict().items() if k not in aside}
    settings_ref = {k: v for k, v in model_ref.config.to_dict().items() if k not in aside}
    assert settings == settings_ref
    assert model.generation_config.to_dict() == model_ref.generation_config.to_dict()
    assert [tokenizer(t).input_ids for t in TEXTS] == [tokenizer_ref(t).input_ids for t in TEXTS]
    chat = [{"role": "user", "content": "hi"}]
    assert tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == (
        tokenizer_ref.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    )
    assert tokenizer.special_tokens_map == tokenizer_ref.special_tokens_map
    batch = tokenizer(TEXTS[:2], return_tensors="pt", padding=True)
    with torch.no_grad():
        assert torch.equal(model(**batch).logits, model_ref(**batch).logits)


def test_the_first_load_converts_and_later_loads_read_the_conversion(gguf: Path):
    reference = load_model(str(gguf), gguf_cache=False)
    assert read_from_gguf(reference[0]) and cached_conversion(gguf) is None  # no conversion without the cache

    first = load_model(str(gguf))
    folder = cached_conversion(gguf)
    assert folder is not None and (folder / "model.safetensors").is_file() and (folder / RECORD_FILE).is_file()
    umask = os.umask(0)
    os.umask(umask)
    assert folder.stat().st_mode & 0o777 == 0o777 & ~umask  # as any folder the user makes (mkdtemp's was 0700)
    files = {file.name: file.stat().st_mode & 0o777 for file in folder.iterdir()}  # safetensors' are 0600
    assert files == dict.fromkeys(files, 0o666 & ~umask) and "model.safetensors" in files
    later = load_model(str(gguf))
    assert not read_from_gguf(first[0]) and not read_from_gguf(later[0])
    for loaded in (first, later):
        assert_same_model(loaded, reference)
        assert loaded[0].config.name_or_path == str(gguf)  # what a guard records and matches, as before
        assert loaded[0].name_or_path == str(gguf)  # what a peft adapter records as its base (it was the cache's)
    tokenizer = load_tokenizer(str(gguf))
    assert tokenizer.name_or_path == str(folder) and tokenizer(TEXTS[0]).input_ids == reference[1](TEXTS[0]).input_ids


def test_another_dtype_is_cast_from_the_float32_conversion(gguf: Path):
    reference = load_model(str(gguf), dtype=torch.bfloat16, gguf_cache=False)
    converted = load_model(str(gguf), dtype=torch.bfloat16)  # the first load: it converts at float32
    assert_same_model(converted, reference)
    assert load_model(str(gguf))[0].model.embed_tokens.weight.dtype == torch.float32


def test_a_conversion_belongs_to_the_files_content(gguf: Path, tmp_path: Path):
    copy = tmp_path / "elsewhere" / "renamed.gguf"
    copy.parent.mkdir()
    copy.write_bytes(gguf.read_bytes())
    other = write_tiny_gguf(tmp_path / "models" / "other.gguf", seed=1)
    assert converted_folder(copy).name.split("-")[-1] == converted_folder(gguf).name.split("-")[-1]
    assert converted_folder(other).name.split("-")[-1] != converted_folder(gguf).name.split("-")[-1]
    load_model(str(gguf))
    assert cached_conversion(other) is None
    assert_same_model(load_model(str(other)), load_model(str(other), gguf_cache=False))


@pytest.mark.parametrize("damage", ["truncated weights", "no record", "record not JSON", "a file missing"])
def test_a_damaged_conversion_is_converted_again(gguf: Path, damage: str):
    reference = load_model(str(gguf), gguf_cache=False)
    load_model(str(gguf))
    folder = converted_folder(gguf)
    if damage == "truncated weights":
        weights = folder / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[:1000])
    elif damage == "no record":
        (folder / RECORD_FILE).unlink()
    elif damage == "record not JSON":
        (folder / RECORD_FILE).write_text('{"files": ')
    else:
        (folder / "tokenizer.json").unlink()
    assert cached_conversion(gguf) is None
    with pytest.warns(UserWarning, match="not a complete conversion .* converting it again"):
        again = load_model(str(gguf))
    assert_same_model(again, reference)
    assert cached_conversion(gguf) == folder


def test_a_cache_that_cannot_be_written_warns_and_loads_the_gguf_file(gguf: Path, tmp_path: Path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    monkeypatch.setenv(CACHE_ENV, str(blocker / "cache"))
    with pytest.warns(UserWarning, match=f"cannot write the GGUF cache .*; set {CACHE_ENV}"):
        loaded = load_model(str(gguf))
    assert read_from_gguf(loaded[0])
    assert_same_model(loaded, load_model(str(gguf), gguf_cache=False))


def test_a_conversion_this_user_may_not_read_warns_and_loads_the_gguf_file(gguf: Path, monkeypatch):
    load_model(str(gguf))  # converted, as by another user of a shared cache
    folder = cached_conversion(gguf)
    assert folder is not None
    weights = folder / "model.safetensors"
    readable = os.access
    # root reads any file: deny the weights as the kernel would another user (an older hf-lsad wrote them 0600)
    monkeypatch.setattr(os, "access", lambda path, mode, **kw: Path(path) != weights and readable(path, mode, **kw))
    with pytest.warns(UserWarning, match=r"may not read \(model\.safetensors\): reading .*tiny\.Q8_0\.gguf itself"):
        assert cached_conversion(gguf) is None  # the tokenizer alone comes from the GGUF file too
    with pytest.warns(UserWarning, match=f"chmod -R a\\+rX\\), or set {CACHE_ENV}"):
        loaded = load_model(str(gguf))
    assert read_from_gguf(loaded[0])  # before: FileNotFoundError of a file that is there
    assert_same_model(loaded, load_model(str(gguf), gguf_cache=False))


def test_two_processes_converting_at_once_share_one_complete_conversion(gguf: Path):
    """Processes, not threads: transformers' model loading patches globals (the meta device), and two loads in
    threads of one process leave them patched."""
    script = f"from hf_lsad.capture.pretrained import load_model; load_model({str(gguf)!r}); print('loaded')"
    processes = [
        subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    outputs = [process.communicate(timeout=300) for process in processes]
    for process, (out, err) in zip(processes, outputs):
        assert process.returncode == 0 and out.strip() == "loaded", err
        assert "Warning" not in err, err  # neither found the other's work damaged, nor failed to write
    folder = cached_conversion(gguf)
    assert folder is not None
    assert [p.name for p in folder.parent.iterdir()] == [folder.name]  # no staging folder left behind
    assert_same_model(load_model(str(gguf)), load_model(str(gguf), gguf_cache=False))


def test_a_killed_conversions_folder_is_removed_by_the_next(gguf: Path):
    """A first load killed outright (SIGKILL, the OOM killer) left its staging folder, for the bundled model 540 MB,
    in the cache for good; one that another conversion still holds is kept."""
    from hf_lsad.core.locking import marked_in_use
    from hf_lsad.core.serialization import ABANDONED_AFTER

    folder = converted_folder(gguf)
    folder.parent.mkdir(parents=True)
    killed, running = folder.parent / f".{folder.name}-dead0000", folder.parent / f".{folder.name}-busy0000"
    for staging in (killed, running):
        staging.mkdir()
        (staging / "model.safetensors").write_bytes(b"partial")
        past = staging.stat().st_mtime - ABANDONED_AFTER - 1
        os.utime(staging, (past, past))
    with marked_in_use(running):
        load_model(str(gguf))
    assert not killed.exists() and running.exists()
    assert cached_conversion(gguf) == folder


def test_a_gguf_file_in_a_hub_repo_loads_as_transformers_reads_it(gguf: Path, hub_server, hub_cache):
    """Only a GGUF file on disk is converted; ``load_model(repo, gguf_file=...)`` downloads it as before."""
    repo_id = f"hf-lsad-org/gguf-{uuid.uuid4().hex[:8]}"
    api = HfApi()
    api.create_repo(repo_id)
    api.upload_file(path_or_fileobj=gguf, path_in_repo=gguf.name, repo_id=repo_id)
    loaded = load_model(repo_id, gguf_file=gguf.name, cache_dir=hub_cache)
    assert read_from_gguf(loaded[0]) and not any(Path(os.environ[CACHE_ENV]).glob("*"))
    assert_same_model(loaded, load_model(str(gguf), gguf_cache=False))
    assert load_tokenizer(repo_id, gguf_file=gguf.name, cache_dir=hub_cache)(TEXTS[0]).input_ids == (
        loaded[1](TEXTS[0]).input_ids
    )


def test_an_adapter_of_a_gguf_model_names_the_file_and_loads_onto_its_conversion(gguf: Path, tmp_path: Path):
    from peft import LoraConfig, get_peft_model

    from hf_lsad.capture.adapters import adapter_digest

    model, _ = load_model(str(gguf))
    adapted = get_peft_model(model, LoraConfig(target_modules=["q_proj"], r=2, init_lora_weights=False))
    adapted.save_pretrained(tmp_path / "adapter")
    assert adapted.peft_config["default"].base_model_name_or_path == str(gguf)  # not the conversion's folder
    loaded, tokenizer = load_model(str(tmp_path / "adapter"))
    assert not read_from_gguf(loaded) and loaded.config.name_or_path == str(gguf)
    assert adapter_digest(loaded) == adapter_digest(adapted) is not None
    assert tokenizer.name_or_path == str(cached_conversion(gguf))
