"""A file or folder one run writes at a time: a screen's verdicts, a cache of bundled activations.

Two runs on one output would each do the work the other has not yet written, and one's clean-up (a half-written
line cut off, a finished collection's parts removed) could destroy the other's. The second run is refused instead.
"""

from __future__ import annotations

import contextlib
import errno
import os
import threading
import warnings
from collections.abc import Iterator
from pathlib import Path

_NO_LOCKS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP)
"""What ``flock`` raises on a file system without locks (some network mounts)."""


_holding = threading.local()
"""Per thread, the paths it holds (``paths``: a set): a hold is a descriptor's, so a thread that held a path twice
would refuse itself."""


@contextlib.contextmanager
def held_alone(path: Path, busy: str) -> Iterator[None]:
    """Hold the file or folder ``path`` (which must exist) for this run until the block ends; ``ValueError`` with
    the message ``busy`` while another run (another process, or another thread) holds it.

    The hold is an advisory ``flock`` on a descriptor of its own, which the system releases when it is closed or the
    process ends, however it ends (no stale lock after a kill), and which leaves nothing in ``path``. A block inside
    another on the same path, in the same thread (a command that holds its cache, and a collection into it), holds
    it again. Where ``fcntl`` does not exist (Windows) nothing is held, and on a file system without locks nothing
    is held and a warning says so."""
    if not hasattr(_holding, "paths"):
        _holding.paths = set()
    held: set[Path] = _holding.paths
    key = path.resolve()
    if key in held:  # held by an outer block of this thread, which lets it go
        yield
        return
    with _flocked(path, busy, quiet=False):
        held.add(key)
        try:
            yield
        finally:
            held.discard(key)


@contextlib.contextmanager
def _flocked(path: Path, busy: str, *, quiet: bool) -> Iterator[None]:
    """``path`` locked for the block; ``quiet``: no warning on a file system without locks."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    descriptor = os.open(path, os.O_RDONLY)
    try:
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ValueError(busy) from None
        except OSError as err:
            if err.errno not in _NO_LOCKS:
                raise
            if not quiet:
                message = f"{path} cannot be held ({err.strerror}): another run on it is not refused"
                warnings.warn(message, stacklevel=5)  # the line of the caller of held_alone
        yield
    finally:
        os.close(descriptor)


def check_not_held(path: Path, busy: str) -> None:
    """``ValueError`` with the message ``busy`` if another run holds ``path`` now (:func:`held_alone`): what a
    command checks before it loads a model, to refuse then rather than after. The run still holds ``path`` itself
    when it starts writing. A path that does not exist is held by no run."""
    held: set[Path] = getattr(_holding, "paths", set())
    if not path.exists() or path.resolve() in held:  # held by no run, or by this one
        return
    with _flocked(path, busy, quiet=True):  # a file system without locks: the run itself says so
        pass


@contextlib.contextmanager
def marked_in_use(path: Path) -> Iterator[None]:
    """Hold the folder or file ``path`` for the block so that :func:`abandoned` says ``False`` of it. Unlike
    :func:`held_alone` it refuses nothing and warns of nothing: where locks do not work, :func:`abandoned` says
    ``False`` of every path."""
    with _flocked(path, f"{path} is in use by another run", quiet=True):
        yield


def abandoned(path: Path) -> bool:
    """Whether no run holds ``path`` (:func:`marked_in_use`, :func:`held_alone`), as far as this system can tell:
    ``False`` where it cannot (no ``fcntl``, a file system without locks), so that nothing in use is taken for
    abandoned."""
    try:
        import fcntl
    except ImportError:
        return False
    descriptor = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    except OSError as err:
        if err.errno in _NO_LOCKS:
            return False
        raise
    finally:
        os.close(descriptor)
    return True
