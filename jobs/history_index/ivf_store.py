"""A history's saved IVF index and its deltas in the bank: which are current, whether their bytes are those
written, and how they are written and read.

Tables (segmented, parts named like the associate stage's edges parts): ``ivf_index``, a history's full index
(faiss's own serialisation in a ``large_binary`` column, no pickle, in rows of at most
:data:`IVF_INDEX_CHUNK_BYTES`, one Parquet row group each and read back a row at a time), and ``ivf_delta``,
the entries an append added since, as small indexes of the same centroids and quantiser. A load merges the
deltas into the full index in order: the same bytes as the index of one build.

The tables are a stage's (:class:`IVFTables`): the associate stage's above, memgas-cards'
``card_graph_ivf_index`` and ``card_graph_ivf_delta`` (:mod:`memgas.jobs.stages.card_graph_associate`), the
same schemas and rules under the card graph's prefix digests.

Current: per history, the full index of most sessions among the current segments' parts whose sessions are
still those it holds, and the chain of deltas that continues it. A part whose bytes are not those written is
never current (:func:`intact`: logged and counted once per run), so the index is continued from the link
before it or rebuilt, never searched.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from memgas.jobs.stage import StageContext
from memgas.pipeline.association.segments import Coverage
from memgas.pipeline.errors import BankError
from memgas.pipeline.schema import IVF_INDEX

log = logging.getLogger(__name__)

#: an append saves the entries it added to a history's index as a delta (table ``ivf_delta``) beside the full
#: index it started from, not the whole index again: at 10^6 sessions that index is ~1.5 GB (~30 s to write)
#: and an append of 1,000 sessions adds ~1.6 MB. A full index is saved again once the deltas since the last one
#: would be more than IVF_MAX_DELTAS, or hold more than a 1/IVF_DELTA_SHARE of its sessions, so that a load
#: merges a few small deltas (an append's driver maps the full index and keeps the deltas apart in memory,
#: jobs/history_index/ivf_mapped.py: 64 deltas of 1,000 sessions are ~100 MB there, while saving the full
#: index again costs an append ~1 min at 10^6 sessions). Where the index is saved as what changes nothing
#: downstream: the merged index is the same bytes either way.
IVF_MAX_DELTAS = 64
IVF_DELTA_SHARE = 8
#: bytes of a saved index per ``ivf_index`` row: an index is stored as its chunks, in order, one row (and one
#: Parquet row group, bank.ROW_GROUP_ROWS) each, so that writing and reading it hold one chunk beside it
IVF_INDEX_CHUNK_BYTES = 64 << 20


@dataclass(frozen=True)
class IVFTables:
    """The tables a stage saves its histories' IVF indexes in: full indexes (schema ``IVF_INDEX``) and deltas
    (``IVF_DELTA``). Both are segmented, their parts named like that stage's edges parts."""

    index: str = "ivf_index"
    delta: str = "ivf_delta"


#: the associate stage's (MemGAS's graph)
IVF_TABLES = IVFTables()


@dataclass
class IVFRun:
    """What one run of the associate stage knows of the saved indexes on the driver (one entry of the stage's
    scratch, :func:`ivf_run`): the indexes and deltas current before its first unit, the history whose saved
    index was last read (its bytes, kept for that history's next unit) and shared with tasks, the damaged
    parts already logged, and the counts ``finish`` reports."""

    saved: dict[str, tuple[str, int, str]] | None = None
    deltas: dict[str, list[tuple[str, int, int, str]]] | None = None
    loaded: tuple[str, dict[str, Any] | None] | None = None
    full: tuple[str, list[np.ndarray]] | None = None  # the last history's full index bytes, once read
    mapped: dict[tuple[str, str], Any] = field(default_factory=dict)  # (part, history): its checked mapped copy
    shared: tuple[dict[str, Any], Any] | None = None
    damaged: set[tuple[str, str]] = field(default_factory=set)
    rebuilt: int = 0
    reused: int = 0
    found_units: int = 0

    def stats(self) -> dict[str, int]:
        return {"ivf_index_reused": self.reused, "ivf_index_rebuilt": self.rebuilt,
                "ivf_found_units": self.found_units}


def ivf_run(ctx: StageContext) -> IVFRun:
    """This stage run's :class:`IVFRun` (the scratch is reset per stage run)."""
    return ctx.scratch.setdefault("ivf", IVFRun())


def _index_rows(ctx: StageContext, part: str, table: str) -> list[tuple[str, int, int, str]]:
    """(history, end_session, sessions, prefix digest) of an ``ivf_index`` part, without its index bytes."""
    t = ctx.bank.read(table, ["history_id", "end_session", "sessions", "prefix_digest"], parts=[part])
    return list(zip(*(t[c].to_pylist() for c in ("history_id", "end_session", "sessions", "prefix_digest"))))


