"""The encode stage: every text the index and the questions need, embedded once per encoder key."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
from memgas.jobs import keys
from memgas.jobs.stage import Active, Stage, StageContext
from memgas.jobs.stages.texts import TextBlocks, rederive_texts, unit_texts
from memgas.jobs.tables import Table
from memgas.jobs.units import cost_chunks
from memgas.pipeline.errors import BankError
from memgas.pipeline.models.synthetic import manifest_entry


def vector_rows(ctx: StageContext, need: dict[str, Any]) -> pa.Table:
    """The rows of ``embeddings`` a config reads (``need``: text hashes per encoder key), sorted: not every
    row under the key, which holds other configs' texts too, so that which texts are read is in the digest."""
    need = _as_lists(need)
    keyset = sorted(need)
    mine = ctx.bank.read("embeddings", filter=pc.field("encoder").isin(keyset))
    wanted = pa.array([f"{k}\0{h}" for k, hs in need.items() for h in hs], pa.string())
    key = pc.binary_join_element_wise(mine["encoder"], mine["text_hash"], "\0")
    return mine.filter(pc.is_in(key, value_set=wanted)).sort_by([("encoder", "ascending"), ("text_hash", "ascending")])


#: rows per chunk of :func:`vector_rows_digest` (part of its definition: the digest hashes each chunk)
DIGEST_CHUNK_ROWS = 8192


def rows_bytes(t: pa.Table) -> Iterator[bytes]:
    """The values of ``t``'s rows, column by column, as bytes that depend on the values alone (not on how
    Arrow laid them out: Arrow IPC of the same rows differed between a table built afresh and one taken from
    a read, by a validity buffer with no nulls): strings NUL-separated (text hashes and keys hold none),
    fixed-size lists as their little-endian values, other columns as a null mask and their values (0 where
    null)."""
    for name in t.column_names:
        col = t[name].combine_chunks()
        if pa.types.is_string(col.type) or pa.types.is_large_string(col.type):
            yield "\0".join(col.to_pylist()).encode("utf-8", "surrogatepass") + b"\1"
        elif pa.types.is_fixed_size_list(col.type):
            yield _le(col.flatten().to_numpy(zero_copy_only=False), col.type.value_type)
        else:
            null = col.is_null().to_numpy(zero_copy_only=False)
            filled = pc.fill_null(col, False if pa.types.is_boolean(col.type) else 0)
            yield null.tobytes() + _le(filled.to_numpy(zero_copy_only=False), filled.type)


def _le(values: Any, arrow_type: pa.DataType) -> bytes:
    import numpy as np

    return np.asarray(values).astype(np.dtype(arrow_type.to_pandas_dtype()).newbyteorder("<")).tobytes()


def vector_rows_digest(ctx: StageContext, need: dict[str, Any]) -> str:
    """The digest of :func:`vector_rows` (the same rows, in the same order) without holding them: one pass
    over ``embeddings`` gathers the rows into a spill file (:class:`~memgas.pipeline.spilled_vectors.
    SpilledVectors`), then blake2b over :func:`rows_bytes` of each chunk of :data:`DIGEST_CHUNK_ROWS` rows
    in (encoder, text hash) order. Memory: one chunk and the needed hashes."""
    import hashlib

    from memgas.pipeline.spilled_vectors import SpilledVectors

    h = hashlib.blake2b(digest_size=8)
    sv = SpilledVectors(ctx.bank, _as_lists(need), extra=("truncated", "tokens", "tokens_dropped"))
    try:
        for t in sv.sorted_tables(DIGEST_CHUNK_ROWS):
            for b in rows_bytes(t.select(VECTOR_COLUMNS)):
                h.update(b)
    finally:
        sv.close()
    return h.hexdigest()


#: the columns of ``embeddings`` in the digest, in this order
VECTOR_COLUMNS = ["text_hash", "encoder", "vector", "truncated", "tokens", "tokens_dropped"]


