"""Advisory locks (flock) that the operating system drops when their holder dies, even by kill -9: they tell a run
that holds a batch's results file from one that is gone, and a temporary file or directory that a running gali is
still writing from one that a killed gali left behind (which is then safe to delete, whatever its age or size).

POSIX systems only: where there is no flock (Windows), a temporary counts as left behind only once it is an hour old.
"""

import errno
import os
import time
from pathlib import Path

GRACE_SECONDS = 10.0  # a writer locks its temporary just after creating it: one younger than this is never judged
STALE_SECONDS = 3600.0  # where nothing can be locked, a temporary this old is taken as left behind
_HELD = (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK)


def lock_exclusive(descriptor: int, wait: bool = False) -> None:
    """An exclusive lock on the open file or directory, or OSError: at once (unless `wait`) EAGAIN / EWOULDBLOCK if
    another open holds one; ENOTSUP where there is no flock (Windows)."""
    try:
        import fcntl
    except ImportError:
        raise OSError(errno.ENOTSUP, "no flock here") from None
    fcntl.flock(descriptor, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))


def is_held_elsewhere(error: OSError) -> bool:
    """Whether lock_exclusive failed because another process holds the lock (not because locks are unavailable)."""
    return error.errno in _HELD


def hold(path: Path) -> int | None:
    """Lock the temporary `path` that this process has just created and is about to write, for as long as the
    returned descriptor stays open (close it once the temporary is renamed or deleted); None where nothing can be
    locked."""
    try:
        descriptor = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        lock_exclusive(descriptor, wait=True)  # another gali may be looking at it this instant: it lets go at once
    except OSError:
        os.close(descriptor)
        return None
    return descriptor


def left_behind(path: Path) -> bool:
    """Whether the temporary `path` was left by a writer that is gone: no process holds its lock (where nothing can
    be locked: it is STALE_SECONDS old), and it is at least GRACE_SECONDS old."""
    try:
        age = time.time() - path.stat().st_mtime
        descriptor = os.open(path, os.O_RDONLY)
    except OSError:
        return False  # gone meanwhile, or not ours to open
    try:
        lock_exclusive(descriptor)
    except OSError as error:
        return not is_held_elsewhere(error) and age >= STALE_SECONDS
    finally:
        os.close(descriptor)  # releases the lock we may have taken
    return age >= GRACE_SECONDS
