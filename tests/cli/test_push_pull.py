"""``hf-lsad push`` and ``hf-lsad pull`` against the suite's Hub-compatible server: a round trip, bit-exact."""

from __future__ import annotations

import dataclasses
import re
import uuid

import pytest
from tiny import two_headed_guard

from hf_lsad.cli.main import entry

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
