"""Where a model is loaded from: a Hub id at a revision, a folder, a GGUF file, or the bundled SmolLM2; the tokenizer
always comes from the same place as the weights."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
from huggingface_hub import HfApi
from transformers import AutoTokenizer

from hf_lsad.capture.pretrained import (
    DEFAULT_MODEL,
    GGUF_FILE,
    bundled_model_dir,
    load_model,
    load_tokenizer,
    model_location,
)
from hf_lsad.cli.main import entry

# huggingface_hub's legacy LFS upload (the path taken with HF_HUB_DISABLE_XET=1) PUTs with `data=`, which httpx2
# deprecates; that is the client's business, not ours.
pytestmark = pytest.mark.filterwarnings("ignore:Use 'content=<...>' to upload raw bytes:DeprecationWarning")

MARKER = "<second-revision>"


def test_model_location_of_each_kind(tmp_path: Path):
    assert model_location("default") == (str(bundled_model_dir()), {"gguf_file": GGUF_FILE})
    assert model_location(DEFAULT_MODEL, revision="x") == (
        str(bundled_model_dir()),
        {"revision": "x", "gguf_file": GGUF_FILE},
    )
    gguf = tmp_path / "model.Q4.gguf"
    gguf.write_bytes(b"GGUF")
    assert model_location(str(gguf)) == (str(tmp_path), {"gguf_file": "model.Q4.gguf"})
    assert model_location("org/name", revision="v1") == ("org/name", {"revision": "v1"})
    (tmp_path / "config.json").write_text("{}")
    assert model_location(str(tmp_path)) == (str(tmp_path), {})
    with pytest.raises(FileNotFoundError, match="no such GGUF file"):
        model_location(str(tmp_path / "missing.gguf"))
    with pytest.raises(ValueError, match="beside a path to a GGUF file"):
        model_location(str(gguf), gguf_file="other.gguf")


@pytest.mark.parametrize("load", [load_model, load_tokenizer], ids=["load_model", "load_tokenizer"])
def test_a_path_that_holds_no_model_is_named_before_any_load(load, tmp_path: Path):
    """Before, transformers read such a path as a Hub repo id and said it was not a valid one (or, for an empty
    folder, that it needed sentencepiece to convert a slow tokenizer)."""
    with pytest.raises(
        FileNotFoundError, match=r"no model folder, peft adapter folder or \.gguf file at '/no/such/path'"
    ):
        load("/no/such/path")
    with pytest.raises(FileNotFoundError, match="no model folder, peft adapter folder"):
        load(Path("/no/such/path"))  # a Path as transformers takes one (an AttributeError before)
    with pytest.raises(FileNotFoundError, match=r"is not a model folder \(no config.json in it\)"):
        load(str(tmp_path))
    (tmp_path / "notes.txt").write_text("not a model")
    with pytest.raises(FileNotFoundError, match=r"notes\.txt' is not a model folder"):
        load(str(tmp_path / "notes.txt"))


def test_a_folder_that_holds_its_model_elsewhere_is_a_model(tmp_path: Path):
    """A model in a ``subfolder``, or a GGUF file named by ``gguf_file``, is where transformers will look for it."""
    (tmp_path / "weights").mkdir()
    (tmp_path / "weights" / "config.json").write_text("{}")
    assert model_location(str(tmp_path), subfolder="weights") == (str(tmp_path), {"subfolder": "weights"})
    (tmp_path / "model.gguf").write_bytes(b"GGUF")
    assert model_location(str(tmp_path), gguf_file="model.gguf") == (str(tmp_path), {"gguf_file": "model.gguf"})
    with pytest.raises(FileNotFoundError, match="is not a model folder"):
        model_location(str(tmp_path), gguf_file="other.gguf")


def test_the_tokenizer_comes_from_the_revision_the_model_does(hub_server, hub_cache, model_dir, tmp_path):
    """Before, ``load_model(repo, revision=...)`` read the weights at that revision and the tokenizer at ``main``
    (and from the default cache, whatever ``cache_dir`` said)."""
    repo_id = f"hf-lsad-org/model-{uuid.uuid4().hex[:8]}"
    api = HfApi()
    api.create_repo(repo_id)
    first = api.upload_folder(folder_path=model_dir, repo_id=repo_id)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.add_tokens([MARKER])
    tokenizer.save_pretrained(tmp_path / "second")
    api.upload_folder(folder_path=tmp_path / "second", repo_id=repo_id)

    _, at_first = load_model(repo_id, revision=first.oid, cache_dir=hub_cache)
    _, latest = load_model(repo_id, cache_dir=hub_cache)
    assert MARKER not in at_first.get_vocab() and MARKER in latest.get_vocab()
    assert MARKER not in load_tokenizer(repo_id, revision=first.oid, cache_dir=hub_cache).get_vocab()


def test_the_cli_reads_a_gguf_files_depth_before_loading_it(capsys):
    """The bundled model's own file, named by its path (``model_location`` gives transformers its folder and name;
    the tokenizer and the weights are read the same way)."""
    path = str(bundled_model_dir() / GGUF_FILE)
    with pytest.raises(SystemExit) as exit_info:
        entry(["collect", "--model", path, "--pool", "harmful", "--layer", "30", "--out", "x"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2
    assert f"argument --layer: layer 30 is out of range: {path} has 30 decoder layers" in err, err
    with pytest.raises(SystemExit) as exit_info:
        entry(["collect", "--model", "./missing.gguf", "--pool", "harmful", "--out", "x"])
    assert exit_info.value.code == 2
    assert "argument --model: no model folder, peft adapter folder or .gguf file at './missing.gguf'" in (
        capsys.readouterr().err
    )
