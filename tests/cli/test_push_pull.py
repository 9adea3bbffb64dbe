"""``hf-lsad push`` and ``hf-lsad pull`` against the suite's Hub-compatible server: a round trip, bit-exact."""

from __future__ import annotations

import dataclasses
import re
import uuid

import pytest
from tiny import two_headed_guard

from hf_lsad.cli.main import entry
from hf_lsad.guard import SafetyGuard

pytestmark = pytest.mark.filterwarnings("ignore:Use 'content=<...>' to upload raw bytes:DeprecationWarning")


def files_of(folder):
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_push_then_pull_gives_the_same_files_at_the_pinned_commit(hub_server, tmp_path, capsys):
    guard_dir, repo_id = tmp_path / "guard", f"hf-lsad-org/cli-{uuid.uuid4().hex[:8]}"
    guard = two_headed_guard()
    guard.save_pretrained(guard_dir, data="the tiny benign prompts")  # with a card: push keeps it as it is
    entry(["push", str(guard_dir), repo_id, "--private"])
    sha = re.search(r" at ([0-9a-f]{40})\n", capsys.readouterr().out).group(1)

    guard.set_budget(dataclasses.replace(guard.budget, rows="changed"))
    guard.push_to_hub(repo_id)  # main moves on; the pinned commit still holds the first upload
    entry(["pull", repo_id, str(tmp_path / "pulled"), "--revision", sha])
    assert f"pulled {repo_id} at {sha}" in capsys.readouterr().out
    assert files_of(tmp_path / "pulled") == files_of(guard_dir)


def test_a_pull_that_fails_leaves_no_half_guard_and_can_be_run_again(hub_server, tmp_path, capsys, monkeypatch):
    """A pull copied straight into its folder: one that failed or was killed midway left half a guard there, which
    the next pull refused as a folder that is not empty."""
    import shutil

    repo_id = f"hf-lsad-org/cli-{uuid.uuid4().hex[:8]}"
    two_headed_guard().push_to_hub(repo_id)
    out = tmp_path / "pulled"
    copytree = shutil.copytree

    copied = []

    def disk_full(src, dst):  # the second tensor file does not fit
        if str(dst).endswith(".safetensors"):
            if copied:
                raise OSError(28, "No space left on device")
            copied.append(dst)
        return shutil.copy2(src, dst)

    def copytree_disk_full(src, dst, symlinks=False, ignore=None, copy_function=None, *args, **kwargs):
        return copytree(src, dst, symlinks, ignore, disk_full, *args, **kwargs)  # its subfolders too

    monkeypatch.setattr(shutil, "copytree", copytree_disk_full)
    with pytest.raises(SystemExit):
        entry(["pull", repo_id, str(out)])
    monkeypatch.undo()
    assert "No space left on device" in capsys.readouterr().err
    assert not [p for p in out.rglob("*") if p.is_file()], list(out.rglob("*"))  # no half of a guard
    (out / ".hf-lsad-saving-killed").mkdir()  # what a pull killed outright leaves
    (out / ".hf-lsad-saving-killed" / "config.json").write_text("{}")
    entry(["pull", repo_id, str(out)])
    assert f"pulled {repo_id}" in capsys.readouterr().out
    assert SafetyGuard.from_pretrained(out).head_names == two_headed_guard().head_names


@pytest.mark.parametrize(
    ("argv", "error"),
    [
        (["push", "no-such-folder", "org/x"], "is not a guard folder"),
        (["pull", "org/x", "EXISTING"], "exists and is not an empty folder"),
    ],
)
def test_push_and_pull_refuse_bad_folders_before_the_network(argv, error, tmp_path, capsys):
    (tmp_path / "existing").mkdir()
    (tmp_path / "existing" / "a").write_text("x")
    argv = [str(tmp_path / "existing") if a == "EXISTING" else a for a in argv]
    with pytest.raises(SystemExit) as info:
        entry(argv)
    assert info.value.code == 2 and error in capsys.readouterr().err
