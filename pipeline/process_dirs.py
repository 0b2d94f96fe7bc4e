"""Scratch directories owned by one process, and the sweep of those whose process was killed.

A scratch directory is deleted by its owner when the work ends, but a process killed by SIGKILL (the OOM
killer, a user's ``kill -9``) cannot delete it, and what it held may be gigabytes (the node blocks of a long
history, the sorted runs of a compaction). Each directory is therefore named
``<prefix><host>-<pid>-<random>``, and the next one made under the same root on the same host deletes those
whose process is gone. A directory of a live process, of another host (a shared file system) or of another
name is left alone.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import socket
import tempfile

log = logging.getLogger(__name__)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def sweep_dead(prefix: str, root: str | None = None) -> list[str]:
    """Delete the directories ``<prefix><host>-<pid>-*`` under ``root`` (default: the temporary directory)
    that this host's processes made and that outlived them. Returns the paths deleted."""
    root = root or tempfile.gettempdir()
    pattern = re.compile(rf"{re.escape(prefix)}(?P<host>.+)-(?P<pid>\d+)-[^-]+")
    host, gone = socket.gethostname(), []
    for name in os.listdir(root):
        m = pattern.fullmatch(name)
        if m is None or m["host"] != host or _alive(int(m["pid"])):
            continue
        path = os.path.join(root, name)
        shutil.rmtree(path, ignore_errors=True)
        if not os.path.exists(path):
            gone.append(path)
    if gone:
        log.info("deleted %d scratch directories of killed processes: %s", len(gone), ", ".join(gone))
    return gone


def process_directory(prefix: str, root: str | None = None) -> tempfile.TemporaryDirectory:
    """A new scratch directory named after this host and process, after sweeping those of dead processes."""
    sweep_dead(prefix, root)
    return tempfile.TemporaryDirectory(prefix=f"{prefix}{socket.gethostname()}-{os.getpid()}-", dir=root)
