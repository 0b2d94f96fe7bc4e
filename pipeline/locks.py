"""One lock per directory memgas writes (a bank, a run directory), taken before the first write.

The lock is an ``flock`` on ``DIR/.memgas.lock``: released by the kernel when the holder exits, even by
``kill -9``, so a crashed run never leaves a stale lock behind. It lives here (not in the job runner)
because ``memgas ingest`` (pipeline) and ``memgas run`` (jobs) must take the very same lock on a bank.
"""

from __future__ import annotations

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
def locked(directory: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``directory`` (created if missing) or raise a one-line MemgasError saying
    who holds it. Two writers on one directory would both do all the work, or one would delete the other's."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / LOCK
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 512, 0).decode(errors="replace").strip() or "another process"
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
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()} since "
                      f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}".encode(), 0)
        yield
    finally:
        os.close(fd)  # closing releases the lock
