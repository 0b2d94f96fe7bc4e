"""JustMem cards: the LLM-free rules, the cards schema and keys, and the LLM extractor's schema, repair and
fallback (fake backend: malformed JSON on demand)."""

from __future__ import annotations

import json
from datetime import datetime

import pyarrow as pa
import pytest

from memgas.pipeline.accounting import TokenLedger
from memgas.pipeline.config import JustMemConfig
from memgas.pipeline.hashing import text_hash
from memgas.pipeline.data.locomo import CAPTION_SEP
from memgas.pipeline.justmem import structured
from memgas.pipeline.justmem.extract import (
    LLM_FREE_EXTRACTOR,
    LLM_EXTRACTOR_VERSION,
    card_id,
    extract_cards,
    extract_llm_free,
    extractor_key,
    turns_by_session,
)
from memgas.pipeline.justmem.llm_cards import (
    MAX_CARDS_PER_SESSION,
    MIN_GROUNDED_SHARE,
    LLM_CARD_TEXT_CHARS,
    LLM_CARD_TIME_CHARS,
    CardBudget,
    card_budget,
    cards_json_schema,
    grounding,
    session_cards_schema,
    validate_cards,
)
from memgas.pipeline.justmem.structured import InvalidOutput
from memgas.pipeline.justmem.text import CARD_TEXT_LIMIT, Card, Turn
from memgas.pipeline.justmem.times import resolve_time
from memgas.pipeline.models.base import GenerationResult
from memgas.pipeline.schema import CARD_TYPES, CARDS, KEYS, TABLES

from .conftest import FakeLLM

TURNS = [
    Turn(0, "Caroline", "Hey Mel! Good to see you! I went to a LGBTQ support group yesterday and it was so powerful."),
    Turn(1, "Melanie", "Wow! Did you like the talks?"),
    Turn(2, "Caroline", "Yes, I did!"),
    Turn(3, "Melanie", "I love painting sunsets. Dr. Lee taught me last summer.\n The image Caption: a photo of a lake"),
    Turn(4, "user", "Here is my plan:\n- buy flour\n- bake bread\nThanks!"),
    Turn(5, "assistant", "Use this:\n```python\nprint(1)\n```\nIt prints one number."),
]


def test_llm_free_rules_exact() -> None:
    assert extract_llm_free(TURNS) == [
        # greeting sentences dropped; speaker explicit; "yesterday" is the card's time and makes it an event
        Card("Caroline said: I went to a LGBTQ support group yesterday and it was so powerful.", "event",
             "yesterday", 0, 0),
        # a reply with no content of its own carries the question it answers, spanning both turns
        Card("Melanie asked: Did you like the talks? Caroline answered: Yes, I did!", "preference", None, 1, 2),
        Card("Melanie said: I love painting sunsets.", "preference", None, 3, 3),
        # "Dr." does not end a sentence; the shared image goes on the turn's last card
        Card("Melanie said: Dr. Lee taught me last summer. [Melanie shared an image: a photo of a lake]", "event",
             "last summer", 3, 3),
        # a list is kept whole with the line that introduces it, as an interaction card
        Card("The user wrote: Here is my plan:\n- buy flour\n- bake bread", "interaction", None, 4, 4),
        # assistant turns are interactions; a code block is kept whole
        Card("The assistant said: It prints one number.", "interaction", None, 5, 5),
        Card("The assistant wrote: ```python\nprint(1)\n```", "interaction", None, 5, 5),
    ]


def test_llm_free_keeps_one_card_for_a_session_of_fillers() -> None:
    turns = [Turn(0, "A", "Hi!"), Turn(1, "B", "Hey there, hello!"), Turn(2, "A", "Bye!")]
    assert extract_llm_free(turns) == [Card("B said: Hey there, hello!", "fact", None, 1, 1)]
    assert extract_llm_free([]) == []


