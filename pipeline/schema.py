"""Every Arrow schema of a memory bank, in one place.

A bank is a directory of Parquet tables (see :mod:`memgas.pipeline.bank`). Texts are stored once, by
content hash, in ``texts``; every other table refers to them by ``text_hash``. This is what makes
LongMemEval haystacks cheap: a session shared by many questions is stored, summarised and embedded once.

Keys (a re-run of a stage overwrites rows with the same key instead of adding duplicates):

================  ============================================  ==========================================
table             key                                           what a row is
================  ============================================  ==========================================
histories         history_id                                    one user's memory (LME: one question)
sessions          history_id, session_id                        a session referenced by a history
texts             text_hash                                     a unique text (session, turn pair, ...)
turns             session_hash, turn_index                      one utterance of a unique session
pairs             session_hash, pair_index                      a retrieval "turn": two utterances
queries           query_id                                      a question with its evidence
generations       text_hash, kind, model, prompt_version        an LLM (or LLM-free) summary / keywords
embeddings        text_hash, encoder                            one vector
nodes             history_id, session_id, granularity           which text a memory node is embedded from
edges             history_id, src, dst, mode                    an undirected association edge (src > dst)
rankings          method, query_id, rank                        a ranked session
answers           method, query_id                              filtered context and hypothesis
cards             card_id                                       a JustMem atomic memory card of a session
plans             query_id, planner                             a JustMem access plan of a question
card_picks        method, query_id, rank                        a card a JustMem method chose to read
card_graph_picks  method, query_id, rank, card_rank             a card that ranked a memgas-cards session
================  ============================================  ==========================================

JustMem (DESIGN.md §6): ``cards`` are keyed by content like ``generations``: ``card_id`` is
derived from (session_hash, extractor, card_index) (:func:`memgas.pipeline.justmem.extract.card_id`), so a
session shared by many histories is extracted once. A card's ``time`` is relative to the date of the session
it came from (the same session text may carry different dates in different histories), resolved when read.
"""

from __future__ import annotations

import pyarrow as pa

#: Bump when a table's columns change; banks of another version are refused with a clear error.
SCHEMA_VERSION = 2

#: Granularities of a memory node, in the node order of DESIGN.md §3 (node id = N_GRAN * position + index).
#: The one list: every count of granularities (node matrices, segments, the router) follows from it.
GRANULARITIES: tuple[str, ...] = ("session", "turn", "summary", "keyword")
#: Nodes per session.
N_GRAN: int = len(GRANULARITIES)
#: memgas-cards' granularities: the four above, then JustMem's cards (any number per session),
#: their index in this tuple the node's granularity in ``card_graph_edges`` and the router.
CARD_GRAPH_GRANULARITIES: tuple[str, ...] = (*GRANULARITIES, "card")
#: Node rows per session in ``nodes``: the four granularities, then the hybrid baseline's text.
NODE_GRANULARITIES: tuple[str, ...] = (*GRANULARITIES, "hybrid")
#: ``edges.mode``: a graph method's edges ("gmm") and those of the "no GMM" ablation ("topk")
EDGE_MODES: tuple[str, ...] = ("gmm", "topk")

#: Generation kinds stored in ``generations``.
GENERATION_KINDS: tuple[str, ...] = ("summary", "keywords")

HISTORIES = pa.schema(
    [
        pa.field("history_id", pa.string(), nullable=False),
        pa.field("dataset", pa.string(), nullable=False),
        pa.field("speakers", pa.list_(pa.string())),
        pa.field("n_sessions", pa.int32(), nullable=False),
    ]
)

SESSIONS = pa.schema(
    [
        pa.field("history_id", pa.string(), nullable=False),
        pa.field("session_id", pa.string(), nullable=False),
        pa.field("position", pa.int32(), nullable=False),  # 0-based order within the history
        pa.field("date_raw", pa.string()),  # the date string as given
        pa.field("date", pa.timestamp("s")),  # parsed, null when unparseable
        pa.field("text_hash", pa.string(), nullable=False),  # hash of the session text
        pa.field("n_turns", pa.int32(), nullable=False),
        pa.field("dataset_summary", pa.string()),  # e.g. LoCoMo's GPT session_summary
    ]
)

TEXTS = pa.schema(
    [
        pa.field("text_hash", pa.string(), nullable=False),
        pa.field("text", pa.string(), nullable=False),
    ]
)

