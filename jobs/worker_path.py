"""A Ray worker's import path: installed packages before the repository's folders of the same name."""

from __future__ import annotations

import functools
import os


def installed_packages_first() -> None:
    """Move the ``sys.path`` entries ahead of site-packages that hold a package named like an installed
    top-level package behind it; entries are moved, not dropped (the tests' modules stay importable).

    Why: Ray puts the driver's working directory first on its workers' path. Run from this repository, that
    directory holds ``kernels/`` (``memgas.kernels``), and transformers 5.25 imports the installed ``kernels``
    package at import time, so the encoder actors died with an ImportError. Called by
    :func:`memgas.jobs.models.make_model` before any model library is imported (a Ray setup hook did not run
    early enough for the actors)."""
    import sys

    site = [i for i, p in enumerate(sys.path) if p.endswith(("site-packages", "dist-packages"))]
    if not site:
        return
    names = _installed_top_level()
    shadowing = [p for p in sys.path[: site[0]] if p and any(os.path.isfile(os.path.join(p, n, "__init__.py"))
                                                              for n in names)]
    for p in shadowing:
        sys.path.remove(p)
        sys.path.append(p)


@functools.cache
def _installed_top_level() -> frozenset[str]:
    """Top-level names of the installed distributions (``top_level.txt``, else the distribution's name): read
    once per process, not per model loaded."""
    import importlib.metadata

    return frozenset(n for d in importlib.metadata.distributions()
                     for n in (d.read_text("top_level.txt") or d.metadata.get("Name", "")).split() if n)
