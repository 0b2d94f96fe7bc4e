"""Memory nodes per session and their embedding matrices (DESIGN.md §3.1-3.2).

Per (history, session) five node rows:

=========  ===============================================  ======================================
granular.  text_hash                                        vector
=========  ===============================================  ======================================
session    the session text                                 its embedding
turn       the session text (key into ``pairs``)            mean of the session's pair embeddings
summary    hash of the summary output                       its embedding
keyword    hash of the keywords output ("a; b; c")          its embedding
hybrid     hash of "summary keywords session"               its embedding (hybrid baseline only)
=========  ===============================================  ======================================

The first four are MemGAS's memory nodes (``schema.GRANULARITIES``); ``hybrid`` is stored as a fifth row
because the hybrid baseline reads from the same tables.

:class:`MatrixLoader` reads the embeddings table once (only the rows the nodes need), computes each unique
session's turn vector once, and serves per-history [S, d] matrices by indexing; LongMemEval-S (500
histories x ~50 sessions, heavily shared) then costs one Parquet scan plus fancy indexing.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from memgas.pipeline.bank import Bank
from memgas.pipeline.errors import BankError
from memgas.pipeline.generate import hybrid_text
from memgas.pipeline.hashing import text_hash
from memgas.pipeline.schema import NODE_GRANULARITIES, NODES

if TYPE_CHECKING:
    from memgas.pipeline.spilled_vectors import SpilledVectors

log = logging.getLogger(__name__)

_KIND_OF = {"summary": "summary", "keyword": "keywords"}


def build_nodes(
    bank: Bank,
    *,
    generator_model: str,
    prompt_version: str,
    history_ids: Sequence[str] | None = None,
    write: bool = False,
    earlier: pa.Table | None = None,
) -> pa.Table:
    """The ``nodes`` table for the bank's sessions, from the generations under (model, prompt_version).

    Raises :class:`BankError` naming the first sessions whose summary or keywords are missing. Rows with
    an ``error`` (an empty output) still make a node (the embedding of "" = "no information"), logged.
    ``write=True`` also replaces the bank's ``nodes`` table. ``earlier``: node rows built before by this
    code (``history_id``, ``session_id``, ``granularity``, ``text_hash``), whose hybrid hashes are taken
    for the sessions whose text, summary and keywords they were built from (:func:`_earlier_hybrids`):
    the same rows, without reading every session's text again (an append's nodes at 10^6 sessions).
    """
    sessions = bank.read("sessions", ["history_id", "session_id", "position", "text_hash"])
    if history_ids is not None:
        sessions = sessions.filter(pc.field("history_id").isin(list(history_ids)))
    sessions = sessions.sort_by([("history_id", "ascending"), ("position", "ascending")])
    # the work per unique session text (a session shared by histories is looked at once), the rows by Arrow:
    # at 10^6 sessions a Python loop per node row was most of the stage's 24 s
    uniq = pc.unique(sessions.column("text_hash").combine_chunks()).sort()
    gen = bank.read(
        "generations",
        ["text_hash", "kind", "output", "error"],
        filter=(pc.field("model") == generator_model) & (pc.field("prompt_version") == prompt_version),
    )
    # one is_in over the column (in the read's filter, the set of a million hashes was built per batch)
    gen = gen.filter(pc.is_in(gen["text_hash"], value_set=uniq))
    n_err = gen.num_rows - gen.column("error").null_count
    if n_err:
        log.warning("nodes: %d generations carry an error (empty output) for %s / %s", n_err, generator_model, prompt_version)
    outputs = {k: _outputs_of(gen, k, uniq) for k in ("summary", "keywords")}
    missing = [k for k in ("summary", "keywords") if outputs[k].null_count]
    if missing:
        # the first session (in history, position order) and kind without its generation
        at_session = pc.index_in(sessions["text_hash"], value_set=uniq)
        absent = {k: pc.is_null(pc.take(outputs[k], at_session)) for k in missing}
        first = min((pc.index(absent[k], True).as_py(), ("summary", "keywords").index(k), k) for k in missing)[::2]
        row = sessions.slice(first[0], 1).to_pylist()[0]
        count = sum(int(pc.sum(pc.cast(absent[k], pa.int64())).as_py()) for k in missing)
        raise BankError(
            f"{bank.path}: {count} generations missing for model {generator_model!r}, prompt_version "
            f"{prompt_version!r} (first: history {row['history_id']} session {row['session_id']}, text_hash "
            f"{row['text_hash']}, kind {first[1]}); run the generation stage with the same generator/prompt "
            "settings first"
        )
    summaries, keywords = outputs["summary"].to_pylist(), outputs["keywords"].to_pylist()
    hashes: dict[str, list[str]] = {"summary": [text_hash(s) for s in summaries],
                                    "keyword": [text_hash(kw) for kw in keywords]}
    known = [None] * len(uniq) if earlier is None else _earlier_hybrids(earlier, uniq, hashes)
    todo = [h for h, hy in zip(uniq.to_pylist(), known) if hy is None]
    texts = _session_texts(bank, todo)
    hashes["hybrid"] = [hy if hy is not None else text_hash(hybrid_text(s, kw, texts[h]))
                        for h, s, kw, hy in zip(uniq.to_pylist(), summaries, keywords, known)]
    del texts
    at = pc.index_in(sessions["text_hash"], value_set=uniq)
    node_hash = {"session": sessions["text_hash"], "turn": sessions["text_hash"],
                 **{g: pc.take(pa.array(v, pa.string()), at) for g, v in hashes.items()}}
    # per session its NODE_GRANULARITIES rows, in that order: row i of granularity j is row 5 i + j
    n, k = sessions.num_rows, len(NODE_GRANULARITIES)
    rep = pa.array(np.repeat(np.arange(n, dtype=np.int64), k))
    table = pa.table({
        "history_id": pc.take(sessions["history_id"], rep),
        "session_id": pc.take(sessions["session_id"], rep),
        "position": pc.take(sessions["position"], rep),
        "granularity": pa.array(list(NODE_GRANULARITIES) * n, pa.string()),
        "text_hash": pc.take(pa.concat_arrays([_flat(node_hash[g]) for g in NODE_GRANULARITIES]),
                             pa.array((np.arange(k, dtype=np.int64)[None, :] * n
                                       + np.arange(n, dtype=np.int64)[:, None]).ravel())),
    }).cast(NODES)
    if write:
        bank.write("nodes", table, info={"generator_model": generator_model, "prompt_version": prompt_version})
    return table


def _earlier_hybrids(earlier: pa.Table, uniq: pa.Array, hashes: dict[str, list[str]]) -> list[str | None]:
    """Per session text of ``uniq``, the hybrid hash of ``earlier``'s rows when its sessions there all had
    the summary and keyword hashes it has now (``hashes``) and one hybrid hash, else None (computed again).
    The hybrid text is a function of the summary, the keywords and the session's text alone, and each is
    named by its hash, so such a hash is the one this build computes. ``earlier`` is a table this function
    builds (five rows a session in ``NODE_GRANULARITIES`` order), read by stride; another layout gives
    nothing (a join of the granularities on (history, session) was ~2.5 s at 10^6 sessions)."""
    k, n = len(NODE_GRANULARITIES), earlier.num_rows // len(NODE_GRANULARITIES)
    if earlier.num_rows % k or not earlier["granularity"].combine_chunks().equals(
            pa.array(list(NODE_GRANULARITIES) * n, pa.string())):
        return [None] * len(uniq)
    text = earlier["text_hash"].combine_chunks()
    col = {g: text.take(pa.array(np.arange(n, dtype=np.int64) * k + NODE_GRANULARITIES.index(g)))
           for g in ("session", "summary", "keyword", "hybrid")}
    # a session text whose earlier sessions disagree on any of the three is taken from none of them
    first = pc.index_in(col["session"], value_set=col["session"])  # each row's first session of its text
    agree = functools.reduce(pc.and_, [pc.equal(col[g], pc.take(col[g], first))
                                       for g in ("summary", "keyword", "hybrid")])
    split = pc.unique(col["session"].filter(pc.invert(agree)))
    at = pc.index_in(uniq, value_set=col["session"])  # null: no earlier session of that text
    ok = pc.and_(pc.and_(pc.equal(pc.take(col["summary"], at), pa.array(hashes["summary"], pa.string())),
                         pc.equal(pc.take(col["keyword"], at), pa.array(hashes["keyword"], pa.string()))),
                 pc.invert(pc.is_in(uniq, value_set=split)))
    return pc.if_else(pc.fill_null(ok, False), pc.take(col["hybrid"], at), None).to_pylist()


def _flat(a: pa.Array | pa.ChunkedArray) -> pa.Array:
    return a.combine_chunks() if isinstance(a, pa.ChunkedArray) else a


def _outputs_of(gen: pa.Table, kind: str, uniq: pa.Array) -> pa.Array:
    """Per text of ``uniq``, its ``kind`` generation's output ("" where empty; null where there is none; the
    last row of a text wins, as a dict filled in row order kept it)."""
    rows = gen.filter(pc.equal(gen["kind"], kind))
    # by Arrow (a dict of a million rows a kind was ~1.5 s an append at 10^6): the rows reversed, so that
    # the first match index_in finds is the last row of the text
    back = rows.take(pa.array(np.arange(rows.num_rows - 1, -1, -1, dtype=np.int64)))
    at = pc.index_in(uniq, value_set=back["text_hash"].combine_chunks())
    out = pc.fill_null(pc.take(back["output"].combine_chunks().cast(pa.string()), at), "")
    return pc.if_else(pc.is_valid(at), out, pa.scalar(None, pa.string()))


def _session_texts(bank: Bank, hashes: Sequence[str]) -> dict[str, str]:
    if not hashes:
        return {}
    t = bank.read("texts", ["text_hash", "text"], filter=pc.field("text_hash").isin(list(hashes)))
    got = dict(zip(t.column("text_hash").to_pylist(), t.column("text").to_pylist()))
    absent = [h for h in hashes if h not in got]
    if absent:
        raise BankError(f"{bank.path}: {len(absent)} session texts missing from 'texts' (first text_hash {absent[0]})")
    return got


def _vectors(table: pa.Table) -> np.ndarray:
    """[n, d] float32 view of a fixed-size-list vector column (no per-row Python)."""
    col = table.column("vector").combine_chunks()
    if len(col) == 0:
        return np.zeros((0, 0), np.float32)
    d = col.type.list_size
    return col.flatten().to_numpy(zero_copy_only=False).astype(np.float32, copy=False).reshape(-1, d)


class MatrixLoader:
    """Per-history node matrices from one read of ``nodes``, ``pairs`` and ``embeddings``."""

    def __init__(
        self,
        bank: Bank,
        encoder_name: str,
        *,
        history_ids: Sequence[str] | None = None,
        nodes: pa.Table | None = None,
        pair_encoder: str | None = None,
        session_encoder: str | None = None,
        batch_rows: int | None = None,
        vectors: SpilledVectors | None = None,
    ) -> None:
        """``pair_encoder`` / ``session_encoder``: the cache key of turn-pair / session vectors when they have
        their own window (``encoder.pair_max_tokens`` / ``encoder.session_max_tokens``); default
        ``encoder_name``. ``batch_rows``: read ``pairs`` and ``embeddings`` that many rows at a time
        (:meth:`Bank.read`), for the few sessions of a block out of a large bank. ``vectors``: take the
        vectors from there instead of ``embeddings`` (a long history's, gathered once for all its blocks)."""
        self.batch_rows = batch_rows
        self.bank = bank
        self.encoder_name = encoder_name
        keys = {"main": encoder_name, "pair": pair_encoder or encoder_name, "session": session_encoder or encoder_name}
        if nodes is None:
            nodes = bank.read("nodes")
            if nodes.num_rows == 0:
                raise BankError(f"{bank.path}: table 'nodes' is empty; run `memgas index` (its nodes stage) first")
        if history_ids is not None:
            nodes = nodes.filter(pc.field("history_id").isin(list(history_ids)))
        nodes = nodes.sort_by([("history_id", "ascending"), ("position", "ascending")])
        self.nodes = nodes

        sess_hashes = sorted(
            set(nodes.filter(pc.field("granularity") == "session").column("text_hash").to_pylist())
        )
        pairs = bank.read("pairs", ["session_hash", "pair_index", "text_hash"], filter=pc.field("session_hash").isin(sess_hashes),
                          batch_rows=batch_rows)
        pairs = pairs.sort_by([("session_hash", "ascending"), ("pair_index", "ascending")])
        need = {"main": set(nodes.filter(~pc.field("granularity").isin(["session", "turn"])).column("text_hash").to_pylist()),
                "session": set(sess_hashes), "pair": set(pairs.column("text_hash").to_pylist())}
        # one read per distinct key; self.row[role] maps a text hash to its row of self.vectors under that role's key
        by_key: dict[str, set[str]] = {}
        for role, hashes in need.items():
            by_key.setdefault(keys[role], set()).update(hashes)
        blocks, key_row, offset = [], {}, 0
        for key, hashes in by_key.items():
            got, row = vectors.read(key, hashes) if vectors is not None else self._read(bank, key, hashes, batch_rows)
            blocks.append(got)
            key_row[key] = {h: offset + r for h, r in row.items()}
            offset += len(got)
        nonempty = [b for b in blocks if b.size]
        self.vectors = np.concatenate(nonempty) if len(nonempty) > 1 else nonempty[0] if nonempty else \
            np.zeros((0, 0), np.float32)
        self.row = {role: key_row[keys[role]] for role in need}
        self.dim = self.vectors.shape[1] if self.vectors.size else 0
        pair_vectors, pair_row = self.vectors, self.row["pair"]

        # turn vector per unique session: mean of its pair vectors, one reduceat over all pairs
        self.turn_row: dict[str, int] = {}
        sh = pairs.column("session_hash").to_pylist()
        if sh:
            idx = np.fromiter((pair_row[h] for h in pairs.column("text_hash").to_pylist()), np.int64, len(sh))
            starts = [0] + [i for i in range(1, len(sh)) if sh[i] != sh[i - 1]]
            counts = np.diff(np.array([*starts, len(sh)]))
            sums = np.add.reduceat(pair_vectors[idx], starts, axis=0)
            self.turn_vectors = (sums / counts[:, None]).astype(np.float32)
            self.turn_row = {sh[s]: j for j, s in enumerate(starts)}
        else:
            self.turn_vectors = np.zeros((0, self.dim), np.float32)
        no_pairs = [h for h in sess_hashes if h not in self.turn_row]
        if no_pairs:
            # a session without pairs (empty, or one utterance): its turn node is its session vector
            log.warning("%d sessions have no turn pairs; their turn vector is the session vector", len(no_pairs))

        # per-history row ranges into the sorted nodes table
        hid = nodes.column("history_id").to_pylist()
        self._ranges: dict[str, tuple[int, int]] = {}
        for i, h in enumerate(hid):
            a, _ = self._ranges.get(h, (i, i))
            self._ranges[h] = (a, i + 1)
        self._gran = nodes.column("granularity").to_pylist()
        self._hash = nodes.column("text_hash").to_pylist()
        self._sid = nodes.column("session_id").to_pylist()

    @staticmethod
    def _read(bank: Bank, key: str, need: set[str], batch_rows: int | None = None) -> tuple[np.ndarray, dict[str, int]]:
        """Vectors of ``need`` under cache key ``key`` and their row per text hash; every one must exist."""
        emb = bank.read("embeddings", ["text_hash", "encoder", "vector"],
                        filter=(pc.field("encoder") == key) & pc.field("text_hash").isin(sorted(need)), batch_rows=batch_rows)
        row = {h: i for i, h in enumerate(emb.column("text_hash").to_pylist())}
        absent = sorted(need - row.keys())
        if absent:
            raise BankError(
                f"{bank.path}: {len(absent)} texts have no '{key}' embedding (first text_hash {absent[0]}); "
                "run `memgas index` with this config (its encode stage)"
            )
        return _vectors(emb), row

    @property
    def history_ids(self) -> list[str]:
        return list(self._ranges)

    def get(self, history_id: str) -> dict[str, Any]:
        """``{"session_ids": [...], "session": [S,d], "turn": ..., "summary": ..., "keyword": ..., "hybrid": ...}``."""
        if history_id not in self._ranges:
            raise BankError(f"{self.bank.path}: history {history_id!r} has no nodes")
        a, b = self._ranges[history_id]
        per: dict[str, list[str]] = {g: [] for g in NODE_GRANULARITIES}
        session_ids: list[str] = []
        for i in range(a, b):
            g = self._gran[i]
            if g in per:
                per[g].append(self._hash[i])
            if g == "session":
                session_ids.append(self._sid[i])
        out: dict[str, Any] = {"session_ids": session_ids}
        for g, hs in per.items():
            if not hs:
                continue
            if g == "turn":
                mat = np.empty((len(hs), self.dim), np.float32)
                for j, h in enumerate(hs):
                    r = self.turn_row.get(h)
                    mat[j] = self.turn_vectors[r] if r is not None else self.vectors[self.row["session"][h]]
                out[g] = mat
            else:
                row = self.row["session" if g == "session" else "main"]
                out[g] = self.vectors[np.fromiter((row[h] for h in hs), np.int64, len(hs))]
            if len(hs) != len(session_ids):
                raise BankError(
                    f"{self.bank.path}: history {history_id!r}: {len(hs)} {g} nodes for {len(session_ids)} sessions"
                )
        return out
