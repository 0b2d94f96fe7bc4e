"""Compact LLM-free cards: one hand-made session per rule, and exact provenance of every card
on both bundled samples (the real loader's turns)."""

from __future__ import annotations

from pathlib import Path

import pytest

from memgas.pipeline.justmem.extract import LLM_FREE_EXTRACTOR, extract_llm_free, turns_by_session
from memgas.pipeline.justmem.llm_cards import grounding
from memgas.pipeline.justmem.text import Card, Turn

REPO = Path(__file__).resolve().parents[3]
LME_SAMPLE = REPO / "data" / "sample" / "longmemeval_s_sample3.json"


def test_the_compact_method_has_its_own_key() -> None:
    assert LLM_FREE_EXTRACTOR == "llm-free/justmem-cards-v3"


def test_greetings_and_filler_are_dropped() -> None:
    turns = [Turn(0, "Caroline", "Hey Mel! Good to see you! How have you been?"),
             Turn(1, "Melanie", "Hi Caroline! Thanks so much, that's so sweet! I adopted a puppy named Max last week."),
             Turn(2, "Caroline", "Aww, congrats!")]
    assert extract_llm_free(turns) == [
        Card("Melanie said: I adopted a puppy named Max last week.", "event", "last week", 1, 1)]


def test_sentences_of_a_turn_about_one_subject_are_merged() -> None:
    # the second sentence continues the first (opens with "They"), the third is another subject
    turns = [Turn(0, "Melanie", "I started pottery classes in May. They meet every Tuesday at the community "
                                "center. My brother Tom lives in Denver.")]
    assert extract_llm_free(turns) == [
        Card("Melanie said: I started pottery classes in May. They meet every Tuesday at the community center.",
             "event", "may", 0, 0),
        Card("Melanie said: My brother Tom lives in Denver.", "fact", None, 0, 0),
    ]


def test_near_identical_statements_of_a_session_are_kept_once() -> None:
    turns = [Turn(0, "user", "I adopted a dog named Max last week and he loves the park."),
             Turn(1, "assistant", "That is wonderful news about Max."),
             Turn(2, "user", "I adopted a dog named Max last week!"),
             Turn(3, "user", "I adopted a dog named Max.")]
    cards = extract_llm_free(turns)
    # turns 2 and 3 say nothing turn 0 did not (their content words are a subset of its card's): dropped,
    # so the statement keeps the provenance of its first occurrence
    assert [c for c in cards if c.turn_start != 1] == [
        Card("The user said: I adopted a dog named Max last week and he loves the park.", "preference",
             "last week", 0, 0)]


def test_code_and_list_blocks_of_a_user_are_kept_whole() -> None:
    turns = [Turn(0, "user", "Here is my packing list:\n- hiking boots\n- rain jacket\n- water filter\n"
                             "And my script:\n```python\nfor x in range(3):\n    print(x)\n```")]
    assert extract_llm_free(turns) == [
        Card("The user wrote: Here is my packing list:\n- hiking boots\n- rain jacket\n- water filter",
             "interaction", None, 0, 0),
        Card("The user wrote: ```python\nfor x in range(3):\n    print(x)\n```", "interaction", None, 0, 0),
    ]


def test_a_users_requests_to_an_assistant_are_kept() -> None:
    # a question to an assistant states what the user needs (the session's subject); between people a
    # question asks for memory and is dropped
    turns = [Turn(0, "user", "Can you suggest kid-friendly hiking trails in the Rocky Mountains? My kids love "
                             "animals.")]
    assert extract_llm_free(turns) == [
        Card("The user said: Can you suggest kid-friendly hiking trails in the Rocky Mountains?", "fact", None,
             0, 0),
        Card("The user said: My kids love animals.", "preference", None, 0, 0),
    ]


