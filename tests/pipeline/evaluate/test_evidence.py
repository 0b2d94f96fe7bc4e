"""Evidence recall of the reader's context: hand-computed contexts of a session reader (MemGAS) and of
a card reader (Lookup, Replay), built by the readers' own functions, and the kernel against scikit-learn."""

from __future__ import annotations

import random

import numpy as np
import pytest

from memgas.pipeline.evaluate.evidence import (
    aggregate_evidence,
    evidence_all,
    evidence_hits,
    evidence_recall,
    score_evidence,
)
from memgas.pipeline.justmem.text import Turn
from memgas.pipeline.justmem.read import ReadCard, fit_cards, reading_prompt
from memgas.pipeline.read import build_context, context_turn_keys


class Chars:
    """A token counter of one token per character: every budget below is computed by hand."""

    context_tokens = 10**6

    @staticmethod
    def count_tokens(text: str) -> int:
        return len(text)


# Session s1: "[A]: hi" (7) + "\n" + "[B]: yo you" (11) = 19 characters; its block is "\n### Session Date: d1\n"
# (22) + "Session Content:\n" (17) + text (19) + "\n" = 59. Session s2: "[A]: x" (6); block 39 + 6 + 1 = 46.
SESSIONS = [{"session_id": "s1", "date": "d1", "text": "[A]: hi\n[B]: yo you"},
            {"session_id": "s2", "date": "d2", "text": "[A]: x"}]
LENGTHS = [[7, 11], [6]]


def _session_context(budget: int) -> tuple[list[str], int, bool]:
    text, kept, cut = build_context(Chars(), SESSIONS, top_k=2, budget=budget, multigran=False)
    return [f"{s}:{t}" for s, t in context_turn_keys(SESSIONS, text, kept, LENGTHS)], len(text), cut


def test_session_reader_context_by_hand() -> None:
    # 1000: both blocks (59 + 46 = 105), every turn
    assert _session_context(1000) == (["s1:0", "s1:1", "s2:0"], 105, False)
    # 70: s2 dropped, s1 whole (59)
    assert _session_context(70) == (["s1:0", "s1:1"], 59, True)
    # 50: s1 alone cut at its head to int(59 * 50 / 59 * 0.95) = 47 characters: turn 0 ends at 39 + 7 = 46
    # (kept), turn 1 at 46 + 1 + 11 = 58 (gone)
    assert _session_context(50) == (["s1:0"], 47, True)
    # 30: cut inside the header: no turn
    assert _session_context(30)[0] == []


def test_session_turns_must_render_to_the_session_text() -> None:
    text, kept, _ = build_context(Chars(), SESSIONS, top_k=2, budget=1000, multigran=False)
    with pytest.raises(ValueError, match="session 's1': its turns do not render to its text"):
        context_turn_keys(SESSIONS, text, kept, [[7, 12], [6]])


H1, H2 = "h1", "h2"
TURNS = {H1: [Turn(0, "A", "hi"), Turn(1, "B", "ok?")],
         H2: [Turn(0, "A", "x"), Turn(1, "B", "yo"), Turn(2, "A", "ok")]}
# card lines "[k] (dN) A said hi": 18 characters each; three lines joined: 56
CARDS = [ReadCard("A said hi", H1, 0, 0, date_raw="d1"), ReadCard("B said yo", H2, 1, 2, date_raw="d2"),
         ReadCard("A said ok", H1, 1, 1, date_raw="d1")]


def _query(profile: str) -> dict:
    return {"query_id": "q", "question": "what?", "question_date": None, "operation": "lookup", "profile": profile,
            "cards": list(CARDS), "turns": TURNS}


def test_card_reader_context_with_replay_by_hand() -> None:
    # Replay's turns in card order: (h1,0) "### Session date: d1\n[0] A: hi" = 30; + (h2,1) "\n\n### Session date:
    # d2\n[1] B: yo" = 62; + (h2,2) "\n[2] A: ok" = 72 > 70: cut there
    fit = fit_cards(_query("replay"), len, 10**6, 70)
    assert not fit.cut and fit.cards == CARDS
    assert fit.turn_keys() == [(H1, 0), (H2, 1), (H2, 2), (H1, 1)]
    assert fit.verbatim_keys() == [(H1, 0), (H2, 1)]
    assert fit.replay is not None and fit.replay.cut and fit.replay.tokens == 62
    assert fit.context_tokens(len) == 56 + 62


