"""A file or folder one run writes at a time (:func:`hf_lsad.core.locking.held_alone`)."""

from __future__ import annotations

import errno
import fcntl
import sys

import pytest
from tiny import held_by_another_run, refused_to_another_run

from hf_lsad.core.locking import check_not_held, held_alone

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="held with flock")


@pytest.mark.parametrize("kind", ["file", "folder"])
def test_a_path_another_run_holds_is_refused_until_that_run_ends(tmp_path, kind):
    path = tmp_path / "held"
    path.mkdir() if kind == "folder" else path.write_text("verdicts\n")
    with held_by_another_run(path), pytest.raises(ValueError, match=r"^busy: wait$"), held_alone(path, "busy: wait"):
        pass
    with held_alone(path, "busy: wait"):  # released when that run ended
        pass
    assert (list(path.iterdir()) == []) if kind == "folder" else path.read_text() == "verdicts\n"  # nothing added


def test_a_run_holds_a_path_again_inside_its_own_hold_and_lets_it_go_once(tmp_path):
    """A command holds its --cache from start to end, and each collection into it holds it again."""
    with held_alone(tmp_path, "busy"):
        with held_alone(tmp_path, "busy"):
            pass
        check_not_held(tmp_path, "busy")  # held by this run, not another
        assert refused_to_another_run(tmp_path)  # still held after the inner block
    assert not refused_to_another_run(tmp_path)  # let go with the outer block


def test_a_path_is_released_when_the_block_raises(tmp_path):
    with pytest.raises(KeyboardInterrupt), held_alone(tmp_path, "busy"):
        raise KeyboardInterrupt
    with held_by_another_run(tmp_path):
        pass


def test_a_check_before_the_work_refuses_a_path_another_run_holds_and_holds_nothing_itself(tmp_path):
    check_not_held(tmp_path / "absent", "busy")  # held by no run
    with held_by_another_run(tmp_path), pytest.raises(ValueError, match=r"^busy$"):
        check_not_held(tmp_path, "busy")
    check_not_held(tmp_path, "busy")
    with held_by_another_run(tmp_path):  # the check let it go
        pass


def test_a_file_system_without_locks_holds_nothing_and_says_so_at_the_callers_line(tmp_path, monkeypatch):
    def no_locks(*_):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)  # as on a network mount without a lock daemon
    with pytest.warns(
        UserWarning, match="cannot be held \\(No locks available\\): another run on it is not refused"
    ) as caught:
        with held_alone(tmp_path, "busy"):
            pass
    assert caught[0].filename == __file__
