"""A file one run writes at a time (:func:`hf_lsad.core.locking.held_alone`)."""

from __future__ import annotations

import sys

import pytest

from hf_lsad.core.locking import check_not_held, held_alone

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="held with flock")


@pytest.mark.parametrize("kind", ["file", "folder"])
def test_a_path_held_is_refused_to_another_run_until_the_first_ends(tmp_path, kind):
    path = tmp_path / "held"
    path.mkdir() if kind == "folder" else path.write_text("verdicts\n")
    with held_alone(path, "busy: wait"):
        with pytest.raises(ValueError, match=r"^busy: wait$"), held_alone(path, "busy: wait"):
            pass
    with held_alone(path, "busy: wait"):  # released with the first block
        pass
    assert (list(path.iterdir()) == []) if kind == "folder" else path.read_text() == "verdicts\n"  # nothing added


def test_a_path_is_released_when_the_block_raises(tmp_path):
    with pytest.raises(KeyboardInterrupt), held_alone(tmp_path, "busy"):
        raise KeyboardInterrupt
    with held_alone(tmp_path, "busy"):
        pass


def test_a_file_system_without_locks_holds_nothing_and_says_so(tmp_path, monkeypatch):
    import errno
    import fcntl

    def no_locks(*_):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)  # as on a network mount without a lock daemon
    with pytest.warns(UserWarning, match="cannot be held \\(No locks available\\): another run on it is not refused"):
        with held_alone(tmp_path, "busy"):
            pass


def test_a_check_before_the_work_refuses_a_path_held_and_holds_nothing_itself(tmp_path):
    check_not_held(tmp_path / "absent", "busy")  # held by no run
    with held_alone(tmp_path, "busy"), pytest.raises(ValueError, match=r"^busy$"):
        check_not_held(tmp_path, "busy")
    check_not_held(tmp_path, "busy")
    with held_alone(tmp_path, "busy"):  # the check let it go
        pass
