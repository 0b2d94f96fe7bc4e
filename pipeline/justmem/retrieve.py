"""JustMem retrieval over the cards of one history: Lookup, Compose, Replay, the adaptive method and ``cards``.

All cards of all sessions of a history compete (several cards of one session may all win). Per query q:

* **candidates** C(x) of a view x (the question or a rewrite): the ``justmem.candidates`` (N) cards with the
  highest dense similarity x . card (float64 dot products of the caller's vectors; ties: lower card index).
* **rerank** against the question: ``bm25-dense`` = reciprocal-rank fusion (k = ``RRF_K``) of the BM25 score
  of the question over the candidate texts (the bm25s library; one index over all cards of the history, so
  IDF is the history's) and the dense similarity to the question; ranks within the candidates, ties sharing
  the better rank; then fused score descending, ties by dense score, then lower card index. ``dense``: the
  dense score alone.
* **Lookup**: top K (``justmem.top_k``) of rerank(q, C(q)).
* **Compose**: top K of rerank(q, C(q) ∪ C(r1) ∪ C(r2) ∪ C_prf) (deduplicated; the same K: wider discovery,
  same reading budget).
* **The plan's fields** (every profile, when the caller gives the plans):
  - *entities*: the lexical score is BM25(question) + ``justmem.entity_weight`` x BM25(the entities);
  - *time constraints*: resolved to days (:func:`~memgas.pipeline.justmem.times.time_interval`); relative ones
    ("recently", "last week", a month without a year) only against the question's own date (LongMemEval's):
    LoCoMo's questions have none, and anchoring them at the last session lost 0.45 R_all@5 there (they
    say "recently" from the evidence session's point of view); a card is about its own time (resolved against
    its session's date) or else its session's date; the cards whose days meet a constraint's are a
    candidate view of their own (top N by dense similarity), and in the fusion they gain
    ``justmem.time_weight / (RRF_K + 1)`` (a third list whose matches share rank 1);
  - *operation*: aggregation, comparison and sorting (``WIDE_OPERATIONS``) take N = ``justmem.wide_candidates``
    per view instead of ``justmem.candidates``;
  - Compose only, *pseudo-relevance feedback* in the manner of RM3: the first fused order's top
    ``justmem.prf_cards`` cards give ``justmem.prf_terms`` terms (:func:`feedback_terms`); the lexical score
    becomes BM25(question) (+ entities) + ``justmem.prf_weight`` x BM25(terms), and its top N join the
    candidates (C_prf).
  - Compose only, *spread*: at most ``justmem.session_cap`` cards of a session before every other
    session's (:func:`spread_sessions`).
* **Replay**: Lookup's cards; the reader then recovers their source turns (:mod:`.read`).
* **justmem**: the plan's profile per query (``profile_for(d, f)``); ``justmem-lookup/-compose/-replay``:
  that profile for every query.
* **cards**: no selection: a session scores its best card's dense similarity.

Session order for retrieval metrics (comparable with every MemGAS method on the same bank): the sessions of
the final cards, in the order of their best card in the final order; then the other sessions by their best
card's dense similarity (descending; ties: lower session position); sessions without cards last. The scores
returned follow that order: a selected session scores ``top + (len(final) - r)`` (``top`` = 1 + the best
dense similarity of any session, r = rank of its best card), the others their best dense similarity, a
session without cards the lowest of those minus 1: they are for ordering and display, not calibrated.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import date, datetime
from functools import lru_cache
from typing import Any

import numpy as np
import pyarrow as pa

from memgas.pipeline.config import JustMemConfig
from memgas.pipeline.justmem.plan import Plan, profile_for
from memgas.pipeline.justmem.text import content_words
from memgas.pipeline.justmem.times import time_interval
from memgas.pipeline.methods import JUSTMEM_METHOD_NAMES

#: Reciprocal-rank fusion constant (Cormack et al., 2009: 60).
RRF_K = 60
#: Profile of each fixed-profile method (``justmem`` takes the plan's, ``cards`` selects nothing).
FIXED_PROFILE: dict[str, str] = {"justmem-lookup": "lookup", "justmem-compose": "compose",
                                 "justmem-replay": "replay"}
#: operations whose evidence is spread over many cards: their views take ``justmem.wide_candidates`` each
WIDE_OPERATIONS = frozenset({"aggregation", "comparison", "sorting"})


@dataclass
class HistoryCards:
    """The cards of one history, in (session position, card_index) order, with their vectors."""

    session_pos: np.ndarray  # int64 [C]: position (0..S-1) of each card's session in the history
    texts: list[str]
    vectors: np.ndarray  # float32 [C, d]
    n_sessions: int
    card_ids: list[str] = field(default_factory=list)
    session_hashes: list[str] = field(default_factory=list)  # [C]
    turn_spans: list[tuple[int, int]] = field(default_factory=list)  # [C] inclusive turn_index spans
    types: list[str] = field(default_factory=list)
    times: list[str | None] = field(default_factory=list)
    #: int64 [C, 2]: the days (``date.toordinal()``, both ends included) each card is about: its own time
    #: (:func:`~memgas.pipeline.justmem.times.time_interval` against its session's date), else its session's
    #: date; (-1, -1) when neither is known. Empty when the caller gave no dates (time constraints then
    #: select nothing).
    days: np.ndarray | None = None
    _bm25: Any = None
    _vocab: dict[str, int] | None = None
    _tokens: list[list[str]] | None = None

    def __post_init__(self) -> None:
        self.session_pos = np.asarray(self.session_pos, dtype=np.int64)
        self.vectors = np.asarray(self.vectors, dtype=np.float32)
        if self.vectors.ndim != 2 or self.vectors.shape[0] != len(self.texts) or len(self.session_pos) != len(self.texts):
            raise ValueError(f"{len(self.texts)} card texts, {len(self.session_pos)} session positions and vectors "
                             f"of shape {self.vectors.shape}: one row per card expected")
        if len(self.session_pos) and (self.session_pos.min() < 0 or self.session_pos.max() >= self.n_sessions):
            raise ValueError(f"card session positions must be in 0..{self.n_sessions - 1}")

    @classmethod
    def from_table(cls, session_hashes: Sequence[str], cards: pa.Table,
                   vectors: Mapping[str, np.ndarray] | np.ndarray,
                   session_dates: Sequence[datetime | None] | None = None) -> HistoryCards:
        """The cards of a history whose sessions (in position order) have ``session_hashes``, from ``CARDS``
        rows of one extractor; ``vectors``: {text_hash: vector} or an array aligned with ``cards``' rows;
        ``session_dates`` (same order, None where unknown) date the cards. A session hash repeated in one
        history (LongMemEval-S repeats a few) contributes its cards once, at its first position."""
        pos: dict[str, int] = {}
        for p, h in enumerate(session_hashes):
            pos.setdefault(h, p)
        rows = cards.select(["card_id", "session_hash", "card_index", "text", "text_hash", "type", "time",
                             "turn_start", "turn_end"]).to_pylist()
        if isinstance(vectors, np.ndarray):
            vec_rows = list(np.asarray(vectors, np.float32))
            if len(vec_rows) != len(rows):
                raise ValueError(f"{len(vec_rows)} vectors for {len(rows)} cards")
        else:
            vec_rows = [vectors[r["text_hash"]] for r in rows]
        keep = sorted((pos[r["session_hash"]], r["card_index"], i) for i, r in enumerate(rows) if r["session_hash"] in pos)
        sel = [rows[i] for _, _, i in keep]
        dim = len(vec_rows[0]) if vec_rows else 0
        mat = np.stack([vec_rows[i] for _, _, i in keep]).astype(np.float32) if keep else np.zeros((0, dim), np.float32)
        positions = [p for p, _, _ in keep]
        days = None
        if session_dates is not None:
            days = card_days([r["time"] for r in sel], [session_dates[p] for p in positions])
        return cls(session_pos=np.array(positions, np.int64), texts=[r["text"] for r in sel],
                   vectors=mat, n_sessions=len(session_hashes), card_ids=[r["card_id"] for r in sel],
                   session_hashes=[r["session_hash"] for r in sel],
                   turn_spans=[(r["turn_start"], r["turn_end"]) for r in sel], types=[r["type"] for r in sel],
                   times=[r["time"] for r in sel], days=days)

    def _index(self) -> None:
        import bm25s

        # bm25s sets its own logger to DEBUG on import, so "Building index" lines reached the terminal
        # even under `memgas -q`; its records follow the root level like everyone else's
        logging.getLogger("bm25s").setLevel(logging.NOTSET)
        if self._bm25 is None:
            tok = bm25s.tokenize(self.texts, stopwords="en", show_progress=False)
            self._bm25 = bm25s.BM25()
            self._bm25.index(tok, show_progress=False)
            self._vocab = dict(tok.vocab)

    def bm25_scores(self, query: str) -> np.ndarray:
        """BM25 (bm25s, Lucene variant, English stop words) of ``query`` over every card, float64 [C]."""
        return self.bm25_words(query_words(query))

    def bm25_words(self, words: Sequence[str]) -> np.ndarray:
        """BM25 of already tokenised ``words`` (unknown ones score nothing) over every card, float64 [C]."""
        self._index()
        words = [w for w in words if w in (self._vocab or {}) and w]
        if not words or not self.texts:
            return np.zeros(len(self.texts), np.float64)
        return np.asarray(self._bm25.get_scores(words), dtype=np.float64)

    def tokens(self) -> list[list[str]]:
        """Each card's words as BM25 sees them (bm25s tokeniser, English stop words removed)."""
        import bm25s

        if self._tokens is None:
            self._tokens = bm25s.tokenize(self.texts, stopwords="en", show_progress=False, return_ids=False)
        return self._tokens


