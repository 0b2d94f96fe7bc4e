"""The rankers' history shards (rank, card-rank): rankings kept per history across appends.

A ranking of a history's questions is a function of that history's inputs alone: its questions, its nodes
(or sessions, cards and plans) and the rows that the keys of their producers determine (vectors, edges).
So the rankers' tables are *segmented* (:mod:`memgas.jobs.tables`): parts named by the ranker's key (its
config), not by its fingerprint, each holding the rankings of a shard of histories, and beside them a
``ranked_histories`` part of the same name that records, per history, the digest of the inputs it was ranked
from (:meth:`Kept.history_inputs`). A part is current while every history in it still has that
digest. After ``memgas ingest --append`` + ``memgas index`` the fingerprint of a ranker changes (what it reads
changed), so it runs, but its plan holds only the histories that no current part covers: those whose
sessions or questions changed, and new ones. The other parts stay as they are (the same files).

Why not the fingerprint alone: it follows the whole dataset, so one appended session re-ranked every
question of every history. Why a digest of the rows and not of the tables' output digests: the output
digest of ``nodes`` or ``edges`` changes with any history; the rows of one history change only with it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from memgas.jobs import tables
from memgas.jobs.stage import Source, Stage, StageContext, short_hash
from memgas.jobs.units import chunk
from memgas.pipeline.hashing import DigestSink
from memgas.pipeline.schema import KEYS, RANKED_HISTORIES


def by_history(t: pa.Table, keys: tuple[str, ...]) -> dict[str, str]:
    """{history_id: digest of its rows of ``t``}, the rows in key order (the same rows give the same digest
    whatever parts or order they were read in)."""
    if t.num_rows == 0:
        return {}
    t = t.replace_schema_metadata(None).sort_by([(k, "ascending") for k in dict.fromkeys(("history_id", *keys))])
    hid = t["history_id"].to_numpy(zero_copy_only=False)
    starts = np.flatnonzero(np.r_[True, hid[1:] != hid[:-1]])
    ends = np.r_[starts[1:], len(hid)]
    return {str(hid[s]): rows_digest(t.slice(int(s), int(e - s))) for s, e in zip(starts, ends)}


def rows_digest(t: pa.Table) -> str:
    """Digest of a table's values in their order, as uncompressed Parquet. Not Arrow IPC
    (:func:`memgas.jobs.stage.table_digest`): a slice of a column that has nulls elsewhere carries a validity
    buffer that the same rows read alone do not, and IPC writes it, so the same rows of one history digested
    differently once another history's row had a null; Parquet writes definition levels from the values."""
    sink = DigestSink()
    pq.write_table(t, pa.PythonFile(sink, mode="w"), compression="none", write_statistics=False, use_dictionary=False)
    return sink.hexdigest()


def with_history(t: pa.Table, column: str, owners: pa.Table, owner_column: str) -> pa.Table:
    """The rows of ``t`` with the ``history_id`` of each row of ``owners`` whose ``owner_column`` equals their
    ``column`` (a plan: its question's history; a card: every history that holds its session). Joined on
    row numbers: Arrow's join does not carry list columns (a plan's rewrites)."""
    rows = pa.table({column: t[column], "_row": pa.array(np.arange(t.num_rows, dtype=np.int64))})
    j = rows.join(owners.select([owner_column, "history_id"]), column, right_keys=owner_column, join_type="inner")
    return t.take(j["_row"]).append_column("history_id", j["history_id"])


