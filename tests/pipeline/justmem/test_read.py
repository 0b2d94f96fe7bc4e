"""JustMem provenance and reading: every card of the LoCoMo sample points at real turns that hold its text,
Replay recovers exactly the chosen cards' turns (within the budget), and the reading prompt's content."""

from __future__ import annotations

import re
from datetime import datetime

import pytest

from memgas.pipeline.accounting import TokenLedger

from memgas.pipeline.config import JustMemConfig
from memgas.pipeline.justmem.extract import LLM_FREE_EXTRACTOR, extract_cards, turns_by_session
from memgas.pipeline.justmem.read import ReadCard, reading_prompt, recover_turns
from memgas.pipeline.prompts import JUSTMEM_OPERATION_GUIDE


def _words(s: str) -> str:
    return " ".join(s.split())


@pytest.fixture(scope="module")
def sample(locomo_bank):
    turns = turns_by_session(locomo_bank.read("turns"))
    cards = extract_cards([(h, turns[h], "locomo") for h in sorted(turns)], JustMemConfig(), key=LLM_FREE_EXTRACTOR)
    return turns, cards.to_pylist()


def test_every_card_points_at_real_turns_that_hold_it(sample) -> None:
    turns, cards = sample
    spans = 0
    for c in cards:
        idx = {t.turn_index: t for t in turns[c["session_hash"]]}
        assert c["turn_start"] in idx and c["turn_end"] in idx and c["turn_start"] <= c["turn_end"]
        source = [idx[i] for i in range(c["turn_start"], c["turn_end"] + 1)]
        text = c["text"]
        m = re.fullmatch(r"(.+?) said: (.*?)(?: \[\1 shared an image: (.*)\])?", text, re.DOTALL)
        image = re.fullmatch(r"\[(.+?) shared an image: (.*)\]", text, re.DOTALL)
        if image:  # a turn whose only content is a shared image
            assert len(source) == 1 and image.group(1) == source[0].role
            assert _words(image.group(2)) in _words(source[0].content)
        elif m:  # a statement of one turn: the speaker is that turn's, the sentence and caption are in it
            assert len(source) == 1 and m.group(1) == source[0].role
            assert _words(m.group(2)) in _words(source[0].content)
            if m.group(3):
                assert _words(m.group(3)) in _words(source[0].content)
        else:  # a question and its short answer, across two turns
            m = re.fullmatch(r"(.+?) asked: (.*) (.+?) answered: (.*)", text, re.DOTALL)
            assert m and len(source) == 2, text
            assert (m.group(1), m.group(3)) == (source[0].role, source[1].role)
            assert _words(m.group(2)) in _words(source[0].content) and _words(m.group(4)) == _words(source[1].content)
            spans += 1
    assert spans, "no two-turn card in the sample: the span branch checked nothing"


def test_replay_recovers_exactly_the_cards_turns(sample) -> None:
    turns, cards = sample
    chosen = cards[5:9] + cards[300:303] + cards[5:6]  # two sessions, one card twice
    rc = [ReadCard(c["text"], c["session_hash"], c["turn_start"], c["turn_end"]) for c in chosen]
    want = list(dict.fromkeys((c["session_hash"], i) for c in chosen
                              for i in range(c["turn_start"], c["turn_end"] + 1)))
    count = lambda s: len(s.split())  # noqa: E731 - a whitespace tokenizer is enough to test the budget
    full = recover_turns(rc, turns, 10**6, count)
    assert full.turns == want and not full.cut and full.tokens == count(full.text)
    by_index = {(h, t.turn_index): t for h, ts in turns.items() for t in ts}
    for k in want:
        assert f"[{k[1]}] {by_index[k].role}: {by_index[k].content}" in full.text
    assert len({h for h, _ in want}) == 2 and full.text.count("### Session date:") == 2
    # a budget below the whole: a prefix of the same turns, within the budget, and the cut reported
    part = recover_turns(rc, turns, full.tokens - 1, count)
    assert part.cut and part.turns == want[: len(part.turns)] and len(part.turns) < len(want)
    assert part.tokens <= full.tokens - 1
    with pytest.raises(KeyError, match="has no turn 999"):
        recover_turns([ReadCard("x", chosen[0]["session_hash"], 999, 999)], turns, 100, count)


