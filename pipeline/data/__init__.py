"""Dataset loaders, one module per format, and the one registry of format names.

``FORMATS`` is the list every other place uses (the CLI's ``--format`` choices, ``data.format`` of the
config, :func:`memgas.pipeline.ingest.ingest`); ``"auto"`` (guess from the file) is not a format but an
option of ``ingest``, see :data:`AUTO`. Loaders are imported lazily so that importing the registry (the
config does) costs nothing.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator
from typing import Any

#: Supported dataset formats, in the order the CLI lists them (docs/data.md describes each).
FORMATS: tuple[str, ...] = ("longmemeval", "locomo", "longmtbench", "jsonl")
#: ``memgas ingest --format auto``: detect the format from the file (not valid in a config).
AUTO = "auto"

_MODULES = {fmt: f"memgas.pipeline.data.{fmt}" for fmt in FORMATS}


def loader(fmt: str) -> Callable[..., Iterator[Any]]:
    """The ``load(path, warnings, on_read=...)`` function of ``fmt`` (KeyError for an unknown format)."""
    return importlib.import_module(_MODULES[fmt]).load