TURNS = pa.schema(
    [
        pa.field("session_hash", pa.string(), nullable=False),
        pa.field("turn_index", pa.int32(), nullable=False),
        pa.field("role", pa.string(), nullable=False),  # user/assistant (LME) or the speaker's name
        pa.field("content", pa.string(), nullable=False),
        pa.field("has_answer", pa.bool_()),  # LongMemEval turn-level evidence mark
        pa.field("dia_id", pa.string()),  # LoCoMo dialog id, e.g. "D3:5"
    ]
)

PAIRS = pa.schema(
    [
        pa.field("session_hash", pa.string(), nullable=False),
        pa.field("pair_index", pa.int32(), nullable=False),
        pa.field("text_hash", pa.string(), nullable=False),
        pa.field("has_answer", pa.bool_()),  # any of its utterances carries has_answer
        pa.field("dia_ids", pa.list_(pa.string())),
    ]
)

QUERIES = pa.schema(
    [
        pa.field("query_id", pa.string(), nullable=False),
        pa.field("history_id", pa.string(), nullable=False),
        pa.field("question", pa.string(), nullable=False),
        pa.field("question_date_raw", pa.string()),
        pa.field("question_date", pa.timestamp("s")),
        pa.field("answer", pa.string()),
        pa.field("question_type", pa.string(), nullable=False),
        pa.field("category", pa.int32()),  # LoCoMo category number, null elsewhere
        pa.field("evidence_session_ids", pa.list_(pa.string())),
        pa.field("evidence_turn_ids", pa.list_(pa.string())),  # "session_id:pair_index"
        # "session_id:turn_index" (``turns.turn_index``): the evidence utterances (LoCoMo ``evidence`` dia_ids,
        # LongMemEval ``has_answer`` turns), for the evidence recall of the reader's context. Added
        # after schema version 2 without a bump: banks ingested before lack it and are read as they are
        # (pipeline/evaluate/evidence.py then reports no evidence recall and says to re-ingest)
        pa.field("evidence_utterance_ids", pa.list_(pa.string())),
        pa.field("is_abstention", pa.bool_(), nullable=False),
    ]
)

GENERATIONS = pa.schema(
    [
        pa.field("text_hash", pa.string(), nullable=False),  # hash of the *session* text
        pa.field("kind", pa.string(), nullable=False),  # summary | keywords
        pa.field("model", pa.string(), nullable=False),
        pa.field("prompt_version", pa.string(), nullable=False),
        pa.field("output", pa.string(), nullable=False),  # cleaned text ("a; b; c" for keywords)
        pa.field("raw_output", pa.string()),
        pa.field("prompt_tokens", pa.int32()),
        pa.field("completion_tokens", pa.int32()),
        pa.field("input_truncated", pa.bool_()),
        pa.field("fallback", pa.string()),  # set when the LLM output was unusable and a fallback was used
        pa.field("error", pa.string()),
    ]
)


def embeddings_schema(dim: int) -> pa.Schema:
    """Vectors are fixed-size lists so a column converts to a [n, dim] array without copying."""
    return pa.schema(
        [
            pa.field("text_hash", pa.string(), nullable=False),
            pa.field("encoder", pa.string(), nullable=False),
            pa.field("vector", pa.list_(pa.float32(), dim), nullable=False),
            pa.field("truncated", pa.bool_()),
            # tokens the encoder ran on (specials included, every window) and tokens cut by truncation
            pa.field("tokens", pa.int32()),
            pa.field("tokens_dropped", pa.int32()),
        ]
    )


NODES = pa.schema(
    [
        pa.field("history_id", pa.string(), nullable=False),
        pa.field("session_id", pa.string(), nullable=False),
        pa.field("position", pa.int32(), nullable=False),
        pa.field("granularity", pa.string(), nullable=False),
        # hash of the embedded text; for "turn" the session hash (its vector = mean of its pairs)
        pa.field("text_hash", pa.string(), nullable=False),
    ]
)

EDGES = pa.schema(
    [
        pa.field("history_id", pa.string(), nullable=False),
        pa.field("src", pa.int32(), nullable=False),  # node id = 4 * position + granularity index
        pa.field("dst", pa.int32(), nullable=False),
        pa.field("similarity", pa.float32(), nullable=False),
        pa.field("mode", pa.string(), nullable=False),  # one of EDGE_MODES
    ]
)

