"""memgas-cards' stages: JustMem's cards as a fifth MemGAS granularity, in a graph of its own.

Why separate stages and tables, not a fifth granularity in ``nodes``, ``edges`` and ``rank``: the four-granularity
graph is what every MemGAS method reads; had it held the cards, a ``justmem.*`` change that alters the cards would
re-run plain MemGAS's association and rank, and selecting memgas-cards would change plain MemGAS's
fingerprints and bytes. Here the card graph reads MemGAS's nodes and vectors and JustMem's cards, and nothing of
MemGAS's reads it back:

- ``card-graph-encode`` (here): the cards' vectors under the one encoder key (rows of ``embeddings`` shared by content
  with card-encode and encode: a card text either encoder embedded is not embedded again);
- ``card-graph-associate`` (:mod:`~memgas.jobs.stages.card_graph_associate`): per history, the GMM edges of the five-granularity graph
  (:mod:`memgas.pipeline.card_graph`), segmented like MemGAS's (valid while the graph's prefix is unchanged:
  :func:`card_chains`), so an append associates only the new sessions' rows; a long prefix in node blocks, and
  under ``association.search: ivf`` the IVF search past the exact prefix (:mod:`memgas.pipeline.card_graph_ivf`);
- ``card-graph-rank`` (:mod:`~memgas.jobs.stages.card_graph_rank`): memgas-cards' rankings (rows of ``rankings``)
  and, per question and ranked session, the cards of most PPR mass (``card_graph_picks``);
- ``card-graph-read`` (:mod:`~memgas.jobs.stages.card_graph_read`): its answers, from the top sessions' texts with
  those cards, while memgas-cards is in ``reading.methods``.

They exist only while memgas-cards is in ``retrieval.methods``. The cards stage runs for it too; JustMem's planner
and card ranker do not.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from memgas.jobs import keys, tables
from memgas.jobs.history_index import READ_BATCH_ROWS
from memgas.jobs.stage import Active, Stage, StageContext
from memgas.jobs.stages.encode import (embed, needed_inputs, needed_stats, plan_needed, vector_rows, vector_rows_digest,
                                       vector_rows_summed)
from memgas.jobs.stages.justmem import current_cards
from memgas.jobs.stages.rank import query_vectors
from memgas.jobs.stages.shards import matrix_loader, node_matrix, shard_units
from memgas.pipeline.config import MemgasConfig
from memgas.pipeline.errors import BankError

FAMILY = "memgas-cards"


def card_graph_enabled(cfg: MemgasConfig) -> bool:
    """The card graph's stages run only when memgas-cards is ranked."""
    from memgas.pipeline.methods import uses_card_graph

    return uses_card_graph(cfg.retrieval.methods)


def _bank_cards(ctx: StageContext) -> pa.Table:
    """This config's cards of the bank's sessions (as the cards stage commits them)."""
    sessions = sorted(set(ctx.bank.read("sessions", ["text_hash"])["text_hash"].to_pylist()))
    return current_cards(ctx, sessions)


# -- encoding the cards ----------------------------------------------------------------------------------------
def _card_graph_vector_rows(ctx: StageContext) -> pa.Table:
    return vector_rows(ctx, CardGraphEncodeStage.needed(ctx)[0])


CARD_GRAPH_VECTORS = tables.Table("card_graph_vectors", "content", stored_in="embeddings",
                                  rows=_card_graph_vector_rows,
                                  digest=lambda ctx: vector_rows_digest(ctx, CardGraphEncodeStage.needed(ctx)[0]),
                                  summed=lambda ctx: vector_rows_summed(ctx, CardGraphEncodeStage.needed(ctx)[0]))


class CardGraphEncodeStage(Stage):
    """Embed this config's card texts under the main encoder key (what another encoder stage embedded is
    reused: rows are keyed by text and encoder)."""

    name = "card-graph-encode"
    version = "1"
    reads = ("cards", "sessions")  # the cards of the bank's sessions
    writes = (CARD_GRAPH_VECTORS,)
    fields = keys.ENCODER_OUTPUT_FIELDS
    where = "actor"
    model = "encoder"

    def active(self, ctx: StageContext) -> Active | None:
        if not card_graph_enabled(ctx.cfg):
            return None
        fields, resolved = keys.encoder_identity(ctx)
        return Active(fields=fields, resolved=resolved, model={"encoder": keys.encoder_config(ctx)})

    @staticmethod
    def needed(ctx: StageContext) -> tuple[dict[str, list[str]], dict[str, str]]:
        cards = _bank_cards(ctx)
        texts = dict(zip(cards["text_hash"].to_pylist(), cards["text"].to_pylist()))
        return {keys.encoder_key(ctx): sorted(texts)}, texts

    plan, inputs, finish, run = plan_needed, needed_inputs, needed_stats, staticmethod(embed)


