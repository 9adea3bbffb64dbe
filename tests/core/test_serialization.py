"""What a save leaves on disk can be read by whoever the folder is shared with, and a file this user may not read
is named as such."""

from __future__ import annotations

import os
import pathlib
from pathlib import Path

import pytest
import torch
from tiny import two_headed_guard

from hf_lsad.core.hook_point import HookPoint
from hf_lsad.core.serialization import folder_path
from hf_lsad.data.store import ActivationStore, load_activations, save_activations
from hf_lsad.guard import SafetyGuard
from hf_lsad.sae.model import SparseAutoencoder

HOOK = HookPoint("tiny/model", "llama", 4, 4, 1, "model.layers.1", "prompt_last")


@pytest.fixture(params=[0o022, 0o077, 0o002], ids=lambda mask: f"umask-{mask:03o}")
def umask(request: pytest.FixtureRequest):
    previous = os.umask(request.param)
    yield request.param
    os.umask(previous)


def file_modes(folder: Path) -> dict[str, int]:
    return {p.relative_to(folder).as_posix(): p.stat().st_mode & 0o777 for p in folder.rglob("*") if p.is_file()}


def test_every_saved_file_has_the_mode_the_umask_gives(tmp_path: Path, umask: int):
    # safetensors writes its files 0600: a guard saved to a shared folder had JSON others could read beside weights
    # they could not (a server's account failed to load it)
    two_headed_guard().save_pretrained(tmp_path / "guard")
    records = [{"id": str(i), "text": f"prompt {i}", "category": "safe"} for i in range(5)]
    save_activations(tmp_path / "store", torch.randn(5, 4), records, HOOK, shard_size=2)
    for folder in ("guard", "store"):
        modes = file_modes(tmp_path / folder)
        assert any(name.endswith(".safetensors") for name in modes) and any(name.endswith(".json") for name in modes)
        assert modes == dict.fromkeys(modes, 0o666 & ~umask), folder
    assert not [p for p in tmp_path.rglob(".mode-*")]  # the probe is gone


def test_a_file_this_user_may_not_read_is_named_with_its_mode(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    two_headed_guard().save_pretrained(tmp_path / "guard")
    save_activations(tmp_path / "store", torch.randn(5, 4), [{"id": str(i)} for i in range(5)], HOOK)
    denied = {tmp_path / "guard" / "heads" / "harm.safetensors", tmp_path / "store" / "shard-00000.safetensors"}
    assert all(path.is_file() for path in denied)
    opened = pathlib.Path.open

    def open_as_another_user(self: Path, *args, **kwargs):  # root reads any file: deny these as the kernel would
        if self in denied:
            raise PermissionError(13, "Permission denied", str(self))
        return opened(self, *args, **kwargs)

    monkeypatch.setattr(pathlib.Path, "open", open_as_another_user)
    # safetensors itself said "No such file or directory" of such a file, and the loaders called it corrupt
    with pytest.raises(PermissionError, match=r"harm\.safetensors cannot be read by this user \(mode -rw-"):
        SafetyGuard.from_pretrained(tmp_path / "guard")
    with pytest.raises(PermissionError, match=r"shard-00000\.safetensors cannot be read by this user"):
        load_activations(tmp_path / "store")


def test_a_save_to_a_file_says_it_is_not_a_folder(tmp_path: Path):
    (tmp_path / "a-file").write_text("kept")
    with pytest.raises(FileExistsError, match=r"a-file is a file, not a folder: what is saved there is a folder"):
        two_headed_guard().save_pretrained(tmp_path / "a-file")
    with pytest.raises(FileExistsError, match=r"a-file is a file, not a folder"):
        save_activations(tmp_path / "a-file", torch.randn(5, 4), [{"id": str(i)} for i in range(5)], HOOK)
    assert (tmp_path / "a-file").read_text() == "kept"


KILLED_SAVE = """
import os, signal, sys
from pathlib import Path
from tiny import two_headed_guard
import hf_lsad.core.serialization as serialization

guard = two_headed_guard()


def die(folder):  # every file written, none moved
    os.kill(os.getpid(), signal.SIGKILL)


serialization.new_file_modes = die
guard.save_pretrained(Path(sys.argv[1]))
"""


def test_a_killed_saves_folder_is_removed_by_the_next_save(tmp_path: Path):
    """A save killed outright (no ``finally`` runs) left its staging folder, partial files and all, in the guard
    folder for good, and a push uploaded it."""
    import subprocess
    import sys

    from hf_lsad.core.serialization import ABANDONED_AFTER, STAGING_PREFIX

    killed = subprocess.run(
        [sys.executable, "-c", KILLED_SAVE, str(tmp_path / "guard")],
        cwd=Path(__file__).parents[1],
        env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])},
        capture_output=True,
    )
    assert killed.returncode == -9, killed.stderr.decode()
    (left,) = (tmp_path / "guard").glob(f"{STAGING_PREFIX}*")
    assert any(left.rglob("*.safetensors"))
    two_headed_guard().save_pretrained(tmp_path / "guard")
    assert left.exists()  # changed a moment ago: it could be a save's that has not yet marked it
    past = left.stat().st_mtime - ABANDONED_AFTER - 1
    os.utime(left, (past, past))
    two_headed_guard().save_pretrained(tmp_path / "guard")
    assert not left.exists()
    assert not list((tmp_path / "guard").glob(f"{STAGING_PREFIX}*"))
    SafetyGuard.from_pretrained(tmp_path / "guard")


