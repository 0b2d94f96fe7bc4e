"""JustMem retrieval over cards: Compose's union cut to the same K, the session order rule, exact and
deterministic rankings. Real parts: LoCoMo sample cards (LLM-free), MiniLM vectors, bm25s."""

from __future__ import annotations

from datetime import datetime

import numpy as np
import pytest

from memgas.pipeline.config import JustMemConfig
from memgas.pipeline.justmem.extract import LLM_FREE_EXTRACTOR, extract_cards, turns_by_session
from memgas.pipeline.justmem.plan import Plan, plan_llm_free
from memgas.pipeline.justmem.retrieve import (
    HistoryCards,
    candidates,
    feedback_terms,
    rank_cards,
    rank_history_cards,
    rerank,
    select_cards,
    spread_sessions,
)
from memgas.pipeline.methods import JUSTMEM_METHOD_NAMES

N_QUESTIONS = 40


@pytest.fixture(scope="module")
def history(locomo_bank, encoder):
    """The first history of the sample: its cards (HistoryCards), 40 questions, their vectors, plans, rewrites."""
    sessions = locomo_bank.read("sessions").to_pandas().sort_values(["history_id", "position"])
    hid = sorted(sessions.history_id.unique())[0]
    hashes = list(sessions[sessions.history_id == hid].text_hash)
    turns = turns_by_session(locomo_bank.read("turns"))
    cards = extract_cards([(h, turns[h], "locomo") for h in dict.fromkeys(hashes)], JustMemConfig(),
                          key=LLM_FREE_EXTRACTOR)
    vecs = encoder.encode(cards.column("text").to_pylist())
    q = locomo_bank.read("queries").to_pandas()
    q = q[q.history_id == hid].head(N_QUESTIONS)
    questions = list(q.question)
    plans = [plan_llm_free(x, 2) for x in questions]
    qv = encoder.encode(questions)
    rv = [encoder.encode(p.rewrites) if p.rewrites else None for p in plans]
    return {"hashes": hashes, "cards": cards, "vecs": vecs, "questions": questions, "qv": qv, "plans": plans,
            "rv": rv, "hc": HistoryCards.from_table(hashes, cards, vecs)}


def _dense(hc: HistoryCards, v: np.ndarray) -> np.ndarray:
    return hc.vectors.astype(np.float64) @ v.astype(np.float64)


def test_compose_is_the_union_of_candidates_reranked_to_the_same_k(history) -> None:
    hc, cfg = history["hc"], JustMemConfig()
    differs = wider = 0
    for question, qv, rv in zip(history["questions"], history["qv"], history["rv"]):
        cq = candidates(hc, qv, cfg.candidates)
        union = set(cq.tolist()).union(*(candidates(hc, r, cfg.candidates).tolist() for r in rv))
        look = select_cards(hc, question, qv, "lookup", cfg, rv)
        comp = select_cards(hc, question, qv, "compose", cfg, rv)
        assert len(look) == len(comp) == cfg.top_k
        assert set(look.tolist()) <= set(cq.tolist()) and set(comp.tolist()) <= union
        dq = _dense(hc, qv)
        fused = rerank(hc, question, dq, np.array(sorted(union)), cfg.reranker)
        assert np.array_equal(comp, spread_sessions(hc, fused, cfg.session_cap)[: cfg.top_k])
        assert np.array_equal(look, rerank(hc, question, dq, cq, cfg.reranker)[: cfg.top_k])
        # without rewrites (and without a plan: no feedback) Compose is Lookup's order spread over sessions
        spread = spread_sessions(hc, rerank(hc, question, dq, cq, cfg.reranker), cfg.session_cap)[: cfg.top_k]
        assert np.array_equal(select_cards(hc, question, qv, "compose", cfg, None), spread)
        assert np.array_equal(select_cards(hc, question, qv, "compose", cfg.model_copy(update={"session_cap": 0}),
                                           None), look)
        differs += not np.array_equal(look, comp)
        wider += len(union) > len(cq)
    assert differs and wider, "the rewrites never widened discovery: the union test checked nothing"


