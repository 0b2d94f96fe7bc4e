"""The commit points of an ingest in a bank: staged ``ingest-<slot>-*`` parts made the bank's dataset by one
atomic manifest write (:mod:`memgas.pipeline.bank` describes why; :mod:`memgas.pipeline.ingest` and
:mod:`memgas.pipeline.append` write the parts). A mixin of :class:`~memgas.pipeline.bank.Bank`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from memgas.pipeline import faults
from memgas.pipeline.bank_files import INGEST_PREFIX, INGEST_TABLES, MANIFEST, atomic_write_json
from memgas.pipeline.errors import BankError


class IngestCommits:
    """Begin, commit and abort an ingest (the bank supplies ``manifest``, ``ingest_parts``, ``has_part``,
    ``_marked``, ``_dir`` and ``update_manifest``)."""

    path: Path

    def begin_ingest(self) -> str:
        """Prepare a new ingest: returns the slot (``a`` or ``b``) its parts must use, the one not committed.

        Removes what earlier killed ingests left (parts not committed, marked or not). A bank written
        before ingest commits existed first gets its present ``ingest-*`` parts recorded as committed.
        """
        committed = self.ingest_parts()
        if committed is None:  # legacy bank: record what is there, so that new parts stay invisible
            legacy = sorted({p for name in INGEST_TABLES for p in self._marked(name) if p.startswith(INGEST_PREFIX)})
            m = self.manifest
            m["ingest"] = {"parts": legacy}
            atomic_write_json(self.path / MANIFEST, m, point="bank:manifest")
            committed = set(legacy)
        self._drop_uncommitted_ingest(committed)
        slots = {p[len(INGEST_PREFIX)] for p in committed if p[len(INGEST_PREFIX):][1:2] == "-"}
        return "b" if slots == {"a"} else "a"

    def _drop_uncommitted_ingest(self, committed: set[str]) -> None:
        for name in INGEST_TABLES:
            d = self._dir(name)
            if not d.is_dir():
                continue
            for f in list(d.glob(f"{INGEST_PREFIX}*.parquet")) + list((d / "_done").glob(f"{INGEST_PREFIX}*.json")):
                if f.stem not in committed:
                    f.unlink(missing_ok=True)

    def commit_ingest(self, parts: list[str], **manifest_fields: Any) -> None:
        """Make ``parts`` the bank's ingest (one atomic manifest write, together with ``manifest_fields``),
        then drop the parts of the previous ingest. Fault points ``ingest:before-commit`` (new parts
        complete, not committed), ``bank:manifest:before-rename`` and ``ingest:after-commit`` (committed,
        old parts still on disk; invisible)."""
        missing = [f"{n}/{p}" for n in INGEST_TABLES for p in parts if not self.has_part(n, p)]
        if missing:
            raise BankError(f"{self.path}: cannot commit the ingest: parts {missing[:3]} are not complete")
        faults.hit("ingest:before-commit")
        m = self.manifest
        for k, v in manifest_fields.items():  # merged like update_manifest
            m[k] = {**m[k], **v} if isinstance(v, dict) and isinstance(m.get(k), dict) else v
        m["ingest"] = {"parts": list(parts)}
        atomic_write_json(self.path / MANIFEST, m, point="bank:manifest")
        faults.hit("ingest:after-commit")
        self._drop_uncommitted_ingest(set(parts))  # the previous ingest's parts
        faults.hit("ingest:after-drop-old")
        self.update_manifest()  # row counts of the new data

    def abort_ingest(self) -> None:
        """Drop the parts of an ingest that will not be committed (the committed data is untouched)."""
        committed = self.ingest_parts()
        self._drop_uncommitted_ingest(committed or set())