@pytest.mark.parametrize("time, want", [
    (None, None),
    ("yesterday", "7 May 2023"),
    ("last week", "the week before 8 May 2023"),
    ("last year", "2022"),
    ("two days ago", "6 May 2023"),
    ("3 years ago", "2020"),
    ("next month", "the month after 8 May 2023"),
    ("recently", "recently (said on 8 May 2023)"),
])
def test_resolve_time_against_the_session_date(time, want) -> None:
    assert resolve_time(time, datetime(2023, 5, 8, 13, 56)) == want


def test_cards_table_schema_and_content_keys(locomo_bank) -> None:
    assert TABLES["cards"] is CARDS and KEYS["cards"] == ("card_id",)
    turns = turns_by_session(locomo_bank.read("turns"))
    sessions = [(h, turns[h], "locomo") for h in sorted(turns)]
    cfg = JustMemConfig()
    key = extractor_key(cfg)
    assert key == LLM_FREE_EXTRACTOR
    t = extract_cards(sessions, cfg, key=key)
    assert t.schema == CARDS
    rows = t.to_pylist()
    assert len({r["card_id"] for r in rows}) == len(rows)
    for r in rows:
        assert r["card_id"] == card_id(r["session_hash"], key, r["card_index"])
        assert r["text_hash"] == text_hash(r["text"])
        assert r["type"] in CARD_TYPES and r["fallback"] is None and r["error"] is None
    # every session has cards numbered 0..n-1, and a session shared by two histories is one set of cards
    per = {}
    for r in rows:
        per.setdefault(r["session_hash"], []).append(r["card_index"])
    assert sorted(per) == sorted(turns) and all(v == list(range(len(v))) for v in per.values())
    # keyed by content: the same sessions in another order give the same rows per session
    again = extract_cards(list(reversed(sessions)), cfg, key=key)
    assert sorted(again.to_pylist(), key=lambda r: r["card_id"]) == sorted(rows, key=lambda r: r["card_id"])


# -- LLM extractor (fake backend) --------------------------------------------------------------------------

SHORT = [Turn(0, "Caroline", "I adopted a dog named Max last week."), Turn(1, "Melanie", "I prefer cats, honestly.")]
GOOD = {"cards": [
    {"text": "Caroline adopted a dog named Max.", "type": "event", "time": "last week", "turn_start": 0, "turn_end": 0},
    {"text": "Melanie prefers cats.", "type": "Preference", "time": "", "turn_start": 1, "turn_end": 1},
]}
GOOD_CARDS = [Card("Caroline adopted a dog named Max.", "event", "last week", 0, 0),
              Card("Melanie prefers cats.", "preference", None, 1, 1)]


def _llm_cfg() -> JustMemConfig:
    return JustMemConfig(extractor="llm")


def test_llm_extractor_valid_output_uses_the_schema() -> None:
    llm = FakeLLM(lambda p, n: "```json\n" + json.dumps(GOOD) + "\n```")
    key = extractor_key(_llm_cfg(), llm.name)
    t = extract_cards([("h1", SHORT, "locomo")], _llm_cfg(), key=key, llm=llm)
    assert len(llm.calls) == 1
    prompt, params = llm.calls[0]
    budget = card_budget(llm, SHORT, _llm_cfg().extract_max_tokens)
    assert params.json_schema == session_cards_schema(SHORT, budget)
    assert params.max_tokens == _llm_cfg().extract_max_tokens
    assert "[0] Caroline: I adopted a dog" in prompt[0]["content"] and "[1] Melanie:" in prompt[0]["content"]
    rows = t.to_pylist()
    assert [Card(r["text"], r["type"], r["time"], r["turn_start"], r["turn_end"]) for r in rows] == GOOD_CARDS
    assert [r["fallback"] for r in rows] == [None, None] and [r["error"] for r in rows] == [None, None]
    # the session's tokens are on card 0 only, so the column sums to the cost
    assert rows[0]["prompt_tokens"] == llm.count_tokens(prompt[0]["content"]) and rows[1]["prompt_tokens"] is None
    assert rows[0]["completion_tokens"] == len((llm.reply(prompt, 0)).split())