def test_candidates_and_rerank_exact(history) -> None:
    hc, cfg = history["hc"], JustMemConfig()
    qv, question = history["qv"][0], history["questions"][0]
    dq = _dense(hc, qv)
    cq = candidates(hc, qv, cfg.candidates)
    assert np.array_equal(cq, np.lexsort((np.arange(len(dq)), -dq))[: cfg.candidates])
    # reciprocal-rank fusion written out independently
    b = hc.bm25_scores(question)[np.sort(cq)]
    d = dq[np.sort(cq)]
    rank = lambda x: np.array([1 + np.sum(x > v) for v in x])  # noqa: E731 - shared ranks for ties
    fused = 1 / (60 + rank(b)) + 1 / (60 + rank(d))
    want = np.sort(cq)[sorted(range(len(cq)), key=lambda i: (-fused[i], -d[i], np.sort(cq)[i]))]
    assert np.array_equal(rerank(hc, question, dq, cq, "bm25-dense"), want)
    assert np.array_equal(rerank(hc, question, dq, cq, "dense"), cq)


def test_bm25_is_the_library_over_the_history_cards(history) -> None:
    import bm25s

    hc = history["hc"]
    q = "When did Caroline go to the LGBTQ support group?"
    got = hc.bm25_scores(q)
    tok = bm25s.tokenize(hc.texts, stopwords="en", show_progress=False)
    ret = bm25s.BM25()
    ret.index(tok, show_progress=False)
    words = [w for w in bm25s.tokenize([q], stopwords="en", show_progress=False, return_ids=False)[0] if w in tok.vocab]
    assert {"caroline", "lgbtq", "support", "group"} <= set(words)
    assert np.array_equal(got, ret.get_scores(words).astype(np.float64))
    card_words = bm25s.tokenize(hc.texts, stopwords="en", show_progress=False, return_ids=False)
    has = np.array([bool(set(w) & set(words)) for w in card_words])
    assert (got[~has] == 0).all() and (got[has] > 0).all() and has.any() and (~has).any()


def test_session_order_rule(history) -> None:
    hc, cfg = history["hc"], JustMemConfig()
    sel = rank_cards(hc, history["questions"], history["qv"], "justmem-lookup", cfg)
    cards = rank_cards(hc, history["questions"], history["qv"], "cards", cfg)
    S = len(history["hashes"])
    for i, qv in enumerate(history["qv"]):
        dq = _dense(hc, qv)
        best = np.array([dq[hc.session_pos == s].max() for s in range(S)])
        by_best = [int(s) for s in np.lexsort((np.arange(S), -best))]
        first = list(dict.fromkeys(int(hc.session_pos[c]) for c in sel.cards[i]))
        assert sel.order[i].tolist() == first + [s for s in by_best if s not in first]
        assert cards.order[i].tolist() == by_best and np.array_equal(cards.scores[i], best)
        assert (np.diff(sel.scores[i][sel.order[i]]) <= 0).all(), "scores must follow the order"
        assert len(cards.cards[i]) == 0 and cards.profiles[i] == ""


def test_adaptive_follows_the_plan_profiles(history) -> None:
    hc, cfg = history["hc"], JustMemConfig()
    args = (hc, history["questions"], history["qv"])
    kw = {"plans": history["plans"], "rewrite_vecs": history["rv"]}
    ada = rank_cards(*args, "justmem", cfg, **kw)
    fixed = {p: rank_cards(*args, f"justmem-{p}", cfg, **kw) for p in ("lookup", "compose", "replay")}
    assert ada.profiles == [p.profile for p in history["plans"]]
    assert {"lookup", "compose"} <= set(ada.profiles)
    for i, prof in enumerate(ada.profiles):
        assert np.array_equal(ada.cards[i], fixed[prof].cards[i]) and np.array_equal(ada.order[i], fixed[prof].order[i])
    assert np.array_equal(fixed["replay"].order, fixed["lookup"].order)  # Replay reads more, ranks the same