def test_a_folder_a_save_holds_is_kept_however_old(tmp_path: Path):
    from hf_lsad.core.locking import marked_in_use
    from hf_lsad.core.serialization import ABANDONED_AFTER, STAGING_PREFIX, remove_abandoned_staging

    held = tmp_path / f"{STAGING_PREFIX}held"
    old = tmp_path / f"{STAGING_PREFIX}old"
    for folder in (held, old):
        folder.mkdir()
        (folder / "sae.safetensors").write_bytes(b"partial")
        past = folder.stat().st_mtime - ABANDONED_AFTER - 1
        os.utime(folder, (past, past))
    with marked_in_use(held):
        assert remove_abandoned_staging(tmp_path) == [old]
    assert held.exists() and not old.exists()


def _save_guarded_model(folder: str) -> None:
    from hf_lsad import GuardedModelForCausalLM
    from hf_lsad.testing import tiny_model

    model, tokenizer = tiny_model("llama", seed=0)
    GuardedModelForCausalLM(model, two_headed_guard(), tokenizer=tokenizer).save_pretrained(folder)


def _load_guarded_model(folder: str) -> None:
    from hf_lsad import GuardedModelForCausalLM

    GuardedModelForCausalLM.from_pretrained(folder)


EMPTY_FOLDER_CALLS = {
    "guard.save_pretrained": lambda folder: two_headed_guard().save_pretrained(folder),
    "SafetyGuard.from_pretrained": SafetyGuard.from_pretrained,
    "sae.save_pretrained": lambda folder: two_headed_guard().parts().sae.save_pretrained(folder),
    "SparseAutoencoder.from_pretrained": lambda folder: SparseAutoencoder.from_pretrained(folder),
    "save_activations": lambda folder: save_activations(
        folder, torch.randn(1, 4), [{"id": "0", "text": "a", "category": "safe"}], HOOK
    ),
    "load_activations": load_activations,
    "ActivationStore": ActivationStore,
    "GuardedModelForCausalLM.save_pretrained": _save_guarded_model,
    "GuardedModelForCausalLM.from_pretrained": _load_guarded_model,
}


@pytest.mark.parametrize("folder", ["", "  "], ids=["empty", "blank"])
@pytest.mark.parametrize("call", list(EMPTY_FOLDER_CALLS), ids=str)
def test_an_empty_folder_name_is_refused_not_read_as_the_current_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, call: str, folder: str
):
    # Path("") is the current folder: a save filled it (an unset variable in f"{out}"), a load read it
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="is empty"):
        EMPTY_FOLDER_CALLS[call](folder)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("value", [None, 3, b"guard"], ids=["None", "int", "bytes"])
def test_a_folder_that_is_not_a_path_is_a_type_error(value: object):
    with pytest.raises(TypeError, match="must be a path"):
        folder_path(value, "save_directory")  # type: ignore[arg-type]