def test_reading_prompt_holds_cards_dates_operation_and_replay(sample) -> None:
    turns, cards = sample
    c = next(c for c in cards if c["time"] == "yesterday")
    rc = [ReadCard(c["text"], c["session_hash"], c["turn_start"], c["turn_end"], datetime(2023, 5, 8), c["time"])]
    count = lambda s: len(s.split())  # noqa: E731
    prompt, n, rec = reading_prompt("When?", "1 June 2023", "temporal_selection", rc, count)
    text = prompt[0]["content"]
    assert rec is None and n == count(text) and "Source turns:" not in text
    assert f"[1] (8 May 2023; event time: 7 May 2023) {c['text']}" in text
    assert JUSTMEM_OPERATION_GUIDE["temporal_selection"] in text and "Question Date: 1 June 2023" in text
    prompt, n, rec = reading_prompt("When?", None, "lookup", rc, count, replay=True, turns=turns, replay_tokens=500)
    text = prompt[0]["content"]
    assert rec is not None and rec.turns == [(c["session_hash"], i) for i in range(c["turn_start"], c["turn_end"] + 1)]
    assert "Source turns:\n### Session date: 8 May 2023" in text and rec.text in text and n == count(text)


class _Faulty:
    """The real LLM, except that a prompt holding ``marker`` gets a backend error (a timeout after retries)."""

    def __init__(self, llm, marker: str) -> None:
        self.llm, self.marker = llm, marker
        self.name, self.context_tokens = llm.name, llm.context_tokens
        self.prompts: list[str] = []

    def count_tokens(self, text: str) -> int:
        return self.llm.count_tokens(text)

    def generate(self, prompts, params):
        from memgas.pipeline.models.base import GenerationResult

        self.prompts += [p[-1]["content"] for p in prompts]
        keep = [i for i, p in enumerate(prompts) if self.marker not in p[-1]["content"]]
        real = dict(zip(keep, self.llm.generate([prompts[i] for i in keep], params))) if keep else {}
        return [real.get(i) or GenerationResult(error="timeout") for i in range(len(prompts))]


@pytest.mark.slow
def test_answers_from_cards_within_the_budget_with_replay_and_a_failure(sample, smollm) -> None:
    from memgas.pipeline.config import ReadingConfig
    from memgas.pipeline.justmem.read import read_and_answer_cards
    from memgas.pipeline.schema import ANSWERS

    turns, cards = sample
    rc = [ReadCard(c["text"], c["session_hash"], c["turn_start"], c["turn_end"], datetime(2023, 5, 8), c["time"])
          for c in cards[:40]]
    base = {"question_date": "1 June 2023", "operation": "lookup", "session_ids": ["s1", "s2", "s3"]}
    queries = [
        {**base, "query_id": "many", "question": "What did Caroline do?", "profile": "lookup", "cards": rc},
        {**base, "query_id": "replay", "question": "What did they talk about?", "profile": "replay", "cards": rc[:2],
         "turns": turns},
        {**base, "query_id": "fails", "question": "Q-error?", "profile": "compose", "cards": rc[:1]},
    ]
    llm = _Faulty(smollm, "Q-error?")
    reading = ReadingConfig(top_k=2, context_tokens=500, max_new_tokens=8)
    ledger = TokenLedger()
    t = read_and_answer_cards(queries, llm, reading, 150, "justmem", ledger=ledger)
    assert t.schema == ANSWERS and t.column("query_id").to_pylist() == ["many", "replay", "fails"]
    assert len(llm.prompts) == 3  # one batch
    rows = {r["query_id"]: r for r in t.to_pylist()}
    for r, p in zip(t.to_pylist(), llm.prompts):
        assert r["filtered_context"] == p and smollm.count_tokens(p) + 8 <= 500
        assert r["retrieved_session_ids"] == ["s1", "s2"] and r["method"] == "justmem"
    # 40 cards do not fit 500 tokens: the lowest-ranked go first, the top card stays
    kept = len(re.findall(r"^\[\d+\] \(", rows["many"]["filtered_context"], re.M))
    assert 0 < kept < 40 and f"context cut to {kept} card(s)" in rows["many"]["error"]
    assert "[1] (8 May 2023" in rows["many"]["filtered_context"] and rc[0].text in rows["many"]["filtered_context"]
    assert "Source turns:" in rows["replay"]["filtered_context"] and "Source turns:" not in rows["many"]["filtered_context"]
    assert rows["replay"]["hypothesis"] is not None and rows["replay"]["prompt_tokens"] > 0
    assert rows["fails"]["hypothesis"] == "" and "answer failed: timeout" in rows["fails"]["error"]
    assert ledger.stages["reading-answer"].counters["context_cut"] == 1