@dataclass(frozen=True)
class Kept:
    """How a ranker keeps its rankings per history (see the module docstring): its sidecar table (first in
    its ``writes``: its part, written last, marks a unit done) and which rows of the tables it reads a
    history's rankings depend on (``history_tables(ctx, queries)``: each with ``history_id``; of the other
    tables it reads, the writer's key goes into every digest: their rows of a history are a function of that
    key and these rows, as vectors of texts and edges of nodes). A ranker stage calls these functions from its
    own members; its tables' ``current`` is :meth:`current`."""

    sidecar: str
    history_tables: Callable[[StageContext, pa.Table], dict[str, pa.Table]]

    def current(self, ctx: StageContext, prefix: str) -> list[str]:
        """The ``current`` of the ranker's tables: the parts of its sidecar still current."""
        return list(self.current_rows(tables.writer_of(ctx, self.sidecar), ctx, prefix))

    def history_inputs(self, stage: Stage, ctx: StageContext) -> dict[str, tuple[str, int]]:
        """{history_id: (digest of its inputs, number of questions)} of every history with questions."""
        reads = sorted(tables.declared_reads(ctx, stage))
        cache_key = ("ranked:inputs", stage.name, tuple((t, tables.read_digest(ctx, t)) for t in reads))
        if cache_key in ctx.cache:
            return ctx.cache[cache_key]
        queries = ctx.bank.read("queries")
        rows = self.history_tables(ctx, queries)
        # a source's tables have no key: their rows of a history are among ``rows`` or follow from them
        keyed = {t: ctx.keys.get(w.name) for t in reads if t not in rows
                 for w in [tables.writer_of(ctx, t)] if not isinstance(w, Source)}
        digests = {t: by_history(v, KEYS.get(tables.table(ctx, t).physical, ())) for t, v in rows.items()}
        ids, counts = np.unique(queries["history_id"].to_numpy(zero_copy_only=False), return_counts=True)
        out = {str(h): (short_hash([keyed, {t: d.get(str(h)) for t, d in sorted(digests.items())}], 8), int(n))
               for h, n in zip(ids, counts)}
        ctx.cache[cache_key] = out
        return out

    def _part_rows(self, ctx: StageContext, part: str) -> list[tuple[str, str, int]]:
        """(history_id, inputs, questions) of a sidecar part; cached per run (a part's rows are fixed by its
        name: the name ends in a digest of the unit, which lists them)."""
        key = ("ranked:part", part)
        if key not in ctx.cache:
            t = ctx.results.read(tables.table(ctx, self.sidecar).physical, parts=[part])
            ctx.cache[key] = list(zip(*(t[c].to_pylist() for c in RANKED_HISTORIES.names)))
        return ctx.cache[key]

    def current_rows(self, stage: Stage, ctx: StageContext, prefix: str) -> dict[str, list[tuple[str, str, int]]]:
        """{part: its sidecar rows} of the parts of ``prefix`` (this config) whose every table's part is there
        and whose every history still has the inputs it was ranked from."""
        with tables.unguarded(ctx):
            store = ctx.results
            physical = tables.table(ctx, self.sidecar).physical
            if store is None or not store.exists(physical):
                return {}
            now = self.history_inputs(stage, ctx)
            out = {}
            for part in store.parts(physical):
                if not part.startswith(prefix) or not all(store.has_part(t.physical, part) for t in stage.writes):
                    continue
                rows = self._part_rows(ctx, part)
                if all(now.get(h, (None,))[0] == d for h, d, _ in rows):
                    out[part] = rows
            return out

    @staticmethod
    def _drop_unverified(stage: Stage, ctx: StageContext, prefix: str) -> None:
        """A part kept from an earlier run is used only if its bytes are those written: an altered one goes,
        with the parts of the same name in the stage's other tables (its histories are ranked again)."""
        store = ctx.results
        for t in stage.writes if store is not None else ():
            if not store.exists(t.physical):
                continue
            for part in store.parts(t.physical):
                if part.startswith(prefix) and not store.verify_part(t.physical, part):
                    for other in stage.writes:
                        if store.has_part(other.physical, part):
                            store.drop_part(other.physical, part)

    def plan(self, stage: Stage, ctx: StageContext) -> list[dict[str, Any]]:
        """Shards of the histories that no current part covers (``ray.shard_size`` to a unit)."""
        prefix = tables.prefix(stage, ctx)
        self._drop_unverified(stage, ctx, prefix)
        covered = {h for rows in self.current_rows(stage, ctx, prefix).values() for h, _, _ in rows}
        now = self.history_inputs(stage, ctx)
        todo = [h for h in sorted(now) if h not in covered]
        return [{"size": len(ids), "histories": ids, "inputs": [now[h][0] for h in ids],
                 "questions": [now[h][1] for h in ids]} for ids in chunk(todo, ctx.cfg.ray.shard_size)]

    @staticmethod
    def inputs(payload: dict[str, Any], unit: dict[str, Any]) -> dict[str, Any]:
        """A unit's payload (the stage's shard inputs) with what its histories are ranked from."""
        ranked = {"history_id": unit["histories"], "inputs": unit["inputs"], "questions": unit["questions"]}
        return {**payload, "ranked": ranked}

    def finish(self, stage: Stage, ctx: StageContext) -> dict[str, Any]:
        """What this answer ranked (its plan's histories, whether or not a killed run did some of them) and
        what it kept (the current parts of earlier answers): in run_record.json and report.md."""
        planned = {u["part"] for u in ctx.planned}
        ranked = [n for u in ctx.planned for n in u["questions"]]
        kept = [n for part, rows in self.current_rows(stage, ctx, tables.prefix(stage, ctx)).items()
                if part not in planned for _, _, n in rows]
        return {"queries": ctx.bank.count("queries"),
                "record": {"histories_ranked": len(ranked), "questions_ranked": sum(ranked),
                           "histories_kept": len(kept), "questions_kept": sum(kept)}}


def ranked_table(payload: dict[str, Any]) -> pa.Table:
    """The sidecar rows of a unit (what its histories were ranked from), in a worker's ``run``."""
    return pa.table(payload["ranked"], schema=RANKED_HISTORIES)