LONG_REPLY = (
    "Congratulations on your win! Rich Strike's upset victory was indeed an exciting moment in horse racing "
    "history.\n\nNow, let's get to your party decorations! Here are some ideas:\n\n"
    "1. **Sports Stadium Backdrop**: Create a large backdrop that resembles a stadium, complete with a "
    "scoreboard, bleachers, and a grassy field. This will set the tone for a fun party.\n"
    "2. **Sport-Specific Stations**: Divide the party area into different stations, each dedicated to a "
    "specific sport, with a basketball hoop and a baseball throwing area.\n"
    "3. Jockey Photo Booth - props like jockey helmets and horseshoes for photos.\n\n"
    "I hope these ideas help you throw a winning party! Let me know if you need anything else."
)


def test_a_long_assistant_reply_becomes_one_short_card() -> None:
    turns = [Turn(0, "user", "I won $20 when Rich Strike took the win at the Kentucky Derby."),
             Turn(1, "assistant", LONG_REPLY)]
    cards = extract_llm_free(turns)
    assert cards[0] == Card("The user said: I won $20 when Rich Strike took the win at the Kentucky Derby.",
                            "event", None, 0, 0)
    # the reply's first statement ("Congratulations on your win!" is filler) and the heads of its list items;
    # the items' generic text and the closing courtesy are dropped
    assert cards[1:] == [Card(
        "The assistant said: Rich Strike's upset victory was indeed an exciting moment in horse racing history. "
        "Sports Stadium Backdrop; Sport-Specific Stations; Jockey Photo Booth",
        "interaction", None, 1, 1)]


@pytest.mark.parametrize("sample", ["locomo", "longmemeval"])
def test_compact_cards_keep_exact_provenance_on_the_bundled_samples(sample, locomo_bank, tmp_path) -> None:
    """Every card's span is turns of its own session, and every content word of the card occurs in them."""
    from memgas.pipeline.bank import Bank
    from memgas.pipeline.ingest import ingest

    if sample == "locomo":
        bank = locomo_bank
    else:
        ingest(LME_SAMPLE, "longmemeval", tmp_path / "bank", progress=False)
        bank = Bank(tmp_path / "bank")
    turns = turns_by_session(bank.read("turns"))
    n = 0
    for ts in turns.values():
        indices = {t.turn_index for t in ts}
        for c in extract_llm_free(ts):
            assert c.turn_start <= c.turn_end and {c.turn_start, c.turn_end} <= indices, c
            hit, total = grounding(c.text, [t for t in ts if c.turn_start <= t.turn_index <= c.turn_end])
            assert total > 0 and hit == total, c
            n += 1
    assert n > 100


def test_an_assistant_card_starts_with_the_replys_first_statement_even_in_a_list_intro() -> None:
    # the intro line belongs to the list block (no blank line between them), the closing advice is prose
    reply = ("Here are some kid-friendly hiking trails in the Rocky Mountains:\n1. Bear Lake Trail - Rocky "
             "Mountain National Park\n2. Emerald Lake Trail - Rocky Mountain National Park\n\nRemember to give "
             "wildlife plenty of space and never approach them.")
    assert extract_llm_free([Turn(0, "assistant", reply)]) == [Card(
        "The assistant said: Here are some kid-friendly hiking trails in the Rocky Mountains: Bear Lake Trail; "
        "Emerald Lake Trail", "interaction", None, 0, 0)]


def test_only_directly_following_sentences_are_merged() -> None:
    # "Wow!" is dropped between the two: joining them would make a card that is no passage of the turn
    turns = [Turn(0, "Melanie", "I went hiking at Mount Rainier. Wow! It was a long climb to the top.")]
    assert extract_llm_free(turns) == [
        Card("Melanie said: I went hiking at Mount Rainier.", "event", None, 0, 0),
        Card("Melanie said: It was a long climb to the top.", "fact", None, 0, 0),
    ]


def test_a_nul_placeholder_lookalike_in_the_text_is_text() -> None:
    # code blocks hold their place with a NUL-delimited number; the same characters in a turn are not a block
    turns = [Turn(0, "user", "My locker code is \x007\x00 at the gym downtown.\n\x003\x00\n```\nx = 1\n```")]
    assert [c.text for c in extract_llm_free(turns)] == [
        "The user said: My locker code is \x007\x00 at the gym downtown.", "The user wrote: ```\nx = 1\n```"]
