"""One lock per directory memgas writes (a bank, a run directory), taken before the first write.

The lock is an ``flock`` on ``DIR/.memgas.lock``: released by the kernel when the holder exits, even by
``kill -9``, so a crashed run never leaves a stale lock behind. It lives here (not in the job runner)
because ``memgas ingest`` (pipeline) and ``memgas run`` (jobs) must take the very same lock on a bank.
"""

from __future__ import annotations

import errno
import fcntl
import os
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from memgas.pipeline.errors import MemgasError

#: the lock file's name inside the locked directory; never a user's file, never removed by ``--fresh``
LOCK = ".memgas.lock"


@contextmanager
def locked(directory: Path, *, shared: bool = False) -> Iterator[None]:
    """Hold an exclusive lock on ``directory`` (created if missing) or raise a one-line MemgasError saying
    who holds it. Two writers on one directory would both do all the work, or one would delete the other's.

    ``shared``: a reader's lock (``memgas answer`` on a bank), held by any number of readers at once and
    by none while a writer holds the exclusive one, so a reader sees one state of the directory from start
    to end (no append or index in between). A directory the reader may not write and that has no lock file
    is read without one: no writer can have locked it either."""
    directory = Path(directory)
    if not shared:
        directory.mkdir(parents=True, exist_ok=True)
    path = directory / LOCK
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        if not shared or exc.errno not in (errno.EACCES, errno.EPERM, errno.EROFS):
            raise
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            yield
            return
    try:
        try:
            fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
        except BlockingIOError:
            # a writer's lock names its holder; readers' locks name nobody (several may hold one at once)
            holder = (os.pread(fd, 512, 0).decode(errors="replace").strip()
                      or "another memgas process (an answer reading it, or one starting)")
            raise MemgasError(f"{directory} is in use by {holder}; wait for it to finish or use another "
                              "directory") from None
        # the holder may have removed the directory (a failed first ingest cleans up after itself) between
        # our open() and our flock(): then we hold a lock on a deleted file that nobody else sees
        try:
            same = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if not same:
            raise MemgasError(f"{directory} was removed or replaced by another memgas process while this one "
                              "waited for it; re-run the command")
        if not shared:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()} since "
                          f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}".encode(), 0)
        try:
            yield
        finally:
            if not shared:  # the name goes with the lock: a reader holding it later is not taken for this writer
                try:
                    os.ftruncate(fd, 0)
                except OSError:
                    pass
    finally:
        os.close(fd)  # closing releases the lock