def vector_rows_summed(ctx: StageContext, need: dict[str, Any]) -> str:
    """The order-free digest of :func:`vector_rows` (``need``: text hashes per encoder key, lists or Arrow
    arrays) from the bank's cached row hashes (:func:`memgas.pipeline.row_hashes.summed_digest`): an append
    hashes the vectors it added, not the table."""
    from memgas.pipeline.row_hashes import summed_digest

    wanted = {k: _as_array(v) for k, v in need.items()}

    def select(keys: pa.Table) -> pa.Array:
        masks = [pc.and_(pc.equal(keys["encoder"], k), pc.is_in(keys["text_hash"], value_set=hashes))
                 for k, hashes in wanted.items()]
        return functools.reduce(pc.or_, masks) if masks else pa.nulls(keys.num_rows, pa.bool_()).fill_null(False)

    return summed_digest(ctx.bank, "embeddings", VECTOR_COLUMNS, select)


def _as_array(hashes: Any) -> pa.Array:
    if isinstance(hashes, pa.ChunkedArray):
        return hashes.combine_chunks()
    return hashes if isinstance(hashes, pa.Array) else pa.array(list(hashes), pa.string())


def _as_lists(need: dict[str, Any]) -> dict[str, list[str]]:
    """``need`` as sorted lists without repeats (what the digests of the methods before ``summed-1`` take)."""
    return {k: sorted(set(_as_array(v).to_pylist())) for k, v in need.items()}


def _node_vector_rows(ctx: StageContext) -> pa.Table:
    return vector_rows(ctx, EncodeStage.needed(ctx)[0])


def _node_vector_digest(ctx: StageContext) -> str:
    return vector_rows_digest(ctx, EncodeStage.needed(ctx)[0])


def _node_vector_summed(ctx: StageContext) -> str:
    return vector_rows_summed(ctx, EncodeStage.needed(ctx)[0])


# -- what the encoders share (MemGAS's, JustMem's, the card graph's): each says which texts it needs --------
#: text hashes per encoder key (lists, or Arrow arrays: EncodeStage's), and the questions' texts by hash
Needed = Callable[[StageContext], tuple[dict[str, Any], dict[str, str]]]


def encode_units(ctx: StageContext, needed: tuple[dict[str, Any], dict[str, str]],
                 grouped: Callable[[list[str], Any], list[str]]) -> list[dict[str, Any]]:
    """Units of the ``needed`` texts (hashes per encoder key, the questions' texts by hash) not yet embedded
    under their key, in ``grouped`` order, balanced by their estimated tokens (``ray.encode_unit``)."""
    bank = ctx.bank
    need, questions = needed
    e = ctx.cfg.encoder
    windows = {keys.window_key(ctx, n): n for n in (e.pair_max_tokens, e.session_max_tokens) if n is not None}
    todo: dict[str, list[str]] = {}
    for key, hashes in need.items():
        missing = _as_array(hashes)
        if bank.exists("embeddings") and len(missing):
            # membership only: no de-duplication of the key's rows (millions at 10^6 sessions), and no
            # Python value per row of the bank
            have = bank.read("embeddings", ["text_hash"], filter=pc.field("encoder") == key, dedupe=False)
            missing = missing.filter(pc.invert(pc.is_in(missing, value_set=have["text_hash"].combine_chunks())))
        todo[key] = grouped(sorted(set(missing.to_pylist())), bank)
    chars = text_chars(ctx, {h for hs in todo.values() for h in hs}, questions)
    units = []
    for key, hashes in todo.items():
        cap = windows.get(key) or ctx.cfg.encoder.max_tokens or 512
        costs = [est_tokens(chars.get(h, 0), cap, ctx.cfg.encoder.long_text) for h in hashes]
        units += [{"key": key, "max_tokens": windows.get(key), "hashes": b}
                  for b in cost_chunks(hashes, costs, ctx.cfg.ray.encode_unit)]
    return [{"size": len(u["hashes"]), **u} for u in units]