def card_chains(ctx: StageContext) -> dict[str, list[str]]:
    """Per history, the prefix digests of its card graph (:func:`memgas.pipeline.association.segments.card_prefix_digests`:
    MemGAS's chain with each session's cards folded in): what a segment of ``card_graph_edges`` is valid under."""
    return _card_state(ctx).chains


def card_sizes(ctx: StageContext) -> dict[str, np.ndarray]:
    """Per history, the nodes of each session of its card graph (four, plus the cards it adds), in position order."""
    return _card_state(ctx).sizes


def session_card_hashes(ctx: StageContext, history: str, s0: int, s1: int) -> list[str]:
    """The text hashes of the cards of ``history``'s sessions ``[s0, s1)`` in the card graph's node order
    (session, then card index; a session hash repeated in the history adds none, :func:`card_sizes`): what
    a long history's card-graph blocks read the vectors of, for the sessions they build (an append's only)."""
    from memgas.pipeline.schema import N_GRAN

    state = _card_state(ctx)
    sizes = state.sizes[history][s0:s1].tolist()
    hashes = state.sessions[history].slice(s0, s1 - s0).to_pylist()
    by_session = _cards_by_session(ctx, sorted({t for t, n in zip(hashes, sizes) if n > N_GRAN}))
    out: list[str] = []
    for t, n in zip(hashes, sizes):
        if n > N_GRAN:
            cards = by_session.get(t, [])
            if len(cards) != n - N_GRAN:  # the cards changed since the layout was read: never a shifted graph
                raise BankError(f"{ctx.bank.path}: session {t} of history {history} has {len(cards)} cards, "
                                f"its card graph {n - N_GRAN}")
            out += cards
    return out


@dataclass(frozen=True)
class CardState:
    """What the card graph's layout and identity are computed from, once per run and state of the nodes and
    the cards: per history its prefix digests (:func:`card_chains`), its sessions' node counts
    (:func:`card_sizes`) and its session hashes in position order (an Arrow slice: a few bytes a session)."""

    chains: dict[str, list[str]]
    sizes: dict[str, np.ndarray]
    sessions: dict[str, pa.Array]


def _cards_by_session(ctx: StageContext, session_hashes: list[str]) -> dict[str, list[str]]:
    """{session hash: its cards' text hashes in card order} of this config's cards of ``session_hashes``
    (only the columns that say which card is where: not their texts)."""
    f = (pc.field("extractor") == keys.cards_key(ctx)) & pc.field("session_hash").isin(session_hashes)
    cards = ctx.bank.read("cards", ["session_hash", "card_index", "text_hash"], filter=f).sort_by(
        [("session_hash", "ascending"), ("card_index", "ascending")])
    out: dict[str, list[str]] = {}
    for sh, th in zip(cards["session_hash"].to_pylist(), cards["text_hash"].to_pylist()):
        out.setdefault(sh, []).append(th)
    return out


def _card_state(ctx: StageContext) -> CardState:
    """:class:`CardState`: computed once per run and state of the nodes and the cards (their committed
    digests)."""
    from memgas.jobs.history_index.prefixes import chains
    from memgas.pipeline.association.segments import card_prefix_digests
    from memgas.pipeline.schema import N_GRAN

    try:
        digests = (tables.read_digest(ctx, "nodes"), tables.read_digest(ctx, "cards"))
    except KeyError:  # a context without the job's pipeline (a library caller): computed, not cached
        digests = (None, None)
    seed = f"cards={keys.cards_key(ctx)}|encoder={keys.encoder_key(ctx)}"
    key = ("card-graph:state", digests, seed)
    if None not in digests and key in ctx.cache:
        return ctx.cache[key]
    sess = ctx.bank.read("nodes", ["history_id", "position", "text_hash"],
                         filter=pc.field("granularity") == "session")
    sess = sess.sort_by([("history_id", "ascending"), ("position", "ascending")])
    sessions: dict[str, list[str]] = {}
    first: dict[str, int] = {}  # the table is sorted by history: each one's sessions are a run of rows
    for i, (h, t) in enumerate(zip(sess["history_id"].to_pylist(), sess["text_hash"].to_pylist())):
        sessions.setdefault(h, []).append(t)
        first.setdefault(h, i)
    by_session = _cards_by_session(ctx, sorted({t for ts in sessions.values() for t in ts}))
    sizes = {}
    for h, hashes in sessions.items():
        seen: set[str] = set()
        n = []
        for t in hashes:  # a repeated session hash adds its cards at its first position only
            n.append(N_GRAN + (0 if t in seen else len(by_session.get(t, ()))))
            seen.add(t)
        sizes[h] = np.array(n, np.int64)
    column = sess["text_hash"].combine_chunks()
    out = CardState(card_prefix_digests(chains(ctx), sessions, {sh: ",".join(v) for sh, v in by_session.items()},
                                        seed), sizes, {h: column.slice(first[h], len(ts)) for h, ts in sessions.items()})
    if None not in digests:
        ctx.cache[key] = out
    return out