def test_rankings_are_deterministic_and_independent_of_row_order(history) -> None:
    cfg = JustMemConfig()
    kw = {"plans": history["plans"], "rewrite_vecs": history["rv"]}
    a = rank_history_cards(history["hc"], history["questions"], history["qv"], JUSTMEM_METHOD_NAMES, cfg, **kw)
    # a fresh index (fresh BM25) from the cards table in another row order, vectors by text_hash
    perm = np.random.default_rng(0).permutation(history["cards"].num_rows)
    shuffled = history["cards"].take(perm)
    vec_of = dict(zip(history["cards"].column("text_hash").to_pylist(), history["vecs"]))
    hc2 = HistoryCards.from_table(history["hashes"], shuffled, vec_of)
    b = rank_history_cards(hc2, history["questions"], history["qv"], JUSTMEM_METHOD_NAMES, cfg, **kw)
    Q, S = len(history["questions"]), len(history["hashes"])
    for m in JUSTMEM_METHOD_NAMES:
        assert a[m][0].shape == (Q, S) and a[m][0].dtype == np.int64 and a[m][1].dtype == np.float64
        assert np.array_equal(a[m][0], b[m][0]) and np.array_equal(a[m][1], b[m][1]), m
        assert all(sorted(o) == list(range(S)) for o in a[m][0].tolist())


def test_ties_and_sessions_without_cards() -> None:
    """Hand-made: equal vectors and texts tie everywhere; ties go to the lower card index / session position."""
    v = np.array([[1.0, 0.0]] * 3 + [[0.0, 1.0]], np.float32)
    hc = HistoryCards(session_pos=np.array([2, 0, 0, 1]), texts=["same words"] * 3 + ["other words"], vectors=v,
                      n_sessions=4)
    cfg = JustMemConfig(candidates=3, top_k=2)
    sel = rank_cards(hc, ["same words"], np.array([[1.0, 0.0]], np.float32), "justmem-lookup", cfg)
    assert sel.cards[0].tolist() == [0, 1]  # cards 0, 1, 2 tie on both scores: lower index first
    # sessions: 2 (card 0), 0 (card 1), then by best dense: 1 (0.0); session 3 has no card: last
    assert sel.order[0].tolist() == [2, 0, 1, 3]
    assert sel.scores[0].tolist() == [1.0 + 1 + 1, 0.0, 1.0 + 1 + 2, -1.0]


def test_bad_inputs() -> None:
    hc = HistoryCards(session_pos=np.array([0]), texts=["x y"], vectors=np.ones((1, 2), np.float32), n_sessions=1)
    with pytest.raises(ValueError, match="unknown JustMem method 'memgas'"):
        rank_cards(hc, ["q"], np.ones((1, 2), np.float32), "memgas", JustMemConfig())
    with pytest.raises(ValueError, match="needs one plan per query"):
        rank_cards(hc, ["q"], np.ones((1, 2), np.float32), "justmem", JustMemConfig())
    with pytest.raises(ValueError, match="query_vecs must be"):
        rank_cards(hc, ["q"], np.ones((1, 3), np.float32), "cards", JustMemConfig())
    with pytest.raises(ValueError, match="session positions"):
        HistoryCards(session_pos=np.array([1]), texts=["x"], vectors=np.ones((1, 2)), n_sessions=1)


# -- the plan's fields shape retrieval: hand-made cards, every other signal tied --------------------

def _tied(texts: list[str], dates: list[datetime | None], times: list[str | None] | None = None) -> HistoryCards:
    """One card per session, equal vectors: only what the plan adds can separate them."""
    import pyarrow as pa

    n = len(texts)
    rows = pa.table({"card_id": [f"c{i}" for i in range(n)], "session_hash": [f"s{i}" for i in range(n)],
                     "card_index": [0] * n, "text": texts, "text_hash": [f"t{i}" for i in range(n)],
                     "type": ["event"] * n, "time": times or [None] * n, "turn_start": [0] * n, "turn_end": [0] * n})
    return HistoryCards.from_table([f"s{i}" for i in range(n)], rows, np.ones((n, 2), np.float32), dates)


Q1 = np.array([[1.0, 0.0]], np.float32)