@dataclass
class CardSelection:
    """What a JustMem method returns for the queries of one history."""

    order: np.ndarray  # int64 [Q, S]: session positions, best first
    scores: np.ndarray  # float64 [Q, S]: session scores (indexed by position), consistent with ``order``
    cards: list[np.ndarray]  # per query, the chosen card indices (into HistoryCards) in final order (<= K)
    profiles: list[str]  # per query: lookup | compose | replay ("" for the ``cards`` method)


def _desc_order(values: np.ndarray, tie: np.ndarray | None = None) -> np.ndarray:
    """Indices by ``values`` descending, ties by ``tie`` descending, then lower index (lexsort: stable)."""
    keys = [np.arange(len(values))]
    if tie is not None:
        keys.append(-tie)
    keys.append(-values)
    return np.lexsort(keys)


def candidates(hc: HistoryCards, vec: np.ndarray, n: int) -> np.ndarray:
    """C(x): the ``n`` cards most similar to ``vec`` (ties: lower card index)."""
    sims = hc.vectors.astype(np.float64) @ np.asarray(vec, np.float64)
    return _desc_order(sims)[:n]


def _shared_rank(x: np.ndarray) -> np.ndarray:
    """1-based rank of each value (descending); equal values share the better rank."""
    s = np.sort(x)[::-1]
    return 1 + np.searchsorted(-s, -x, side="left")