#: What each part of ``edges`` covers: per history, the edges of the rows (nodes) of sessions
#: ``[first_session, end_session)``, computed from the nodes of sessions ``[0, end_session)`` whose identity
#: (their texts and encoder keys) is ``prefix_digest``. Written with the edges, in a part of the same name.
EDGE_SEGMENTS = pa.schema(
    [
        pa.field("history_id", pa.string(), nullable=False),
        pa.field("first_session", pa.int32(), nullable=False),
        pa.field("end_session", pa.int32(), nullable=False),
        pa.field("prefix_digest", pa.string(), nullable=False),
    ]
)

#: association.search=ivf: a history's saved faiss IVF index (centroids, quantiser, lists; faiss's own
#: serialisation, no pickle), written by the unit whose segment ends at ``end_session``. It holds the nodes
#: of sessions ``[0, sessions)`` (whole blocks of the IVF's session grid), ``prefix_digest`` their identity
#: (segments.prefix_digests); an append searches it instead of rebuilding it
IVF_INDEX = pa.schema(
    [
        pa.field("history_id", pa.string(), nullable=False),
        pa.field("end_session", pa.int32(), nullable=False),
        pa.field("sessions", pa.int32(), nullable=False),
        pa.field("prefix_digest", pa.string(), nullable=False),
        pa.field("dim", pa.int32(), nullable=False),
        pa.field("index", pa.large_binary(), nullable=False),
    ]
)

#: association.search=ivf: the entries an append added to a history's saved index, as an index of their own
#: (jobs/stages/associate.py): merged in order into the full index of ``base_sessions`` sessions (and the deltas
#: before), they give the index of ``sessions`` sessions byte for byte
IVF_DELTA = pa.schema([IVF_INDEX.field("history_id"), IVF_INDEX.field("end_session"),
                       pa.field("base_sessions", pa.int32(), nullable=False),
                       *(IVF_INDEX.field(c) for c in ("sessions", "prefix_digest", "dim", "index"))])

#: association.search=ivf: the candidate recall of the IVF rows against the exact search, one row per sampled
#: node row (``row``, its fixed ``key``: row_keys.row_keys) of the segment ``[first_session, end_session)``
#: that holds it: ``hits`` of its exact candidates ``total``. A unit stores the rows of its own bottom-k keys;
#: a history's sample is the bottom-k of its current segments' rows (recall@mem_threshold = hits / total)
IVF_RECALL = pa.schema(
    [
        pa.field("history_id", pa.string(), nullable=False),
        pa.field("first_session", pa.int32(), nullable=False),
        pa.field("end_session", pa.int32(), nullable=False),
        pa.field("row", pa.int64(), nullable=False),
        pa.field("key", pa.uint64(), nullable=False),
        pa.field("hits", pa.int32(), nullable=False),
        pa.field("total", pa.int32(), nullable=False),
    ]
)

#: What each part of a ranker's tables holds: per history, the digest of the inputs its rankings
#: were computed from and its number of questions. Written with the rankings, in a part of the same name.
RANKED_HISTORIES = pa.schema(
    [
        pa.field("history_id", pa.string(), nullable=False),
        pa.field("inputs", pa.string(), nullable=False),
        pa.field("questions", pa.int32(), nullable=False),
    ]
)

RANKINGS = pa.schema(
    [
        pa.field("method", pa.string(), nullable=False),
        pa.field("query_id", pa.string(), nullable=False),
        pa.field("rank", pa.int32(), nullable=False),
        pa.field("session_id", pa.string(), nullable=False),
        pa.field("score", pa.float64(), nullable=False),
    ]
)

ANSWERS = pa.schema(
    [
        pa.field("method", pa.string(), nullable=False),
        pa.field("query_id", pa.string(), nullable=False),
        pa.field("retrieved_session_ids", pa.list_(pa.string())),
        pa.field("filtered_context", pa.string()),
        pa.field("hypothesis", pa.string()),
        pa.field("prompt_tokens", pa.int32()),
        pa.field("completion_tokens", pa.int32()),
        pa.field("error", pa.string()),
    ]
)

#: LLM-judge verdicts on a run's answers (``label`` null: unparseable or failed; ``scored_by``: llm | rule).
JUDGMENTS = pa.schema(
    [
        pa.field("method", pa.string(), nullable=False),
        pa.field("query_id", pa.string(), nullable=False),
        pa.field("question_type", pa.string()),
        pa.field("template", pa.string()),
        pa.field("judge_output", pa.string()),
        pa.field("label", pa.bool_()),
        pa.field("scored_by", pa.string()),
        pa.field("error", pa.string()),
    ]
)