def test_a_time_constraint_boosts_the_card_of_that_date() -> None:
    dates = [datetime(2023, 5, 1), datetime(2023, 6, 10), datetime(2023, 7, 20)]
    hc = _tied(["Melanie said: we went camping"] * 3, dates)
    cfg = JustMemConfig(candidates=3, top_k=3)
    q = "When did Melanie go camping in June?"
    plan = Plan(entities=["Melanie"], time_constraints=["june"], operation="temporal_selection")
    # without the plan, all tie: lower index first; with it, the June session's card leads
    assert rank_cards(hc, [q], Q1, "justmem-lookup", cfg).cards[0].tolist() == [0, 1, 2]
    # a month without a year is read against the question's date; without one it selects nothing
    assert rank_cards(hc, [q], Q1, "justmem-lookup", cfg, plans=[plan]).cards[0].tolist() == [0, 1, 2]
    sel = rank_cards(hc, [q], Q1, "justmem-lookup", cfg, plans=[plan], question_dates=[datetime(2023, 8, 1)])
    assert sel.cards[0].tolist() == [1, 0, 2] and sel.order[0].tolist() == [1, 0, 2]
    assert rank_cards(hc, [q], Q1, "justmem-lookup", cfg.model_copy(update={"time_weight": 0.0}),
                      plans=[plan], question_dates=[datetime(2023, 8, 1)]).cards[0].tolist() == [0, 1, 2]
    # a card's own time counts against its session's date: "yesterday" said on 11 June is 10 June
    hc2 = _tied(["Melanie said: we went camping"] * 3, [datetime(2023, 6, 11)] * 3, [None, None, "yesterday"])
    plan2 = Plan(time_constraints=["june 10, 2023"])
    assert rank_cards(hc2, [q], Q1, "justmem-lookup", cfg, plans=[plan2]).cards[0].tolist() == [2, 0, 1]
    # relative constraints are read against the question's date ("last Saturday" on Thu 9 March 2023 = 4 March)
    hc3 = _tied(["The user said: I got a necklace"] * 3, [datetime(2023, 3, 1), datetime(2023, 3, 4), None])
    plan3 = Plan(time_constraints=["last saturday"])
    sel3 = rank_cards(hc3, ["I received jewelry last Saturday from whom?"], Q1, "justmem-lookup", cfg, plans=[plan3],
                      question_dates=[datetime(2023, 3, 9, 15, 47)])
    assert sel3.cards[0].tolist() == [1, 0, 2]


def test_target_entities_weigh_in_the_lexical_score() -> None:
    hc = _tied(["Caroline said: I love painting sunsets", "Melanie said: I love painting sunsets"], [None, None])
    cfg = JustMemConfig(candidates=2, top_k=2)
    q = "What does she love painting?"
    assert rank_cards(hc, [q], Q1, "justmem-lookup", cfg).cards[0].tolist() == [0, 1]
    plan = Plan(entities=["Melanie"])
    assert rank_cards(hc, [q], Q1, "justmem-lookup", cfg, plans=[plan]).cards[0].tolist() == [1, 0]
    assert rank_cards(hc, [q], Q1, "justmem-lookup", cfg.model_copy(update={"entity_weight": 0.0}),
                      plans=[plan]).cards[0].tolist() == [0, 1]
    scores = hc.bm25_scores(q) + hc.bm25_scores("Melanie")
    assert scores[1] > scores[0] and hc.bm25_scores(q)[0] == hc.bm25_scores(q)[1]