def current_indexes(ctx: StageContext, cov: Coverage, chain: dict[str, list[str]],
                    names: IVFTables = IVF_TABLES) -> dict[str, tuple[str, int, str]]:
    """Per history, its newest full saved IVF index: ``(part, sessions, prefix digest)``, the one of most
    sessions among the current segments' parts (``cov``) whose sessions are still those it holds (an older
    one is superseded; the deltas saved since continue it, :func:`current_deltas`). ``chain``: the prefix
    digests of the graph the indexes hold, ``names``: their tables."""
    found: dict[str, list[tuple[int, str, str]]] = {}
    for part in cov.parts:
        if not ctx.bank.has_part(names.index, part):
            continue
        for h, _, sessions, digest in _index_rows(ctx, part, names.index):
            c = chain.get(h)
            if c is not None and sessions < len(c) and c[sessions] == digest:
                found.setdefault(h, []).append((sessions, part, digest))
    out = {}
    for h, candidates in found.items():
        # the most sessions among those whose bytes are those written: a damaged part is never current, so
        # the index rebuilt over it (maybe of as many sessions) replaces it instead of tying with it
        for sessions, part, digest in sorted(candidates, key=lambda x: (-x[0], x[1])):
            if intact(ctx, names.index, part, h):
                out[h] = (part, sessions, digest)
                break
    return out


def intact(ctx: StageContext, table: str, part: str, history: str) -> bool:
    """Whether a saved index (or delta) part's bytes are those written; a damaged one is logged and counted
    once per run (``ivf_index_rebuilt``) and never used: the task rebuilds what it held."""
    if ctx.bank.verify_part(table, part):
        return True
    run = ivf_run(ctx)
    if (table, part) not in run.damaged:
        run.damaged.add((table, part))
        log.warning("the saved IVF %s of history %s (%s/%s) is damaged; rebuilding it",
                    "delta" if table.endswith("_delta") else "index", history, table, part)
        run.rebuilt += 1
    return False


def current_deltas(ctx: StageContext, cov: Coverage, chain: dict[str, list[str]],
                   names: IVFTables = IVF_TABLES) -> dict[str, list[tuple[str, int, int, str]]]:
    """Per history, the deltas that continue its full index (:func:`current_indexes`), in order:
    ``(part, base sessions, sessions, prefix digest)``, each starting where the one before ends, its sessions
    still those it holds. Of two from the same start (one written over a damaged one) the longer."""
    full = current_indexes(ctx, cov, chain, names)
    nxt: dict[tuple[str, int], tuple[str, int, int, str]] = {}
    for part in cov.parts:
        if not ctx.bank.has_part(names.delta, part):
            continue
        t = ctx.bank.read(names.delta, ["history_id", "base_sessions", "sessions", "prefix_digest"], parts=[part])
        for h, base, sessions, digest in zip(*(t[c].to_pylist() for c in t.column_names)):
            c = chain.get(h)
            if c is not None and base < sessions < len(c) and c[sessions] == digest and \
                    nxt.get((h, base), ("", 0, -1))[2] < sessions and intact(ctx, names.delta, part, h):
                nxt[(h, base)] = (part, base, sessions, digest)
    out: dict[str, list[tuple[str, int, int, str]]] = {}
    for h, (_, sessions, _) in full.items():
        links, at = [], sessions
        while (h, at) in nxt:
            links.append(nxt[(h, at)])
            at = links[-1][2]
        out[h] = links
    return out


def saves_delta(saved: dict[str, Any] | None, end: int) -> bool:
    """Whether the index that holds ``end`` sessions is saved as a delta over ``saved`` (the full index and
    the deltas it was loaded with) rather than whole (:data:`IVF_MAX_DELTAS`, :data:`IVF_DELTA_SHARE`)."""
    if saved is None or end <= saved["sessions"]:
        return False
    full = saved.get("full_sessions", saved["sessions"])
    return len(saved.get("deltas", [])) < IVF_MAX_DELTAS and (end - full) * IVF_DELTA_SHARE <= full