def text_chars(ctx: StageContext, hashes: set[str], questions: dict[str, str]) -> dict[str, int]:
    """Characters of each text to encode (questions from the queries, the rest from ``texts``), to
    balance units. One filtered read of ``texts`` per plan (a scan: 1.0-1.7 s at LongMemEval-S scale,
    see TextBlocks); only the lengths become Python values."""
    if not hashes:
        return {}
    t = ctx.bank.read("texts", ["text_hash", "text"], filter=pc.field("text_hash").isin(sorted(hashes)))
    out = dict(zip(t["text_hash"].to_pylist(), pc.utf8_length(t["text"]).to_pylist()))
    del t
    for h, q in questions.items():
        out.setdefault(h, len(q))
    return out


def est_tokens(chars: int, cap: int, long_text: str) -> float:
    """A text's encoder cost, estimated from its length (~4 characters a token in English): capped at
    the window when texts are truncated, every window when they are averaged."""
    tokens = chars / 4 + 2
    return min(tokens, cap) if long_text == "truncate" else tokens


#: texts per read of the bank (TextBlocks)
READ_BLOCK_TEXTS = 8192


def encode_inputs(ctx: StageContext, unit: dict[str, Any], needed: Needed) -> dict[str, Any]:
    """A unit's texts (read from ``texts`` in blocks of consecutive units; questions from ``needed``)."""
    # stage objects are shared by every run in a process: per-run caches live on the context
    if "questions" not in ctx.scratch:
        ctx.scratch["questions"] = needed(ctx)[1]
        ctx.scratch["texts"] = TextBlocks(ctx.units, lambda u: u["hashes"], READ_BLOCK_TEXTS)
    questions = ctx.scratch["questions"]
    stored = [h for h in unit["hashes"] if h not in questions]
    texts = unit_texts(ctx, unit, unit["hashes"]) if stored else {}
    texts.update({h: q for h, q in questions.items() if h not in texts})
    absent = [h for h in unit["hashes"] if h not in texts]
    if absent:  # a deleted texts part: summaries/keywords/hybrids can be rebuilt from the generations
        texts.update(rederive_texts(ctx, absent))
        absent = [h for h in unit["hashes"] if h not in texts]
    if absent:
        raise BankError(f"{ctx.bank.path}: {len(absent)} texts to encode are missing from 'texts' (first "
                        f"text_hash {absent[0]}); re-run the generate stage (memgas index)")
    # units of plans stored before pair windows existed carry no key: the encoder's own
    return {"hashes": unit["hashes"], "texts": [texts[h] for h in unit["hashes"]],
            "key": unit.get("key") or keys.encoder_key(ctx), "max_tokens": unit.get("max_tokens")}


def embed(model: Any, payload: dict[str, Any], params: dict[str, Any]) -> dict[str, pa.Table]:
    """An encoder stage's ``run``: the unit's texts embedded (under the window of its key)."""
    from memgas.pipeline.encode import embeddings_table

    encoder = model.with_max_tokens(payload["max_tokens"]) if payload.get("max_tokens") else model
    return {"embeddings": embeddings_table(encoder, payload["hashes"], payload["texts"], payload["key"])}


# -- the members of an encoder stage of the texts its ``needed(ctx)`` names, in hash order (card-encode,
# card-graph-encode): ``plan, inputs, finish = plan_needed, needed_inputs, needed_stats``
def plan_needed(stage: Any, ctx: StageContext) -> list[dict[str, Any]]:
    return encode_units(ctx, stage.needed(ctx), lambda todo, bank: sorted(todo))


def needed_inputs(stage: Any, ctx: StageContext, unit: dict[str, Any]) -> dict[str, Any]:
    return encode_inputs(ctx, unit, stage.needed)


def needed_stats(stage: Any, ctx: StageContext) -> dict[str, Any]:
    return vector_stats(ctx, stage.needed(ctx)[0])


#: the columns of ``embeddings`` an encoder stage's stats sum (not the vectors)
STAT_COLUMNS = ("truncated", "tokens", "tokens_dropped")