def rerank(hc: HistoryCards, question: str, dense_q: np.ndarray, cand: np.ndarray, reranker: str) -> np.ndarray:
    """``cand`` (card indices) reordered against the question (module docstring), without a plan."""
    return _fuse(np.unique(np.asarray(cand, np.int64)), dense_q, hc.bm25_scores(question), None, reranker, 0.0)


def _fuse(cand: np.ndarray, dense_q: np.ndarray, lexical: np.ndarray, when: np.ndarray | None, reranker: str,
          time_weight: float) -> np.ndarray:
    """``cand`` (sorted, unique) by reciprocal-rank fusion of the lexical and dense scores (ranks within
    ``cand``), plus ``time_weight / (RRF_K + 1)`` for a card that ``when`` marks (a third list whose matches
    share rank 1); ties by dense score, then lower index."""
    d = dense_q[cand]
    if reranker == "dense":
        fused = np.zeros(len(cand))
    elif reranker == "bm25-dense":
        fused = 1.0 / (RRF_K + _shared_rank(lexical[cand]))
    else:
        raise ValueError(f"justmem.reranker={reranker!r}: expected 'bm25-dense' or 'dense'")
    if reranker == "dense" and when is None:
        return cand[_desc_order(d)]
    fused = fused + 1.0 / (RRF_K + _shared_rank(d))
    if when is not None:
        fused = fused + np.where(when[cand], time_weight / (RRF_K + 1), 0.0)
    return cand[_desc_order(fused, d)]


