"""A bank's data as files: the manifest's ``datasets`` entries (one ingest and the appends after it), what
identifies that data, and the commands that build it again.

Plain functions of the manifest's entries, below :mod:`memgas.pipeline.bank` (whose errors name the
commands) and :mod:`memgas.pipeline.append` (which writes the entries).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

#: manifest ``datasets`` entries of appends carry ``"kind": APPEND_KIND`` (an ingest's entry has no kind)
APPEND_KIND = "append"
#: what of a manifest ``datasets`` entry decides the rows it gave (not its path: the same file elsewhere is
#: the same data)
_IDENTITY_FIELDS = ("kind", "sha256", "format", "limit", "strict", "allow_reorder")


def ingest_history(datasets: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The manifest ``datasets`` entries the bank's data was built from, in order: the last ingest (an
    entry without ``kind``) and the appends after it."""
    base = max((i for i, d in enumerate(datasets) if d.get("kind") != APPEND_KIND), default=0)
    return datasets[base:]


def appends_of(datasets: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The appends in an ingest history (empty for a bank ingested from one file)."""
    return [d for d in ingest_history(datasets) if d.get("kind") == APPEND_KIND]


def dataset_digest(datasets: list[dict[str, Any]]) -> str | None:
    """The ``sha256`` of a bank's dataset identity from the manifest's ``datasets`` alone (cheap: the
    fingerprints hash it): the file's sha256 for a bank from one file, else a digest of the ingest history."""
    history = ingest_history(datasets)
    if len(history) <= 1:
        return history[0].get("sha256") if history else None
    key = [{f: d.get(f) for f in _IDENTITY_FIELDS} for d in history]
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()


def rebuild_commands_of(datasets: list[dict[str, Any]], bank_path: str | Path) -> str:
    """The commands that build a bank's data again from its files: ``memgas ingest`` of its base file, then
    one ``--append`` per appended file, in order (an ingested dataset cannot be rebuilt from the bank)."""
    history = ingest_history(datasets) or [{}]
    base = history[0]
    limit = f" --limit {base['limit']}" if base.get("limit") is not None else ""
    replace = " --replace" if len(history) > 1 else ""  # a plain ingest refuses to replace a grown bank
    cmds = [f"memgas ingest {base.get('path', 'FILE')} --format {base.get('format', 'F')}{limit}"
            f"{' --strict' if base.get('strict') else ''}{replace} --out {bank_path}"]
    cmds += [f"memgas ingest {d.get('path')} --format {d.get('format')} --append{' --strict' if d.get('strict') else ''}"
             f"{' --allow-reorder' if d.get('allow_reorder') else ''} --out {bank_path}" for d in history[1:]]
    return ", then ".join(cmds)


def rebuild_advice(datasets: list[dict[str, Any]], bank_path: str | Path) -> str:
    """What rebuilds an ingested dataset: its ingest and every append, spelled out; `memgas run` too, unless
    the bank was grown (run refuses a grown bank)."""
    cmds, grown = rebuild_commands_of(datasets, bank_path), bool(appends_of(datasets))
    return f"re-ingest it: {cmds}" + ("" if grown else " (or memgas run, which re-ingests by itself)")
