"""What an LLM card must be beyond its schema: every clause grounded in the turns it cites (a faithful card plus
" Also the password is hunter2." once passed, as half its words were the turn's), no sentence repeated, not cut
off at its length limit. Failing cards are dropped, named in the session's note and counted; the LLM-free cards
of both bundled samples pass every check."""

from __future__ import annotations

import json

import pytest

from memgas.pipeline.accounting import TokenLedger
from memgas.pipeline.config import JustMemConfig
from memgas.pipeline.data import locomo, longmemeval
from memgas.pipeline.data.common import Warnings
from memgas.pipeline.justmem.extract import dropped_cards, extract_cards, extract_llm_free
from memgas.pipeline.justmem.llm_cards import (
    LLM_CARD_TEXT_CHARS,
    card_problem,
    clauses,
    grounding,
    validate_cards,
)
from memgas.pipeline.justmem.structured import InvalidOutput
from memgas.pipeline.justmem.text import Card, Turn

from .conftest import FakeLLM, REPO

TURNS = [Turn(0, "Caroline", "I went to the LGBTQ support group yesterday and the stories were so inspiring."),
         Turn(1, "Melanie", "I prefer cats, honestly.")]
FAITHFUL = "Caroline said: I went to the LGBTQ support group yesterday and the stories were so inspiring."


def _card(text: str, start: int = 0, end: int = 0) -> dict:
    return {"turn_start": start, "turn_end": end, "text": text, "type": "event", "time": ""}


def _problem(text: str) -> str:
    with pytest.raises(InvalidOutput) as e:
        validate_cards({"cards": [_card(text)]}, TURNS, LLM_CARD_TEXT_CHARS)
    return str(e.value)


@pytest.mark.parametrize("added, clause, of, hit, words", [
    (" Also the password is hunter2.", 2, 2, 0, 2),
    (", and the password is hunter2.", 2, 2, 0, 2),
    ("; my bank PIN is 4242", 2, 2, 0, 3),
    (" (password hunter2)", 2, 2, 0, 2),
    ("\nPIN: 4242", 2, 2, 0, 2),
    (" — my bank PIN is 4242.", 2, 2, 0, 3),
])
def test_a_card_that_adds_a_statement_to_its_turn_is_invalid(added, clause, of, hit, words) -> None:
    text = FAITHFUL.removesuffix(".") + added if added[0] in ",;(" or added.startswith(" —") else FAITHFUL + added
    # the whole card passes the share (most of its words are the turn's): the clause it adds does not
    h, total = grounding(text, TURNS[:1])
    assert h >= total / 2
    assert _problem(text) == (f"cards[0].text is not grounded in turns 0..0: its clause {clause} of {of} has {hit} of "
                              f"its {words} content words there (at least 50% must)")


def test_repeated_and_cut_off_cards_are_invalid() -> None:
    sentence = "Caroline went to the LGBTQ support group yesterday. "
    # what SmolLM2 wrote at extract_max_tokens=160: one sentence three times and a fourth cut at the length limit
    looped = (sentence * 4)[:LLM_CARD_TEXT_CHARS]
    assert _problem(looped) == ("cards[0].text repeats a sentence (sentence 2 of 4 is sentence 1 again); a card "
                                "states a fact once")
    cut = ("Caroline went to the LGBTQ support group yesterday and the stories were so inspiring and so " * 3)
    cut = cut[:LLM_CARD_TEXT_CHARS]
    assert _problem(cut) == (f"cards[0].text ends mid-sentence at its {LLM_CARD_TEXT_CHARS}-character limit; a card "
                             "is a whole statement")
    # a card as long as its limit that ends a sentence is whole; without the schema's limit nothing is cut off
    whole = cut[:LLM_CARD_TEXT_CHARS - 1] + "."
    assert validate_cards({"cards": [_card(whole)]}, TURNS, LLM_CARD_TEXT_CHARS)[0].text == whole
    assert validate_cards({"cards": [_card(cut)]}, TURNS)[0].text == cut


def test_the_extractor_drops_and_counts_each_kind_of_invalid_card() -> None:
    looped = ("Caroline went to the LGBTQ support group yesterday. " * 4)[:LLM_CARD_TEXT_CHARS]
    reply = {"cards": [_card(FAITHFUL), _card(FAITHFUL + " Also the password is hunter2."), _card(looped),
                       _card("Melanie prefers cats.", 1, 1)]}
    llm = FakeLLM(lambda p, n: json.dumps(reply))
    ledger = TokenLedger()
    t = extract_cards([("h1", TURNS, "locomo")], JustMemConfig(extractor="llm"), key="k", llm=llm, ledger=ledger)
    rows = t.to_pylist()
    assert len(llm.calls) == 1  # the reply is usable: its good cards are kept
    assert [Card(r["text"], r["type"], r["time"], r["turn_start"], r["turn_end"]) for r in rows] == [
        Card(FAITHFUL, "event", None, 0, 0), Card("Melanie prefers cats.", "event", None, 1, 1)]
    assert {r["error"] for r in rows} == {
        "dropped 2 of 4 cards: cards[1].text is not grounded in turns 0..0: its clause 2 of 2 has 0 of its 2 content "
        "words there (at least 50% must); cards[2].text repeats a sentence (sentence 2 of 4 is sentence 1 again); a "
        "card states a fact once"}
    counters = ledger.stages["justmem-cards"].counters
    assert (counters["dropped-ungrounded"], counters["dropped-repeated"]) == (1, 1)
    assert dropped_cards(t) == 2
    # a reply whose only card is invalid is an invalid reply: one repair, then the LLM-free cards, and why
    llm = FakeLLM(lambda p, n: json.dumps({"cards": [_card(looped)]}))
    rows = extract_cards([("h1", TURNS, "locomo")], JustMemConfig(extractor="llm"), key="k", llm=llm).to_pylist()
    assert len(llm.calls) == 2 and "repeats a sentence" in rows[0]["fallback"]
    assert [r["text"] for r in rows] == [c.text for c in extract_llm_free(TURNS)]


def test_every_llm_free_card_of_both_samples_passes_every_check() -> None:
    """The LLM-free cards are cut from their turns' words: every clause is 100% grounded, none repeats."""
    n = 0
    for mod, name in ((locomo, "locomo_sample.json"), (longmemeval, "longmemeval_s_sample3.json")):
        path = REPO / "data" / "sample" / name
        done: set[str] = set()
        for rec in mod.load(path, Warnings(str(path))):
            turns: dict[str, list[Turn]] = {}
            for t in rec.turns:
                turns.setdefault(t["session_hash"], []).append(Turn(t["turn_index"], t["role"], t["content"]))
            for h, ts in turns.items():
                if h in done:
                    continue
                done.add(h)
                ts.sort(key=lambda u: u.turn_index)
                for c in extract_llm_free(ts):
                    cited = [u for u in ts if c.turn_start <= u.turn_index <= c.turn_end]
                    assert card_problem("c", c.text, (c.turn_start, c.turn_end), ts) is None, c
                    assert all(grounding(part, cited)[0] == grounding(part, cited)[1] for part in clauses(c.text)), c
                    n += 1
    assert n > 3000