def query_words(text: str) -> list[str]:
    """``text`` as BM25 sees it (bm25s tokeniser, English stop words removed)."""
    import bm25s

    return bm25s.tokenize([text], stopwords="en", show_progress=False, return_ids=False)[0] if text.strip() else []


def _as_date(d: date | datetime | Any) -> date | None:
    if d is None or d != d:  # None, NaN or NaT (unknown dates)
        return None
    if hasattr(d, "to_pydatetime"):  # a pandas Timestamp
        d = d.to_pydatetime()
    return d.date() if isinstance(d, datetime) else d


def card_days(times: Sequence[str | None], session_dates: Sequence[date | datetime | None]) -> np.ndarray:
    """int64 [C, 2]: each card's days (:attr:`HistoryCards.days`)."""
    out = np.full((len(times), 2), -1, np.int64)
    for i, (t, sd) in enumerate(zip(times, session_dates)):
        sd = _as_date(sd)
        iv = time_interval(t, sd) if t else None
        if iv is None and sd is not None:
            iv = (sd.toordinal(), sd.toordinal())
        if iv is not None:
            out[i] = iv
    return out


def time_mask(hc: HistoryCards, constraints: Sequence[str], now: date | datetime | None) -> np.ndarray | None:
    """bool [C]: the cards whose days meet a day of any of ``constraints`` (resolved against ``now``); None
    when no constraint names a date or the cards carry none (then time selects nothing)."""
    if hc.days is None or not len(hc.texts):
        return None
    ivs = [iv for iv in (time_interval(c, _as_date(now)) for c in constraints) if iv is not None]
    if not ivs:
        return None
    lo, hi = hc.days[:, 0], hc.days[:, 1]
    known = lo >= 0
    mask = np.zeros(len(hc.texts), bool)
    for a, b in ivs:
        mask |= known & (lo <= b) & (hi >= a)
    return mask


def feedback_terms(hc: HistoryCards, top: Sequence[int], exclude: set[str], n: int) -> list[str]:
    """Pseudo-relevance feedback in the manner of RM3: the ``n`` words of the cards ``top`` with the highest
    sum over those cards of tf(w, card) / |card| x log(C / df(w)) (words frequent in the history, such as a
    speaker's name on every card, weigh nothing), except ``exclude`` (the query's own words) and words that
    are not content words (bm25s's stop list keeps "my", "went"); ties by word."""
    if n <= 0 or not len(top):
        return []
    toks = hc.tokens()
    df: dict[str, int] = {}
    for ws in toks:
        for w in set(ws):
            df[w] = df.get(w, 0) + 1
    C = len(toks)
    weight: dict[str, float] = {}
    for c in top:
        ws = toks[int(c)]
        for w in ws:
            if w not in exclude and _is_content(w):
                weight[w] = weight.get(w, 0.0) + np.log(C / df[w]) / len(ws)
    ranked = sorted((-v, w) for w, v in weight.items() if v > 0)
    return [w for _, w in ranked[:n]]