#: JustMem card types (paper §3.1); the LLM-free rules that assign them are in justmem/extract.py.
CARD_TYPES: tuple[str, ...] = ("fact", "event", "preference", "state", "interaction")
#: JustMem planner operations (paper §3.2.1).
PLAN_OPERATIONS: tuple[str, ...] = ("lookup", "aggregation", "temporal_selection", "sorting", "comparison")
#: JustMem access profiles (paper eq. 1).
PROFILES: tuple[str, ...] = ("lookup", "compose", "replay")

CARDS = pa.schema(
    [
        pa.field("card_id", pa.string(), nullable=False),  # hash of (session_hash, extractor, card_index)
        pa.field("session_hash", pa.string(), nullable=False),  # as in ``turns``
        pa.field("extractor", pa.string(), nullable=False),  # key of what made it (llm-free/... or model|prompt)
        pa.field("card_index", pa.int32(), nullable=False),  # 0-based order within the session
        pa.field("text", pa.string(), nullable=False),  # the statement, with its subject explicit
        pa.field("text_hash", pa.string(), nullable=False),  # text_hash(text): how the encode stage keys it
        pa.field("type", pa.string(), nullable=False),  # one of CARD_TYPES
        # a time expression relative to the session date ("yesterday", "last week", "2022"); null = the date
        pa.field("time", pa.string()),
        pa.field("turn_start", pa.int32(), nullable=False),  # inclusive turn_index span of the session
        pa.field("turn_end", pa.int32(), nullable=False),
        # tokens of the session's extraction call(s), on card_index 0 only (null elsewhere): the column sums
        # to the construction cost
        pa.field("prompt_tokens", pa.int32()),
        pa.field("completion_tokens", pa.int32()),
        pa.field("input_truncated", pa.bool_()),
        pa.field("fallback", pa.string()),  # set when the LLM output was unusable and the LLM-free cards were used
        pa.field("error", pa.string()),
    ]
)

PLANS = pa.schema(
    [
        pa.field("query_id", pa.string(), nullable=False),
        pa.field("planner", pa.string(), nullable=False),  # key of what made it (llm-free/... or model|prompt)
        pa.field("entities", pa.list_(pa.string())),
        pa.field("time_constraints", pa.list_(pa.string())),
        pa.field("operation", pa.string(), nullable=False),  # one of PLAN_OPERATIONS
        pa.field("d", pa.bool_(), nullable=False),  # the evidence is distributed
        pa.field("f", pa.bool_(), nullable=False),  # source fidelity is needed
        pa.field("rewrites", pa.list_(pa.string())),  # answer-free rewrites (at most 2)
        pa.field("profile", pa.string(), nullable=False),  # one of PROFILES, by the fixed rule of d and f
        pa.field("raw_output", pa.string()),
        pa.field("prompt_tokens", pa.int32()),
        pa.field("completion_tokens", pa.int32()),
        pa.field("fallback", pa.string()),
        pa.field("error", pa.string()),
    ]
)

#: The cards a JustMem method chose for a question (results store, written by the rank stage beside
#: ``rankings``): what the read stage puts in the answer prompt, in final order, with the access profile.
CARD_PICKS = pa.schema(
    [
        pa.field("method", pa.string(), nullable=False),
        pa.field("query_id", pa.string(), nullable=False),
        pa.field("rank", pa.int32(), nullable=False),  # 1-based position in the final order (<= justmem.top_k)
        pa.field("card_id", pa.string(), nullable=False),
        pa.field("profile", pa.string(), nullable=False),  # one of PROFILES: how the method read this question
    ]
)

#: The cards that ranked memgas-cards' sessions (results store, written by card-graph-rank beside its
#: ``rankings``): per question and ranked session (its ``retrieval.store_top`` best), the session's cards of most
#: PPR mass (at most ``retrieval.card_graph_picks``): what its reader shows beside each session's text.
CARD_GRAPH_PICKS = pa.schema(
    [
        pa.field("method", pa.string(), nullable=False),
        pa.field("query_id", pa.string(), nullable=False),
        pa.field("rank", pa.int32(), nullable=False),  # the session's rank (as in ``rankings``)
        pa.field("session_id", pa.string(), nullable=False),
        pa.field("card_rank", pa.int32(), nullable=False),  # 1-based among the session's picks, by mass
        pa.field("card_id", pa.string(), nullable=False),
        pa.field("mass", pa.float64(), nullable=False),  # the card node's PPR value
    ]
)