def test_llm_extractor_repairs_once() -> None:
    bad = json.dumps({"cards": [{**GOOD["cards"][0], "turn_end": 7}]})
    llm = FakeLLM(lambda p, n: bad if n == 0 else json.dumps(GOOD))
    ledger = TokenLedger()
    t = extract_cards([("h1", SHORT, "locomo")], _llm_cfg(), key="k", llm=llm, ledger=ledger)
    assert len(llm.calls) == 2
    repair = llm.calls[1][0]
    # the repair call carries the prompt, the bad reply and the problem
    assert repair[0] == llm.calls[0][0][0] and repair[1] == {"role": "assistant", "content": bad}
    assert "cards[0].turn_end=7 is not a turn number of the dialogue (0..1)" in repair[2]["content"]
    rows = t.to_pylist()
    assert [Card(r["text"], r["type"], r["time"], r["turn_start"], r["turn_end"]) for r in rows] == GOOD_CARDS
    assert rows[0]["fallback"] is None
    assert rows[0]["prompt_tokens"] == sum(llm.count_tokens(c[0][-1]["content"]) for c in llm.calls)
    assert ledger.stages["justmem-cards"].counters == {"repair": 1, "fallback": 0, "sessions": 1}
    assert ledger.stages["justmem-cards-repair"].requests == 1


@pytest.mark.parametrize("first, second, problem", [
    ("not json at all", "{\"cards\": [", "the reply holds no complete JSON object"),
    (json.dumps({"cards": []}), json.dumps({"cards": []}), '"cards" is empty'),
    (json.dumps({"cards": [{**GOOD["cards"][0], "type": "opinion"}]}), json.dumps({"items": []}),
     '"cards" must be a list'),
])
def test_llm_extractor_falls_back_to_llm_free_and_says_why(first, second, problem) -> None:
    llm = FakeLLM(lambda p, n: first if n == 0 else second)
    ledger = TokenLedger()
    t = extract_cards([("h1", SHORT, "locomo"), ("h2", TURNS, "locomo")], _llm_cfg(), key="k", llm=llm,
                      ledger=ledger)
    assert len(llm.calls) == 4  # two sessions, one repair each
    rows = t.to_pylist()
    got = {h: [Card(r["text"], r["type"], r["time"], r["turn_start"], r["turn_end"]) for r in rows
               if r["session_hash"] == h] for h in ("h1", "h2")}
    assert got == {"h1": extract_llm_free(SHORT), "h2": extract_llm_free(TURNS)}
    for r in rows:
        assert r["fallback"].startswith(f"{LLM_FREE_EXTRACTOR} (invalid output after one repair: ")
        assert problem in r["fallback"] and r["error"] is None
    assert ledger.stages["justmem-cards"].counters["fallback"] == 2


def test_llm_extractor_backend_error_stores_nothing_and_is_not_repaired() -> None:
    """A failed call is no answer: no row under the key, so the next run calls it again; the
    other session's cards are kept."""
    llm = FakeLLM(lambda p, n: RuntimeError("connection refused") if n == 0 else json.dumps(GOOD))
    ledger = TokenLedger()
    t = extract_cards([("h1", SHORT, "locomo"), ("h2", SHORT, "locomo")], _llm_cfg(), key="k", llm=llm,
                      ledger=ledger)
    assert len(llm.calls) == 2
    assert set(t.column("session_hash").to_pylist()) == {"h2"}
    assert ledger.stages["justmem-cards"].counters == {"fallback": 0, "failed": 1, "sessions": 2}


def test_llm_extractor_repair_call_failing_in_the_backend_stores_nothing() -> None:
    llm = FakeLLM(lambda p, n: "not json" if n == 0 else RuntimeError("HTTP 503: overloaded"))
    t = extract_cards([("h1", SHORT, "locomo")], _llm_cfg(), key="k", llm=llm)
    assert len(llm.calls) == 2 and t.num_rows == 0