def test_aggregation_widens_the_candidates() -> None:
    # dense similarity falls with the index; only card 3 names the beach, which the question asks about
    v = np.array([[1.0, 0.0], [0.9, 0.1], [0.8, 0.2], [0.1, 0.9]], np.float32)
    texts = ["Melanie said: the park was fun", "Melanie said: we had lunch", "Melanie said: we saw a movie",
             "Melanie said: we went to the beach"]
    hc = HistoryCards(session_pos=np.arange(4), texts=texts, vectors=v, n_sessions=4)
    cfg = JustMemConfig(candidates=2, wide_candidates=4, top_k=2)
    q = "How many times did Melanie go to the beach?"
    look = rank_cards(hc, [q], Q1, "justmem-lookup", cfg, plans=[Plan(operation="lookup")])
    agg = rank_cards(hc, [q], Q1, "justmem-lookup", cfg, plans=[Plan(operation="aggregation", d=True)])
    assert look.cards[0].tolist() == [0, 1]  # the beach card is not among the N = 2 candidates
    assert agg.cards[0].tolist() == [0, 3]  # N = 4: it is, and BM25 lifts it over card 1
    for op in ("comparison", "sorting"):
        assert rank_cards(hc, [q], Q1, "justmem-lookup", cfg, plans=[Plan(operation=op)]).cards[0].tolist() == [0, 3]


def test_rm3_feedback_adds_terms_from_the_top_cards() -> None:
    texts = ["Caroline said: I went hiking with my dog on the mountain trail", "Caroline said: I baked bread",
             "Caroline said: the mountain trail by the lake is steep", "Caroline said: pottery class was fun"]
    v = np.array([[1.0, 0.0], [0.9, 0.1], [0.0, 1.0], [0.8, 0.2]], np.float32)  # card 2 is far in dense space
    hc = HistoryCards(session_pos=np.arange(4), texts=texts, vectors=v, n_sessions=4)
    q = "Where did Caroline go hiking with her dog?"
    own = {"where", "did", "caroline", "go", "hiking", "her", "dog"}
    # the top card's content words that the question lacks; "caroline" and "said" are on every card (weight 0)
    assert feedback_terms(hc, [0], own, 4) == ["went", "mountain", "trail"]
    assert feedback_terms(hc, [0], own, 2) == ["went", "mountain"]
    assert feedback_terms(hc, [0], own, 0) == [] and feedback_terms(hc, [], own, 3) == []
    # Compose feeds them back: the trail card, outside the dense candidates, joins and is read
    cfg = JustMemConfig(candidates=3, top_k=3, prf_cards=1, prf_terms=4, rewrites=0)
    plan = Plan(entities=["Caroline"], operation="lookup", d=True)
    look = rank_cards(hc, [q], Q1, "justmem-lookup", cfg, plans=[plan])
    comp = rank_cards(hc, [q], Q1, "justmem-compose", cfg, plans=[plan], rewrite_vecs=[None])
    assert look.cards[0].tolist() == [0, 1, 3] and comp.cards[0].tolist() == [0, 1, 2]
    off = rank_cards(hc, [q], Q1, "justmem-compose", cfg.model_copy(update={"prf_cards": 0}), plans=[plan],
                     rewrite_vecs=[None])
    assert off.cards[0].tolist() == [0, 1, 3]


def test_compose_session_cap_spreads_the_cards_over_sessions() -> None:
    # sessions 0, 0, 0, 1, 2 by falling dense similarity; with a cap of 2, session 0's third card goes last
    v = np.array([[1.0, 0.0], [0.95, 0.05], [0.9, 0.1], [0.8, 0.2], [0.7, 0.3]], np.float32)
    hc = HistoryCards(session_pos=np.array([0, 0, 0, 1, 2]), texts=["a b"] * 5, vectors=v, n_sessions=3)
    cfg = JustMemConfig(candidates=5, top_k=4, reranker="dense", session_cap=2)
    plan = Plan(operation="aggregation", d=True)
    comp = rank_cards(hc, ["q"], Q1, "justmem-compose", cfg, plans=[plan], rewrite_vecs=[None])
    assert comp.cards[0].tolist() == [0, 1, 3, 4]
    look = rank_cards(hc, ["q"], Q1, "justmem-lookup", cfg, plans=[plan])  # Lookup keeps the plain order
    assert look.cards[0].tolist() == [0, 1, 2, 3]
    off = rank_cards(hc, ["q"], Q1, "justmem-compose", cfg.model_copy(update={"session_cap": 0}), plans=[plan],
                     rewrite_vecs=[None])
    assert off.cards[0].tolist() == [0, 1, 2, 3]