@lru_cache(maxsize=65536)
def _is_content(word: str) -> bool:
    return bool(content_words(word))


def select_cards(hc: HistoryCards, question: str, qvec: np.ndarray, profile: str, cfg: JustMemConfig,
                 rewrite_vecs: np.ndarray | None = None, plan: Plan | None = None,
                 now: date | datetime | None = None) -> np.ndarray:
    """The K cards of one query under ``profile`` (lookup | compose | replay), in final order; ``plan`` (its
    fields) and ``now`` (the question's date) shape discovery and the fusion (module docstring)."""
    if profile not in ("lookup", "compose", "replay"):
        raise ValueError(f"unknown JustMem profile {profile!r}")
    if not hc.texts:
        return np.zeros(0, np.int64)
    dense_q = hc.vectors.astype(np.float64) @ np.asarray(qvec, np.float64)
    n = cfg.wide_candidates if plan is not None and plan.operation in WIDE_OPERATIONS else cfg.candidates
    pool = [_desc_order(dense_q)[:n]]
    lexical_on = cfg.reranker == "bm25-dense"  # the dense reranker reads no lexical score
    lexical = hc.bm25_scores(question) if lexical_on else np.zeros(len(hc.texts))
    when = None
    if plan is not None:
        if plan.entities and cfg.entity_weight > 0 and lexical_on:
            lexical = lexical + cfg.entity_weight * hc.bm25_scores(" ".join(plan.entities))
        when = time_mask(hc, plan.time_constraints, now) if cfg.time_weight > 0 else None
        if when is not None:  # the time view: the cards of those days, by dense similarity
            idx = np.flatnonzero(when)
            pool.append(idx[_desc_order(dense_q[idx])[:n]])
    if profile == "compose" and rewrite_vecs is not None:
        for r in np.asarray(rewrite_vecs, np.float32)[: cfg.rewrites]:
            pool.append(candidates(hc, r, n))
    if profile == "compose" and plan is not None and cfg.prf_cards > 0 and lexical_on:
        first = _fuse(np.unique(np.concatenate(pool)), dense_q, lexical, when, cfg.reranker, cfg.time_weight)
        own = set(query_words(question)) | set(query_words(" ".join(plan.entities)))
        terms = feedback_terms(hc, first[: cfg.prf_cards], own, cfg.prf_terms)
        if terms:  # RM3: the query model interpolated with the feedback terms; their best cards join
            lexical = lexical + cfg.prf_weight * hc.bm25_words(terms)
            pool.append(_desc_order(lexical)[:n])
    cand = np.unique(np.concatenate(pool))
    order = _fuse(cand, dense_q, lexical, when, cfg.reranker, cfg.time_weight)
    if profile == "compose" and cfg.session_cap > 0:
        order = spread_sessions(hc, order, cfg.session_cap)
    return order[: cfg.top_k]


def spread_sessions(hc: HistoryCards, order: np.ndarray, cap: int) -> np.ndarray:
    """``order`` with each session's cards beyond its first ``cap`` moved after all the others (stable):
    distributed evidence lies in several sessions, so Compose's K cards cover more of them."""
    seen: dict[int, int] = {}
    head, tail = [], []
    for c in order.tolist():
        p = int(hc.session_pos[c])
        seen[p] = seen.get(p, 0) + 1
        (head if seen[p] <= cap else tail).append(c)
    return np.array(head + tail, np.int64)