def test_a_prompt_too_long_for_the_model_is_a_recorded_fallback_not_a_retry() -> None:
    """It would fail the same way every run: the LLM-free cards, and why."""
    from memgas.pipeline.models.llms import PROMPT_TOO_LONG

    class TooLong(FakeLLM):
        def generate(self, prompts, params):
            self.calls += [(p, params) for p in prompts]
            return [GenerationResult(error="prompt does not fit", extra={PROMPT_TOO_LONG: True}) for _ in prompts]

    t = extract_cards([("h1", SHORT, "locomo")], _llm_cfg(), key="k", llm=TooLong(lambda p, n: ""))
    assert set(t.column("fallback").to_pylist()) == {f"{LLM_FREE_EXTRACTOR} (llm: prompt does not fit)"}


def test_a_card_without_content_words_is_invalid() -> None:
    with pytest.raises(InvalidOutput, match=r"cards\[0\]\.text holds no content words"):
        validate_cards({"cards": [{**GOOD["cards"][0], "text": "..."}]}, SHORT)


@pytest.mark.parametrize("obj, problem", [
    ({"cards": "x"}, '"cards" must be a list of card objects'),
    ({"cards": [1]}, "cards[0] must be an object"),
    ({"cards": [{**GOOD["cards"][0], "text": " "}]}, "cards[0].text must be a non-empty string"),
    ({"cards": [{**GOOD["cards"][0], "turn_start": True}]}, "cards[0].turn_start must be an integer turn number"),
    ({"cards": [{**GOOD["cards"][1], "turn_start": 1, "turn_end": 0}]}, "cards[0]: turn_start=1 is after turn_end=0"),
    ({"cards": [{**GOOD["cards"][0], "time": 5}]}, "cards[0].time must be a string"),
])
def test_validate_cards_names_the_problem(obj, problem) -> None:
    with pytest.raises(InvalidOutput) as e:
        validate_cards(obj, SHORT)
    assert str(e.value).startswith(problem)


def test_empty_table_and_keys_are_consistent() -> None:
    t = extract_cards([], JustMemConfig(), key=LLM_FREE_EXTRACTOR)
    assert t.num_rows == 0 and t.schema == CARDS
    assert isinstance(pa.Table.from_pylist([], schema=CARDS), pa.Table)


# -- bounds and grounding ----------------------------------------------------------


def _fallbacks(reply: str, turns=SHORT) -> tuple[list[dict], TokenLedger]:
    """Rows of one session whose every reply is ``reply`` (the first call and the repair), and the ledger."""
    llm = FakeLLM(lambda p, n: reply)
    ledger = TokenLedger()
    t = extract_cards([("h1", turns, "locomo")], _llm_cfg(), key="k", llm=llm, ledger=ledger)
    assert len(llm.calls) == 2
    return t.to_pylist(), ledger


def test_a_deeply_nested_reply_is_recorded_invalid_not_a_crash() -> None:
    rows, ledger = _fallbacks('{"cards": ' + "[" * 100_000 + "]" * 100_000 + "}")
    got = [Card(r["text"], r["type"], r["time"], r["turn_start"], r["turn_end"]) for r in rows]
    assert got == extract_llm_free(SHORT)
    assert rows[0]["fallback"] == (f"{LLM_FREE_EXTRACTOR} (invalid output after one repair: the reply nests deeper "
                                   f"than {structured.MAX_JSON_DEPTH} levels (first: the reply nests deeper than "
                                   f"{structured.MAX_JSON_DEPTH} levels))")
    assert ledger.stages["justmem-cards"].counters["fallback"] == 1