#: Static schemas by table name (``embeddings`` depends on the encoder's dimension).
TABLES: dict[str, pa.Schema] = {
    "histories": HISTORIES,
    "sessions": SESSIONS,
    "texts": TEXTS,
    "turns": TURNS,
    "pairs": PAIRS,
    "queries": QUERIES,
    "generations": GENERATIONS,
    "nodes": NODES,
    "edges": EDGES,
    "edge_segments": EDGE_SEGMENTS,
    "ivf_index": IVF_INDEX,
    "ivf_delta": IVF_DELTA,
    "ivf_recall": IVF_RECALL,
    "rankings": RANKINGS,
    "ranked_histories": RANKED_HISTORIES,
    "answers": ANSWERS,
    "judgments": JUDGMENTS,
    "cards": CARDS,
    "plans": PLANS,
    "card_picks": CARD_PICKS,
    # memgas-cards' association edges: node ids of the five-granularity graph (pipeline/card_graph.py)
    "card_graph_edges": EDGES,
    # ... and which sessions' rows each of its parts holds (segments of the card graph's prefixes)
    "card_graph_edge_segments": EDGE_SEGMENTS,
    # ... and, under association.search=ivf, each segment's recall sample (as ivf_recall)
    "card_graph_ivf_recall": IVF_RECALL,
    # ... and its saved IVF indexes and their deltas (as ivf_index, ivf_delta)
    "card_graph_ivf_index": IVF_INDEX,
    "card_graph_ivf_delta": IVF_DELTA,
    "card_graph_picks": CARD_GRAPH_PICKS,
}

#: Key columns per table: rows sharing a key are one row (the last written wins on merge).
KEYS: dict[str, tuple[str, ...]] = {
    "histories": ("history_id",),
    "sessions": ("history_id", "session_id"),
    "texts": ("text_hash",),
    "turns": ("session_hash", "turn_index"),
    "pairs": ("session_hash", "pair_index"),
    "queries": ("query_id",),
    "generations": ("text_hash", "kind", "model", "prompt_version"),
    "embeddings": ("text_hash", "encoder"),
    "nodes": ("history_id", "session_id", "granularity"),
    "edges": ("history_id", "src", "dst", "mode"),
    "edge_segments": ("history_id", "first_session", "end_session"),
    "rankings": ("method", "query_id", "rank"),
    "ranked_histories": ("history_id",),
    "answers": ("method", "query_id"),
    "judgments": ("method", "query_id"),
    "cards": ("card_id",),
    "plans": ("query_id", "planner"),
    "card_picks": ("method", "query_id", "rank"),
    "card_graph_edges": ("history_id", "src", "dst", "mode"),
    "card_graph_edge_segments": ("history_id", "first_session", "end_session"),
    "card_graph_picks": ("method", "query_id", "rank", "card_rank"),
}


def node_blocks_schema(dim: int) -> pa.Schema:
    """A stored node block (jobs/history_index/stored_blocks.py): a long history's node vectors in node order, one
    row per node row of the block, each its ``dim`` float32 values as bytes (a flat column: Parquet decodes it
    ~10x faster than a list column); which history, block and nodes is in the part's name."""
    return pa.schema([pa.field("vector", pa.binary(4 * dim), nullable=False)])


#: tables whose schema depends on the encoder's dimension (their ``vector`` column's fixed size)
VECTOR_TABLES = ("embeddings", "node_blocks")


def schema_for(name: str, dim: int | None = None) -> pa.Schema:
    """The schema of table ``name``; ``dim`` is required for the :data:`VECTOR_TABLES`."""
    if name in VECTOR_TABLES:
        if dim is None:
            raise ValueError(f"the schema of {name} needs the encoder dimension")
        return embeddings_schema(dim) if name == "embeddings" else node_blocks_schema(dim)
    try:
        return TABLES[name]
    except KeyError:
        raise ValueError(f"unknown table {name!r}; known: {sorted([*TABLES, *VECTOR_TABLES])}") from None


def empty_table(name: str, dim: int | None = None) -> pa.Table:
    return schema_for(name, dim).empty_table()