def session_order(hc: HistoryCards, dense_q: np.ndarray, chosen: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(order [S], scores [S]) of one query from its chosen cards (module docstring)."""
    S = hc.n_sessions
    best = np.full(S, -np.inf)
    np.maximum.at(best, hc.session_pos, dense_q)
    has = np.isfinite(best)
    floor = (best[has].min() - 1.0) if has.any() else 0.0
    scores = np.where(has, best, floor)
    first: list[int] = []
    for c in chosen:
        p = int(hc.session_pos[c])
        if p not in first:
            first.append(p)
    top = (best[has].max() + 1.0) if has.any() else 1.0
    for r, p in enumerate(first):
        scores[p] = top + (len(first) - r)
    rest = [p for p in _desc_order(np.where(has, best, floor)) if p not in set(first)]
    return np.array(first + rest, dtype=np.int64), scores.astype(np.float64)


def rank_cards(
    hc: HistoryCards,
    questions: Sequence[str],
    query_vecs: np.ndarray,
    method: str,
    cfg: JustMemConfig,
    *,
    plans: Sequence[Plan] | None = None,
    rewrite_vecs: Sequence[np.ndarray | None] | None = None,
    question_dates: Sequence[date | datetime | None] | None = None,
) -> CardSelection:
    """One JustMem method over the queries of one history. ``query_vecs`` [Q, d]; ``plans`` (per query) are
    needed by ``justmem`` (profiles) and, with ``rewrite_vecs`` (per query [R, d], the encoded
    ``plan.rewrites``), by Compose; every profile reads the plan's entities, time constraints (relative ones
    against ``question_dates``) and operation."""
    if method not in JUSTMEM_METHOD_NAMES:
        raise ValueError(f"unknown JustMem method {method!r}; choose from {list(JUSTMEM_METHOD_NAMES)}")
    q = np.asarray(query_vecs, np.float32)
    if q.ndim != 2 or (len(hc.texts) and q.shape[1] != hc.vectors.shape[1]):
        raise ValueError(f"query_vecs must be [Q, {hc.vectors.shape[1]}], got {q.shape}")
    if len(questions) != len(q):
        raise ValueError(f"{len(questions)} questions for {len(q)} query vectors")
    if method == "justmem" and (plans is None or len(plans) != len(q)):
        raise ValueError("method 'justmem' needs one plan per query (its profile)")
    orders, scores, chosen, profiles = [], [], [], []
    for i, (question, vec) in enumerate(zip(questions, q)):
        dense_q = hc.vectors.astype(np.float64) @ vec.astype(np.float64)
        if method == "cards":
            profile, picked = "", np.zeros(0, np.int64)
        else:
            profile = FIXED_PROFILE.get(method) or profile_for(plans[i].d, plans[i].f)  # type: ignore[index]
            rv = rewrite_vecs[i] if rewrite_vecs is not None else None
            plan = plans[i] if plans is not None else None
            now = _as_date(question_dates[i]) if question_dates is not None else None
            picked = select_cards(hc, question, vec, profile, cfg, rv, plan, now)
        o, s = session_order(hc, dense_q, picked)
        orders.append(o)
        scores.append(s)
        chosen.append(picked)
        profiles.append(profile)
    S = hc.n_sessions
    return CardSelection(np.array(orders, np.int64).reshape(len(q), S), np.array(scores, np.float64).reshape(len(q), S),
                         chosen, profiles)


def rank_history_cards(
    hc: HistoryCards,
    questions: Sequence[str],
    query_vecs: np.ndarray,
    methods: Sequence[str],
    cfg: JustMemConfig,
    *,
    plans: Sequence[Plan] | None = None,
    rewrite_vecs: Sequence[np.ndarray | None] | None = None,
    question_dates: Sequence[date | datetime | None] | None = None,
) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """(order [Q, S], scores [Q, S]) per JustMem method, the shape ``retrieve.rank_history`` returns."""
    out = {}
    for m in methods:
        sel = rank_cards(hc, questions, query_vecs, m, cfg, plans=plans, rewrite_vecs=rewrite_vecs,
                         question_dates=question_dates)
        out[m] = (sel.order, sel.scores)
    return out