def test_card_reader_drops_the_lowest_cards_to_fit_the_window() -> None:
    two = reading_prompt("what?", None, "lookup", CARDS[:2], len)[1]
    fit = fit_cards(_query("lookup"), len, two, 1)
    assert fit.cut and fit.cards == CARDS[:2] and fit.tokens == two
    assert fit.turn_keys() == [(H1, 0), (H2, 1), (H2, 2)] and fit.verbatim_keys() == []
    assert fit.context_tokens(len) == 18 + 1 + 18


def test_scores_of_the_hand_contexts() -> None:
    s_keys, s_tokens, _ = _session_context(50)  # ["s1:0"], 47
    fit = fit_cards(_query("replay"), len, 10**6, 70)
    sid = {H1: "s1", H2: "s2"}
    c_keys = [f"{sid[h]}:{t}" for h, t in fit.turn_keys()]
    v_keys = [f"{sid[h]}:{t}" for h, t in fit.verbatim_keys()]
    records = [
        {"query_id": "a", "question_type": "x", "is_abstention": False, "evidence_ids": ["s1:1", "s1:0"],
         "context_ids": s_keys, "verbatim_ids": s_keys, "context_tokens": s_tokens},
        {"query_id": "b", "question_type": "y", "is_abstention": False, "evidence_ids": ["s1:0", "s2:2", "s2:0"],
         "context_ids": c_keys, "verbatim_ids": v_keys, "context_tokens": fit.context_tokens(len)},
        {"query_id": "c", "question_type": "y", "is_abstention": True, "evidence_ids": ["s1:0"],
         "context_ids": [], "verbatim_ids": [], "context_tokens": 5},
        {"query_id": "d", "question_type": "y", "is_abstention": False, "evidence_ids": [],
         "context_ids": [], "verbatim_ids": [], "context_tokens": 5},
    ]
    per_q, skipped = score_evidence(records)
    assert skipped == {"abstention": 1, "no_evidence": 1}
    assert per_q["query_id"].tolist() == ["a", "b"]
    assert per_q["evidence_recall"].tolist() == [1 / 2, 2 / 3]
    assert per_q["evidence_all"].tolist() == [0.0, 0.0]
    assert per_q["evidence_verbatim"].tolist() == [1 / 2, 1 / 3]
    assert per_q["context_tokens"].tolist() == [47, 118]
    agg = aggregate_evidence(per_q)
    assert agg.loc["overall", "n"] == 2 and agg.loc["overall", "evidence_recall"] == (1 / 2 + 2 / 3) / 2
    assert agg.loc["overall", "context_tokens"] == (47 + 118) / 2
    assert agg.loc["y", "evidence_verbatim"] == 1 / 3


def test_kernel_against_sklearn_samples_recall() -> None:
    from sklearn.metrics import recall_score
    from sklearn.preprocessing import MultiLabelBinarizer

    rng = random.Random(7)
    ids = [f"s{i}:{j}" for i in range(5) for j in range(4)]
    evidence = [rng.sample(ids, rng.randint(1, 5)) for _ in range(200)]
    context = [rng.sample(ids, rng.randint(0, 12)) for _ in range(200)]
    hits, n = evidence_hits(context, evidence)
    mlb = MultiLabelBinarizer(classes=ids)
    y_true, y_pred = mlb.fit_transform(evidence), mlb.transform(context)
    want = recall_score(y_true, y_pred, average="samples", zero_division=0)
    assert np.isclose(evidence_recall(hits, n).mean(), want, rtol=0, atol=1e-12)
    assert (evidence_all(hits, n) == np.array([set(e) <= set(c) for e, c in zip(evidence, context)])).all()
    assert np.isnan(evidence_recall(np.array([0]), np.array([0]))).all()