def vector_stats(ctx: StageContext, need: dict[str, list[str]]) -> dict[str, Any]:
    """An encoder stage's stats: the rows under its keys, truncated texts and tokens."""
    mine = ctx.bank.read("embeddings", ["encoder", *STAT_COLUMNS], filter=pc.field("encoder").isin(sorted(set(need))))
    stats: dict[str, Any] = {"rows": mine.num_rows}
    for col in STAT_COLUMNS:
        if col in mine.column_names:
            stats[col] = int(pc.sum(pc.cast(mine[col], pa.int64())).as_py() or 0)
    return stats


#: the vectors of MemGAS's node texts, turn pairs and questions (rows of ``embeddings``)
NODE_VECTORS = Table("node_vectors", "content", stored_in="embeddings", rows=_node_vector_rows,
                     digest=_node_vector_digest, summed=_node_vector_summed)


class EncodeStage(Stage):
    """Embed every text the nodes, turn pairs and queries need, once per encoder key (content-addressed:
    a text another config or the JustMem encoder already embedded under the key is not embedded again)."""

    name = "encode"
    version = keys.PRODUCER_VERSIONS["encode"]
    reads = ("nodes", "sessions", "pairs", "texts", "derived_texts", "queries")
    writes = (NODE_VECTORS,)
    fields = (*keys.ENCODER_OUTPUT_FIELDS, "encoder.pair_max_tokens", "encoder.session_max_tokens")
    where = "actor"
    model = "encoder"

    def active(self, ctx: StageContext) -> Active:
        fields, resolved = keys.encoder_identity(ctx)
        e = ctx.cfg.encoder
        windows = tuple(f for f, v in (("encoder.pair_max_tokens", e.pair_max_tokens),
                                       ("encoder.session_max_tokens", e.session_max_tokens)) if v is not None)
        return Active(fields=(*fields, *windows), resolved=resolved, model={"encoder": keys.encoder_config(ctx)})

    @staticmethod
    def needed(ctx: StageContext) -> tuple[dict[str, pa.Array], dict[str, str]]:
        """Text hashes to embed per cache key (every node text, turn pair and query; sessions and pairs under
        their windows' keys, :func:`memgas.jobs.keys.encoder_keys`), in no particular order and maybe named
        twice (a set in every use), and the
        texts that are not in ``texts`` (the questions) by hash. Arrow arrays (5M hashes at 10^6 sessions:
        no Python value per hash), computed once per stage run and fingerprint (plan, finish and the digest
        all ask)."""
        # kept for the run (ctx.scratch is emptied between finish and the digest), one fingerprint at a time
        fp = ctx.fingerprints.get(EncodeStage.name)
        held = ctx.cache.get("encode:needed")
        if fp is not None and held is not None and held[0] == fp:
            return held[1]
        got = EncodeStage._needed(ctx)
        if fp is not None:
            ctx.cache["encode:needed"] = (fp, got)
        return got

    @staticmethod
    def _needed(ctx: StageContext) -> tuple[dict[str, pa.Array], dict[str, str]]:
        from memgas.pipeline.encode import query_hash

        bank = ctx.bank
        sessions = pc.unique(bank.read("sessions", ["text_hash"])["text_hash"].combine_chunks())
        # a pair row is a function of its session's text (the key's hash): rows written twice are equal, so
        # no de-duplication; and one is_in over the column (a dataset filter built its set again per batch)
        pairs = bank.read("pairs", ["session_hash", "text_hash"], dedupe=False)
        pairs = pairs["text_hash"].filter(pc.is_in(pairs["session_hash"], value_set=sessions))
        nodes = bank.read("nodes", ["granularity", "text_hash"])
        main = nodes.filter(pc.invert(pc.is_in(nodes["granularity"], pa.array(["session", "turn"]))))["text_hash"]
        questions = {query_hash(q): q for q in bank.read("queries", ["query_id", "question"])["question"].to_pylist()}
        by_role = keys.encoder_keys(ctx)
        need: dict[str, list[Any]] = {}
        for role, hashes in (("main", main), ("main", pa.array(sorted(questions), pa.string())),
                             ("session", sessions), ("pair", pairs)):
            need.setdefault(by_role[role], []).extend(
                hashes.chunks if isinstance(hashes, pa.ChunkedArray) else [hashes])
        # not de-duplicated (a text may be named twice: a session's summary equal to another's keywords):
        # every use takes them as a set (a membership test's value set; the plan's missing texts), and a
        # unique over ~5M hashes at 10^6 sessions took ~3 s an append
        return {k: pa.chunked_array(c, pa.string()).combine_chunks() for k, c in need.items()}, questions

    @staticmethod
    def _grouped(todo: list[str], bank: Any) -> list[str]:
        """``todo`` with each session's texts together: the session, its turn pairs, then its summary,
        keyword and hybrid texts (sessions in hash order, then every other text in hash order). One unit then
        holds texts whose truncated tokens may be equal, and the encoder runs those once
        (pipeline/models/encoders.py): a session that truncates to its first pair, and with a short window
        a hybrid text ("summary keywords session") that truncates to its summary. Only the sessions that
        hold a text of ``todo`` are looked at (an append's, not the bank's: Arrow picks them out)."""
        left = set(todo)
        wanted = pa.array(sorted(left), pa.string())
        by_session: dict[str, list[str]] = {}
        # sessions that are texts to encode, and whose pair rows make them a group: every one with a pair
        with_pairs = bank.read("pairs", ["session_hash"], filter=pc.field("session_hash").isin(wanted))
        for sh in pc.unique(with_pairs["session_hash"].combine_chunks()).to_pylist():
            by_session.setdefault(sh, [])
        pairs = bank.read("pairs", ["session_hash", "pair_index", "text_hash"],
                          filter=pc.field("text_hash").isin(wanted)).sort_by(
            [("session_hash", "ascending"), ("pair_index", "ascending")])
        for sh, ph in zip(pairs["session_hash"].to_pylist(), pairs["text_hash"].to_pylist()):
            by_session.setdefault(sh, []).append(ph)
        if bank.exists("nodes"):
            for session, row in EncodeStage._node_groups(bank, wanted):
                by_session.setdefault(session, []).extend(row[g] for g in ("summary", "keyword", "hybrid") if g in row)
        out: list[str] = []
        for sh in sorted(by_session):
            for h in (sh, *by_session[sh]):
                if h in left:
                    left.discard(h)
                    out.append(h)
        return out + sorted(left)

    @staticmethod
    def _node_groups(bank: Any, wanted: pa.Array) -> list[tuple[str, dict[str, str]]]:
        """(session text, {granularity: text}) of each (history, session) of ``nodes`` in the order of its
        first row, for those whose session text or a summary, keyword or hybrid text is ``wanted``."""
        nodes = bank.read("nodes", ["history_id", "session_id", "granularity", "text_hash"])
        pair_key = pc.binary_join_element_wise(nodes["history_id"], nodes["session_id"], "\0")
        hit = pc.and_(pc.is_in(nodes["text_hash"], value_set=wanted),
                      pc.is_in(nodes["granularity"], pa.array(["session", "summary", "keyword", "hybrid"])))
        mine = pc.is_in(pair_key, value_set=pc.unique(pair_key.filter(hit).combine_chunks()))
        rows = nodes.filter(mine)
        groups: dict[tuple[str, str], dict[str, str]] = {}
        for hid, sid, g, h in zip(*(rows[c].to_pylist() for c in ("history_id", "session_id", "granularity",
                                                                   "text_hash"))):
            groups.setdefault((hid, sid), {})[g] = h
        return [(row["session"], row) for row in groups.values() if "session" in row]

    def plan(self, ctx: StageContext) -> list[dict[str, Any]]:
        return encode_units(ctx, self.needed(ctx), self._grouped)

    def inputs(self, ctx: StageContext, unit: dict[str, Any]) -> dict[str, Any]:
        return encode_inputs(ctx, unit, self.needed)

    run = staticmethod(embed)

    def finish(self, ctx: StageContext) -> dict[str, Any]:
        need = self.needed(ctx)[0]
        # the bank names the encoder behind each key of its vectors (a synthetic one says what its vectors are)
        ctx.bank.update_manifest(encoders={k: manifest_entry(ctx.cfg.encoder.model) for k in sorted(set(need))})
        return vector_stats(ctx, need)