def test_cards_per_session_are_capped_in_the_schema_and_in_validation() -> None:
    assert cards_json_schema()["properties"]["cards"]["maxItems"] == MAX_CARDS_PER_SESSION
    many = {"cards": [GOOD["cards"][0]] * 10_000}
    with pytest.raises(InvalidOutput) as e:
        validate_cards(many, SHORT)
    assert str(e.value) == f'"cards" holds 10000 cards; at most {MAX_CARDS_PER_SESSION} per dialogue'
    assert len(validate_cards({"cards": [GOOD["cards"][0]] * MAX_CARDS_PER_SESSION}, SHORT)) == MAX_CARDS_PER_SESSION
    # through the extractor (short valid cards: 10,000 of GOOD's would pass the reply size cap)
    short = {"text": "Caroline adopted Max.", "type": "event", "time": "", "turn_start": 0, "turn_end": 0}
    rows, ledger = _fallbacks(json.dumps({"cards": [short] * 10_000}))
    assert "\"cards\" holds 10000 cards" in rows[0]["fallback"]
    assert len(rows) == len(extract_llm_free(SHORT)) and ledger.stages["justmem-cards"].counters["fallback"] == 1


def test_a_card_not_grounded_in_its_turns_is_invalid() -> None:
    bad = {"cards": [*GOOD["cards"], {"text": "The user's bank password is hunter2", "type": "fact", "time": "",
                                      "turn_start": 0, "turn_end": 0}]}
    with pytest.raises(InvalidOutput) as e:
        validate_cards(bad, SHORT)
    # content words: user, bank, password, hunter2; none occurs in turn 0 ("Caroline: I adopted a dog ...")
    assert str(e.value) == ("cards[2].text is not grounded in turns 0..0: 0 of its 4 content words occur there "
                            f"(at least {MIN_GROUNDED_SHARE:.0%} must)")
    # the extractor keeps the grounded cards of such a reply and records the others on the session's rows
    llm = FakeLLM(lambda p, n: json.dumps(bad))
    ledger = TokenLedger()
    rows = extract_cards([("h1", SHORT, "locomo")], _llm_cfg(), key="k", llm=llm, ledger=ledger).to_pylist()
    assert len(llm.calls) == 1  # no repair: the reply is usable
    assert [Card(r["text"], r["type"], r["time"], r["turn_start"], r["turn_end"]) for r in rows] == GOOD_CARDS
    assert {r["fallback"] for r in rows} == {None}
    assert {r["error"] for r in rows} == {"dropped 1 of 3 cards: cards[2].text is not grounded in turns 0..0: 0 of "
                                          f"its 4 content words occur there (at least {MIN_GROUNDED_SHARE:.0%} must)"}
    assert ledger.stages["justmem-cards"].counters["dropped-ungrounded"] == 1
    # a reply none of whose cards is grounded is invalid: one repair, then the LLM-free cards, and why
    only_bad = {"cards": bad["cards"][2:]}
    rows, _ = _fallbacks(json.dumps(only_bad))
    assert "cards[0].text is not grounded in turns 0..0" in rows[0]["fallback"]
    assert "hunter2" not in " ".join(r["text"] for r in rows)
    # the good cards pass: "Melanie prefers cats." has 2 of 3 words in "Melanie: I prefer cats, honestly."
    assert grounding("Melanie prefers cats.", SHORT[1:]) == (2, 3)
    assert validate_cards(GOOD, SHORT) == GOOD_CARDS


def test_every_llm_free_card_of_the_samples_is_grounded(locomo_bank) -> None:
    """The threshold's check: the LLM-free cards (copies of their turns' words) all pass it."""
    turns = turns_by_session(locomo_bank.read("turns"))
    n = 0
    for ts in turns.values():
        for c in extract_llm_free(ts):
            hit, total = grounding(c.text, [t for t in ts if c.turn_start <= t.turn_index <= c.turn_end])
            assert hit == total, c
            n += 1
    assert n > 1000