def index_table(rows: list[dict[str, Any]], schema: pa.Schema = IVF_INDEX) -> pa.Table:
    """The ``ivf_index`` rows: per saved index, its bytes (a uint8 array) in chunks of at most
    :data:`IVF_INDEX_CHUNK_BYTES`, one row each (the other columns repeated), wrapped by Arrow without a copy
    when there is one index (a long history's unit saves one: ``Table.from_pylist`` would copy it twice)."""
    blobs = [r["index"] for r in rows]
    data = blobs[0] if len(blobs) == 1 else np.concatenate(blobs)
    cuts, owner = [0], []
    for i, b in enumerate(blobs):
        n = max(1, -(-b.size // IVF_INDEX_CHUNK_BYTES))
        cuts += [cuts[-1] + min(b.size, (j + 1) * IVF_INDEX_CHUNK_BYTES) for j in range(n)]
        owner += [i] * n
    offsets = np.asarray(cuts, np.int64)
    index = pa.LargeBinaryArray.from_buffers(pa.large_binary(), len(owner),
                                             [None, pa.py_buffer(offsets), pa.py_buffer(data)])
    cols = [pa.array([rows[i][f.name] for i in owner], f.type) for f in schema if f.name != "index"]
    return pa.Table.from_arrays([*cols, index], schema=schema)


def saved_index_bytes(bank: Any, part: str, history: str, table: str = "ivf_index") -> np.ndarray:
    """The saved index of ``history`` in ``part``: its rows' bytes in row order (one row in parts written
    before the chunks), read a row at a time into one buffer: a first pass sums their lengths, a second
    copies them, so no more than one chunk is held beside the buffer."""
    def chunks() -> Iterator[pa.Array]:
        for t in bank.iter_read(table, ["history_id", "index"], batch_rows=1, parts=[part]):
            yield t.filter(pc.equal(t["history_id"], history))["index"]

    total = sum(int(pc.sum(pc.binary_length(c)).as_py() or 0) for c in chunks())
    out, at = np.empty(total, np.uint8), 0
    for c in chunks():
        for v in c:
            b = np.frombuffer(v.as_buffer(), np.uint8)
            out[at : at + b.size] = b
            at += b.size
    if at != total:
        raise BankError(f"{bank.path}: {table}/{part} changed while it was read")
    return out


def saved_index_chunks(bank: Any, part: str, history: str, table: str = "ivf_index") -> list[np.ndarray]:
    """The saved index of ``history`` in ``part`` as its rows' bytes, one array per row in row order, read
    in one pass a row at a time (:func:`saved_index_bytes` reads the part twice to copy them into one
    buffer): :func:`~memgas.pipeline.association.faiss_index.raw_from_bytes` reads the chunks in order."""
    out = []
    for t in bank.iter_read(table, ["history_id", "index"], batch_rows=1, parts=[part]):
        out += [np.frombuffer(v.as_buffer(), np.uint8) for v in t.filter(pc.equal(t["history_id"], history))["index"]]
    return out


def saved_index(ctx: StageContext, history: str, start: int, names: IVFTables = IVF_TABLES) -> dict[str, Any] | None:
    """The history's saved IVF index for rows from session ``start`` on, its part verified first (a part
    whose bytes are not those written is never searched: the task rebuilds the index, and the stats
    count it); None when there is none to use. Every unit of the history in this run starts from the
    same saved index (it ends at or before the first unit's rows): it is verified and counted once. What
    it returns names the part and holds the deltas' bytes; the full index's bytes are read only where a
    task needs them (:func:`full_bytes`; the driver's own search maps a copy,
    :mod:`memgas.jobs.history_index.ivf_mapped`). ``names``: the stage's tables."""
    run = ivf_run(ctx)
    saved = run.saved.get(history)  # listed before the run's first unit
    if start == 0 or saved is None:
        return None
    if run.loaded is not None and run.loaded[0] == history:
        return run.loaded[1]
    run.loaded = (history, None)  # drops the previous history's bytes first
    part, sessions, digest = saved
    if not intact(ctx, names.index, part, history):  # listed intact (current_indexes): changed since
        return None
    meta = ctx.bank.read(names.index, ["history_id", "sessions", "prefix_digest", "dim"], parts=[part])
    meta = meta.filter(pc.equal(meta["history_id"], history))
    if meta.num_rows == 0 or {(s, d) for s, d in zip(meta["sessions"].to_pylist(), meta["prefix_digest"].to_pylist())} \
            != {(sessions, digest)}:
        return None
    deltas = []
    for dpart, base, end, _ in run.deltas.get(history, []):
        if not intact(ctx, names.delta, dpart, history):  # the index up to here, then its blocks added again
            break
        deltas.append({"base": base, "sessions": end, "bytes": saved_index_chunks(ctx.bank, dpart, history,
                                                                                    names.delta)})
    run.reused += 1
    run.loaded = (history, {"sessions": deltas[-1]["sessions"] if deltas else sessions,
                            "full_sessions": sessions, "dim": meta["dim"][0].as_py(), "part": part,
                            "history": history, "deltas": deltas, "table": names.index})
    return run.loaded[1]


def full_bytes(ctx: StageContext, saved: dict[str, Any]) -> list[np.ndarray]:
    """The full index's bytes of a :func:`saved_index` (its part's rows, in order), read once per run and
    history (the last history's are kept: its units come one after another)."""
    run, h = ivf_run(ctx), saved["history"]
    if run.full is None or run.full[0] != h:
        run.full = None  # drops the previous history's bytes first
        run.full = (h, saved_index_chunks(ctx.bank, saved["part"], h, saved.get("table", IVF_TABLES.index)))
    return run.full[1]
