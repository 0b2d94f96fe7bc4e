"""Fault injection at named points, for the reliability suite (tests/jobs/test_faults.py).

Production code calls ``hit("compact:texts:after-write")`` at the instructions where a crash or a full disk
matters. Nothing happens unless the environment names that point:

    MEMGAS_FAULT=kill@compact:texts:after-write        SIGKILL this process the first time the point is hit
    MEMGAS_FAULT=kill@encode:unit-done#3               ... the 3rd time
    MEMGAS_FAULT=enospc@bank:write-part:before-rename  raise OSError(ENOSPC) there (a full disk)
    MEMGAS_FAULT=term@runner:before-marker:encode      send this process SIGTERM there (`timeout`, `docker stop`)
    MEMGAS_FAULT=kill-once@actor-call:encoder          SIGKILL the first process of any that hits the point
                                                       (needs MEMGAS_FAULT_STATE=<dir>: a flag file there
                                                       remembers it across processes, e.g. a Ray actor
                                                       that is replaced after the kill)

Several specs may be given, separated by commas. Why a hook and not timing: a test that kills "after
about 2 seconds" hits a different instruction on a loaded machine; a named point is hit exactly.
"""

from __future__ import annotations

import errno
import os
import signal

_counts: dict[str, int] = {}


def _specs() -> list[tuple[str, str, int]]:
    out = []
    for spec in filter(None, (s.strip() for s in os.environ.get("MEMGAS_FAULT", "").split(","))):
        action, _, rest = spec.partition("@")
        point, _, nth = rest.partition("#")
        out.append((action, point, int(nth) if nth else 1))
    return out


def hit(point: str) -> None:
    """Act on ``point`` if MEMGAS_FAULT names it (see the module docstring); otherwise return at once."""
    if "MEMGAS_FAULT" not in os.environ:
        return
    _counts[point] = _counts.get(point, 0) + 1
    for action, where, nth in _specs():
        if where != point or _counts[point] != nth:
            continue
        if action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif action == "kill-once":
            flag = os.path.join(os.environ["MEMGAS_FAULT_STATE"], point.replace("/", "_") + ".killed")
            try:
                fd = os.open(flag, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            except FileExistsError:
                continue
            os.close(fd)
            os.kill(os.getpid(), signal.SIGKILL)
        elif action == "term":
            os.kill(os.getpid(), signal.SIGTERM)
        elif action == "enospc":
            raise OSError(errno.ENOSPC, f"No space left on device (injected at {point})")
        elif action == "raise":
            raise RuntimeError(f"injected failure at {point}")