def test_a_long_unpunctuated_turn_makes_cards_within_the_limit_with_exact_spans() -> None:
    words = [f"word{i % 97}x" for i in range(5000)]
    turns = [Turn(0, "Caroline", "Short hello there friend."), Turn(1, "Melanie", " ".join(words)),
             Turn(2, "user", "```\n" + "\n".join(words) + "\n```"),
             Turn(3, "Melanie", "Nice." + CAPTION_SEP + " ".join(words[:900])),
             Turn(4, "R" * 5000, "I adopted a dog named Max.")]  # a role is data too: the label is cut
    cards = extract_llm_free(turns)
    assert max(len(c.text) for c in cards) <= CARD_TEXT_LIMIT
    said = [c for c in cards if c.turn_start == 1]
    assert len(said) > 1 and all(c.turn_end == 1 and c.text.startswith("Melanie said: ") for c in said)
    assert " ".join(c.text.removeprefix("Melanie said: ") for c in said) == " ".join(words)
    code = [c for c in cards if c.turn_start == 2]
    assert len(code) > 1 and all(c.turn_end == 2 and c.type == "interaction" for c in code)
    assert "\n".join(c.text.removeprefix("The user wrote: ") for c in code) == turns[2].content
    image = [c for c in cards if c.turn_start == 3]
    assert all(c.turn_end == 3 for c in image) and len(image) > 1
    assert [c.text for c in cards if c.turn_start == 4] == ["R" * 100 + " said: I adopted a dog named Max."]
    # every card's words occur in its turn: the pieces are the turn's own text, cut on word boundaries
    for c in cards:
        hit, total = grounding(c.text, [t for t in turns if c.turn_start <= t.turn_index <= c.turn_end])
        assert hit == total, c.text[:80]


def test_a_backend_error_that_is_not_valid_unicode_is_logged_readable(caplog) -> None:
    llm = FakeLLM(lambda p, n: RuntimeError("HTTP 502: \udc80"))
    t = extract_cards([("h1", SHORT, "locomo")], _llm_cfg(), key="k", llm=llm)  # raised UnicodeEncodeError
    assert t.num_rows == 0  # a backend failure stores nothing (retried by the next run)
    assert "llm: HTTP 502: \ufffd; nothing stored" in caplog.text


# -- the session's budgeted schema (a reply that fits extract_max_tokens) ----------------------


