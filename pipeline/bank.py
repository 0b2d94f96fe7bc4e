"""A memory bank: a directory of Parquet tables plus ``manifest.json``.

Layout::

    BANK/
      manifest.json                 schema version, datasets (sha256), row counts, config, stage stats
      <table>/<part>.parquet        one or more parts per table (see memgas.pipeline.schema)
      <table>/_done/<part>.json     completion marker of a part: written after the part, atomically

Why parts with markers: every job writes its shard as one part, atomically (temp file + rename), and
then its marker. A part without a marker (a kill between the two renames) is ignored by readers and
rewritten by the next run, so a killed job resumes without losing or duplicating rows. Re-writing a
part with the same name replaces it, which is what makes every stage idempotent.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from memgas import __version__
from memgas.pipeline.errors import BankError
from memgas.pipeline.schema import KEYS, SCHEMA_VERSION, schema_for

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
_PARQUET_OPTS = dict(compression="zstd", use_dictionary=True, write_statistics=True)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that readers see the old file or the new one, never half."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_json(path: Path, obj: Any, *, sort_keys: bool = True) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=2, sort_keys=sort_keys, default=str) + "\n").encode())


def atomic_write_parquet(path: Path, table: pa.Table) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        pq.write_table(table, tmp, **_PARQUET_OPTS)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def conform(table: pa.Table, schema: pa.Schema, name: str) -> pa.Table:
    """Select and cast ``table``'s columns to ``schema`` (clear error when a column is missing)."""
    missing = [f.name for f in schema if f.name not in table.column_names]
    if missing:
        raise BankError(f"table {name!r}: missing columns {missing}; expected {schema.names}")
    try:
        return table.select(schema.names).cast(schema)
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError) as exc:
        raise BankError(f"table {name!r}: columns do not match the schema: {exc}") from None


def dedupe_last(table: pa.Table, keys: Iterable[str]) -> pa.Table:
    """Keep the last row of every key (rows later in ``table`` win), preserving first-seen order."""
    keys = list(keys)
    if table.num_rows == 0:
        return table
    idx = pa.array(range(table.num_rows), pa.int64())
    grouped = table.select(keys).append_column("__i", idx).group_by(keys, use_threads=False)
    last = grouped.aggregate([("__i", "max")]).column("__i_max")
    if len(last) == table.num_rows:
        return table
    return table.take(pc.take(last, pc.sort_indices(last)))


