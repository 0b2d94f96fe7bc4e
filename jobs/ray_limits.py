"""The process limits a local Ray cannot start under, checked before it starts and named when it fails.

Ray's raylet and GCS inherit the driver's address-space limit (``ulimit -v``); under a small one they never
come up, and ``ray.init`` waited ~35 s and then failed with a stack dump (exit 1). A limit too small for
any start is refused before Ray starts; a start that fails under a finite limit is named as that limit.
"""

from __future__ import annotations

import resource
from collections.abc import Iterator
from contextlib import contextmanager

from memgas.pipeline.errors import ResourceLimit

#: the least address space (`ulimit -v`) a local Ray is started under: measured on a 23 GiB machine, 3.8 GiB
#: fails (its raylet and GCS time out after ~35 s) and 7.6 GiB starts; in between the start is tried
RAY_MIN_ADDRESS_SPACE = 4 << 30


def _too_small(limit: int) -> ResourceLimit:
    return ResourceLimit(f"Ray cannot start under this process's address-space limit of {limit >> 20} MiB "
                         "(`ulimit -v`): raise it (`ulimit -v unlimited`) or run with --no-ray")


def check_address_space() -> int:
    """:class:`ResourceLimit` (exit 3, one line) for an address-space limit below :data:`RAY_MIN_ADDRESS_SPACE`,
    before a local Ray starts; else the limit (``resource.RLIM_INFINITY`` where there is none)."""
    limit = resource.getrlimit(resource.RLIMIT_AS)[0]
    if limit != resource.RLIM_INFINITY and limit < RAY_MIN_ADDRESS_SPACE:
        raise _too_small(limit)
    return limit


@contextmanager
def address_space_checked() -> Iterator[None]:
    """Around a local Ray's start: :class:`ResourceLimit` (exit 3, one line) for an address-space limit
    below :data:`RAY_MIN_ADDRESS_SPACE`, or for a start that fails under a finite one."""
    limit = check_address_space()
    try:
        yield
    except Exception:
        if limit == resource.RLIM_INFINITY:
            raise
        raise _too_small(limit) from None