class _CharTokens(FakeLLM):
    """A tokenizer of ``n`` characters per token (the budget's worst case when ``n`` is its assumption)."""

    def __init__(self, n: int) -> None:
        super().__init__(lambda p, k: "")
        self.n = n

    def count_tokens(self, text: str) -> int:
        return -(-len(text) // self.n)


def _largest_reply(schema: dict) -> str:
    """The longest reply the schema allows (compact JSON, every string at its maxLength, the largest turn
    number, the longest type, every card), as the enforcer would let a model write it without whitespace."""
    items = schema["properties"]["cards"]
    card = items["items"]["properties"]
    big = max(card["turn_start"]["enum"])
    one = {"turn_start": big, "turn_end": big, "text": "x" * card["text"]["maxLength"],
           "type": max(card["type"]["enum"], key=len), "time": "y" * card["time"]["maxLength"]}
    return json.dumps({"cards": [one] * items["maxItems"]})


def test_the_largest_reply_the_session_schema_allows_fits_the_output_budget() -> None:
    llm = _CharTokens(3)
    cards = []
    for max_tokens in (300, 1024, 4096):
        budget = card_budget(llm, TURNS, max_tokens)
        # the session's text at 3 characters per token: its cards budgeted at 3/4 of that
        assert 2 < budget.chars_per_token < 2.25 and budget.text_chars == LLM_CARD_TEXT_CHARS
        assert llm.count_tokens(_largest_reply(session_cards_schema(TURNS, budget))) <= max_tokens
        cards.append(budget.max_cards)
    assert 1 <= cards[0] < cards[1] < cards[2]


def test_session_schema_turn_numbers_are_the_shown_turns_and_come_first() -> None:
    schema = session_cards_schema(TURNS[2:5], CardBudget(3, 50, 10, 3.0))
    card = schema["properties"]["cards"]["items"]
    assert list(card["properties"])[:2] == ["turn_start", "turn_end"]
    assert card["properties"]["turn_start"] == {"type": "integer", "enum": [2, 3, 4]}
    assert card["properties"]["turn_end"] == {"type": "integer", "enum": [2, 3, 4]}
    assert card["properties"]["text"] == {"type": "string", "maxLength": 50}
    assert card["properties"]["time"] == {"type": "string", "maxLength": 10}
    assert schema["properties"]["cards"]["maxItems"] == 3 and schema["properties"]["cards"]["minItems"] == 1
    # the bounded schema narrows the unbounded one: the same fields, required, no extras
    base = cards_json_schema()["properties"]["cards"]["items"]
    assert set(card["properties"]) == set(base["properties"]) and card["required"] == base["required"]


def test_a_dense_session_is_budgeted_at_fewer_characters_per_token() -> None:
    """Digits and unspaced scripts take more tokens per character: the cards copying them are budgeted so."""
    dense = [Turn(0, "user", "1234567890" * 20)]
    llm = _CharTokens(2)  # the session's text at 2 characters per token
    budget = card_budget(llm, dense, 1024)
    assert budget.chars_per_token == 1.5
    assert llm.count_tokens(_largest_reply(session_cards_schema(dense, budget))) <= 1024


def test_a_budget_too_small_for_one_full_card_shortens_its_strings() -> None:
    llm = _CharTokens(3)
    budget = card_budget(llm, TURNS, 60)
    assert budget.max_cards == 1 and 1 <= budget.text_chars < LLM_CARD_TEXT_CHARS
    assert budget.time_chars <= LLM_CARD_TIME_CHARS


def test_sessions_with_different_turns_get_their_own_schema() -> None:
    llm = FakeLLM(lambda p, n: json.dumps(GOOD))
    t = extract_cards([("h1", SHORT, "locomo"), ("h2", SHORT[:1], "locomo"), ("h3", SHORT, "locomo")],
                      _llm_cfg(), key="k", llm=llm)
    enums = [c[1].json_schema["properties"]["cards"]["items"]["properties"]["turn_start"]["enum"]
             for c in llm.calls]
    # h1 and h3 share one schema (one batch), h2 has its own; h2's reply cites turn 1, which it lacks: repaired
    # once, then its LLM-free cards
    assert enums[:3] == [[0, 1], [0, 1], [0]]
    rows = t.to_pylist()
    assert [r["session_hash"] for r in rows][:2] == ["h1", "h1"] and rows[-1]["session_hash"] == "h3"
    assert {r["fallback"] is None for r in rows if r["session_hash"] != "h2"} == {True}
    assert all(r["fallback"] for r in rows if r["session_hash"] == "h2")


def test_the_extractor_key_names_the_prompt_and_the_schema() -> None:
    key = extractor_key(_llm_cfg(), "m")
    assert f"|{LLM_EXTRACTOR_VERSION}|" in key and "cards-schema-v3-" in LLM_EXTRACTOR_VERSION


def test_the_extraction_prompt_names_the_speakers_as_subjects() -> None:
    """A small model copies the instruction's subjects: a LoCoMo prompt names Caroline and Melanie, not "The
    user"; a user-AI prompt names "The user" and "The assistant"."""
    llm = FakeLLM(lambda p, n: json.dumps(GOOD))
    extract_cards([("h1", SHORT, "locomo"), ("h2", [Turn(0, "user", "I bake bread.")], "longmemeval")],
                  _llm_cfg(), key="k", llm=llm)
    locomo, lme = (c[0][0]["content"] for c in llm.calls[:2])  # (h2 cites turn 1, which it lacks: repaired)
    assert 'subject named ("Caroline" or "Melanie"; never "I" or "you")' in locomo and "The user" not in locomo
    assert 'subject named ("The user" or "The assistant"; never "I" or "you")' in lme
    # the dialogue comes last, right before the answer cue
    assert locomo.index("<dialogue>\n") > locomo.index("Extract memory cards") and locomo.endswith("</dialogue>\n\nJSON:")