def histories(ctx: StageContext) -> list[dict[str, Any]]:
    """Units of ``ray.shard_size`` of the dataset's histories."""
    return shard_units(ctx, ctx.bank.read("histories", columns=["history_id"])["history_id"].to_pylist())


# -- one history's five-granularity graph ----------------------------------------------------------------------
def card_graphs(ctx: StageContext, history_ids: list[str],
                card_ids: dict[str, list[str]] | None = None) -> dict[str, tuple[Any, list[str]]]:
    """{history: (CardGraph, session ids in position order)} of ``history_ids`` that have nodes; ``card_ids``,
    when given, gets {history: the id of each card node, in node order}."""
    from memgas.pipeline.card_graph import build_card_graph
    from memgas.pipeline.justmem.retrieve import HistoryCards

    loader = matrix_loader(ctx, history_ids)
    sess = loader.nodes.filter(pc.field("granularity") == "session")
    hashes: dict[str, list[str]] = {}
    for h, t in zip(sess["history_id"].to_pylist(), sess["text_hash"].to_pylist()):  # sorted by position
        hashes.setdefault(h, []).append(t)
    cards = current_cards(ctx, sorted({t for ts in hashes.values() for t in ts}))
    texts = sorted(set(cards["text"].to_pylist()))
    key = keys.encoder_key(ctx)
    # a batch of embeddings at a time: the unit's ~10^5 card vectors out of the whole table (a plain filtered
    # read held ~0.5 GB more at 60 histories, growing with the bank)
    vecs = query_vectors(ctx.bank, texts, key, READ_BATCH_ROWS) if texts else np.zeros((0, 0), np.float32)
    by_text = dict(zip(texts, vecs))
    vectors = {th: by_text[t] for th, t in zip(cards["text_hash"].to_pylist(), cards["text"].to_pylist())}
    out = {}
    for h in sorted(hashes):
        m = loader.get(h)
        hc = HistoryCards.from_table(hashes[h], cards.filter(pc.field("session_hash").isin(sorted(set(hashes[h])))),
                                     vectors)
        card_vecs = hc.vectors if len(hc.texts) else np.zeros((0, loader.dim), np.float32)
        out[h] = (build_card_graph(node_matrix(m), hc.session_pos, card_vecs), m["session_ids"])
        if card_ids is not None:  # build_card_graph keeps the cards' order: HistoryCards' is the node order
            card_ids[h] = hc.card_ids
    return out


def history_card_graph(ctx: StageContext, history_ids: list[str] | None = None,
                       card_ids: dict[str, list[str]] | None = None) -> list[tuple]:
    """(history, CardGraph, session ids, query ids, query vectors [Q, d]) per history with questions, queries
    in id order (a history's questions are ranked as one batch: the same bits whatever the files' order);
    ``card_ids`` as :func:`card_graphs`'."""
    bank = ctx.bank
    filt = None if history_ids is None else pc.field("history_id").isin(history_ids)
    queries = bank.read("queries", ["query_id", "history_id", "question"], filter=filt).sort_by("query_id")
    if queries.num_rows == 0:
        return []
    qdf = queries.to_pandas()
    ids = sorted(set(qdf["history_id"]))
    graphs = card_graphs(ctx, ids, card_ids)
    qv = query_vectors(bank, qdf["question"].tolist(), keys.encoder_key(ctx))
    out = []
    for h, g in qdf.groupby("history_id", sort=True):
        if h in graphs:
            graph, sids = graphs[h]
            out.append((h, graph, sids, g["query_id"].tolist(), qv[g.index.to_numpy()]))
    return out