class Bank:
    """A memory bank directory. ``Bank.create`` makes one; ``Bank(path)`` opens an existing one."""

    def __init__(self, path: str | Path, *, _create: bool = False) -> None:
        self.path = Path(path)
        manifest = self.path / MANIFEST
        if _create:
            self.path.mkdir(parents=True, exist_ok=True)
            if not manifest.exists():
                atomic_write_json(
                    manifest,
                    {
                        "schema_version": SCHEMA_VERSION,
                        "memgas_version": __version__,
                        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                        "datasets": [],
                        "stages": {},
                        "row_counts": {},
                    },
                )
        if not manifest.exists():
            raise BankError(f"{self.path}: not a memory bank (no {MANIFEST}); create one with `memgas ingest`")
        version = self.manifest.get("schema_version")
        if version != SCHEMA_VERSION:
            raise BankError(
                f"{self.path}: bank schema version {version} but this memgas reads version {SCHEMA_VERSION}; "
                "re-create the bank with `memgas ingest` (or use the memgas release that wrote it)"
            )

    @classmethod
    def create(cls, path: str | Path) -> Bank:
        return cls(path, _create=True)

    # -- manifest -----------------------------------------------------------------------------
    @property
    def manifest(self) -> dict[str, Any]:
        try:
            return json.loads((self.path / MANIFEST).read_text())
        except json.JSONDecodeError as exc:
            raise BankError(f"{self.path / MANIFEST}: corrupt manifest: {exc}") from None

    def update_manifest(self, **fields: Any) -> dict[str, Any]:
        """Merge ``fields`` into the manifest (dicts are merged one level deep) and write it atomically."""
        m = self.manifest
        for k, v in fields.items():
            if isinstance(v, dict) and isinstance(m.get(k), dict):
                m[k] = {**m[k], **v}
            else:
                m[k] = v
        m["row_counts"] = {name: self.count(name) for name in self.tables()}
        atomic_write_json(self.path / MANIFEST, m)
        return m

    # -- parts --------------------------------------------------------------------------------
    def _dir(self, name: str) -> Path:
        return self.path / name

    def tables(self) -> list[str]:
        return sorted(p.name for p in self.path.iterdir() if p.is_dir() and (p / "_done").is_dir())

    def parts(self, name: str) -> list[str]:
        """Completed parts of a table, in name order (only parts whose marker exists)."""
        done = self._dir(name) / "_done"
        if not done.is_dir():
            return []
        return sorted(p.stem for p in done.glob("*.json") if (self._dir(name) / f"{p.stem}.parquet").exists())

    def has_part(self, name: str, part: str) -> bool:
        return (self._dir(name) / "_done" / f"{part}.json").exists() and (
            self._dir(name) / f"{part}.parquet"
        ).exists()

    def part_info(self, name: str, part: str) -> dict[str, Any]:
        return json.loads((self._dir(name) / "_done" / f"{part}.json").read_text())

    def write_part(
        self, name: str, part: str, table: pa.Table, *, dim: int | None = None, info: dict | None = None
    ) -> Path:
        """Write one part atomically, then its completion marker. Replaces a part of the same name."""
        if not part or "/" in part or part.startswith((".", "_")):
            raise ValueError(f"bad part name {part!r}")
        if name == "embeddings" and dim is None:  # the vectors' fixed size is the dimension
            dim = getattr(table.schema.field("vector").type, "list_size", None)
        table = conform(table, schema_for(name, dim), name)
        path = self._dir(name) / f"{part}.parquet"
        marker = self._dir(name) / "_done" / f"{part}.json"
        marker.unlink(missing_ok=True)  # a crash from here on leaves an unmarked part: ignored, redone
        atomic_write_parquet(path, table)
        atomic_write_json(marker, {"rows": table.num_rows, **(info or {})})
        return path

    def write(self, name: str, table: pa.Table, *, dim: int | None = None, info: dict | None = None) -> None:
        """Replace the whole table with ``table`` (one part named ``all``)."""
        self.write_part(name, "all", table, dim=dim, info=info)
        for part in self.parts(name):
            if part != "all":
                self.drop_part(name, part)

    def drop_part(self, name: str, part: str) -> None:
        (self._dir(name) / "_done" / f"{part}.json").unlink(missing_ok=True)
        (self._dir(name) / f"{part}.parquet").unlink(missing_ok=True)

    def drop(self, name: str) -> None:
        for part in self.parts(name):
            self.drop_part(name, part)

    # -- reading ------------------------------------------------------------------------------
    def exists(self, name: str) -> bool:
        return bool(self.parts(name))

    def read(
        self,
        name: str,
        columns: list[str] | None = None,
        *,
        parts: Iterable[str] | None = None,
        dedupe: bool = True,
        filter: pc.Expression | None = None,
    ) -> pa.Table:
        """All completed parts of ``name`` concatenated in part order; duplicate keys keep the last."""
        chosen = list(parts) if parts is not None else self.parts(name)
        if not chosen:
            if name == "embeddings":
                raise BankError(f"{self.path}: table 'embeddings' is empty; run `memgas index` first")
            return schema_for(name).empty_table() if columns is None else schema_for(name).empty_table().select(columns)
        want = None
        if columns is not None and dedupe and name in KEYS:
            want = list(dict.fromkeys([*KEYS[name], *columns]))
        elif columns is not None:
            want = list(columns)
        tables = []
        for part in chosen:
            path = self._dir(name) / f"{part}.parquet"
            try:
                t = pq.read_table(path, columns=want, filters=filter)
            except (OSError, pa.ArrowInvalid) as exc:
                raise BankError(f"{path}: unreadable Parquet part ({exc}); delete it and re-run the stage") from None
            tables.append(t)
        table = pa.concat_tables(tables, promote_options="permissive") if len(tables) > 1 else tables[0]
        if dedupe and name in KEYS and len(tables) > 1:
            table = dedupe_last(table, KEYS[name])
        return table.select(columns) if columns is not None else table

    def count(self, name: str) -> int:
        total = 0
        for part in self.parts(name):
            total += pq.ParquetFile(self._dir(name) / f"{part}.parquet").metadata.num_rows
        return total
