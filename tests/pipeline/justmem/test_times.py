"""JustMem time expressions at any number and any date: every expression resolves to days within
``datetime.date``'s range or to none, never an error (a card saying "7000 years ago" once stopped card-rank with
``ValueError: year -4977 is out of range``). A fuzz over generated expressions and the edge dates, with a
fixed seed, and the exact answers for the expressions found in LongMemEval-S."""

from __future__ import annotations

import random
from datetime import date, datetime, timedelta

import numpy as np
import pytest

from memgas.pipeline.justmem.extract import extract_llm_free
from memgas.pipeline.justmem.retrieve import card_days
from memgas.pipeline.justmem.text import Turn
from memgas.pipeline.justmem.times import find_time, resolve_time, time_interval

FIRST, LAST = date.min.toordinal(), date.max.toordinal()
NOW = date(2023, 5, 8)
#: the edges of ``date``'s range and their neighbours, and an ordinary day
EDGE_DATES = [date.min, date.min + timedelta(days=1), date(1, 2, 28), date(1, 12, 31), date(2, 1, 1),
              date(9998, 12, 31), date(9999, 1, 1), date(9999, 12, 1), date.max - timedelta(days=1), date.max, NOW]
SEED, N_EXPRESSIONS = 20261205, 1500

_NUMBERS = ["0", "1", "7", "13", "31", "365", "6000", "7000", "9999", "10000", "10,000", "5,000,000", "10,000,000",
            "999999999", "1000000000", "9" * 30, "9" * 5000, "1.5", "2,5", "0.0001", "a", "an", "one", "ten",
            "a few", "a couple of", "-3", "٣"]
_UNITS = ["day", "days", "week", "weeks", "month", "months", "year", "years", "decade", "century"]
_WORDS = ["yesterday", "today", "tomorrow", "tonight", "last night", "recently", "the other day", "this week",
          "last week", "last weekend", "this month", "last month", "this year", "last year", "next year",
          "last monday", "last sunday", "next friday", "this morning", "in june", "in may", "december",
          "october 13, 2023", "13 october 2023", "february 29, 2023", "february 29, 2024", "july 2023", "2022",
          "1900", "year 0", "year 10000", "the 99th century", "in 10,000 bc", "in 2000 bc", "2000 b.c.",
          "1999 bce", "in 1999", "back in 2020", "since 2019", "during 2021"]
_OPEN = ["", "", "before ", "after ", "since ", "until ", "before before ", "after until ", "before " * 300]


def _expression(r: random.Random) -> str:
    """One time expression of the forms the extractor and the planner read, built from edge numbers."""
    kind = r.randrange(5)
    if kind == 0:
        core = f"{r.choice(_NUMBERS)} {r.choice(_UNITS)} ago"
    elif kind == 1:
        core = f"the {r.choice(['past', 'last'])} {r.choice(_NUMBERS)} {r.choice(_UNITS)}"
    elif kind == 2:
        core = r.choice(_WORDS)
    elif kind == 3:
        era = r.choice(['', ' bc', ' ad', ' BCE'])
        core = f"{r.choice(['in ', 'since ', 'back in ', ''])}{r.choice(_NUMBERS)}{era}"
    else:  # words of the other forms glued together: whatever a model may write in a card's time
        core = " ".join(r.choice([*_WORDS, *_NUMBERS, *_UNITS, "ago", "before", "of"]) for _ in range(r.randint(1, 6)))
    text = r.choice(_OPEN) + core
    return text.upper() if r.random() < 0.1 else text


def _valid(iv: tuple[int, int] | None) -> bool:
    return iv is None or (type(iv[0]) is int and type(iv[1]) is int and FIRST <= iv[0] <= iv[1] <= LAST)


def test_every_generated_expression_resolves_within_the_range_of_date_or_to_none() -> None:
    r = random.Random(SEED)
    exprs = [_expression(r) for _ in range(N_EXPRESSIONS)]
    dates = [*EDGE_DATES, *(date.fromordinal(r.randint(FIRST, LAST)) for _ in range(20))]
    bad = []
    for k, text in enumerate(exprs):
        for now in (None, dates[k % len(dates)], date.min, date.max):
            iv = time_interval(text, now)
            if not _valid(iv):
                bad.append((text[:60], now, iv))
        t = find_time(text)
        for sd in (datetime.min, datetime.max, datetime.combine(dates[k % len(dates)], datetime.min.time())):
            out = resolve_time(t or text, sd)
            assert isinstance(out, str) and out
    assert bad == []
    # card_days, as card-rank calls it: a card's own time against its session's date, else the session's date
    times = [find_time(e) for e in exprs]
    sds = [dates[k % len(dates)] for k in range(len(exprs))]
    days = card_days(times, sds)
    assert days.dtype == np.int64 and days.shape == (len(exprs), 2)
    assert ((FIRST <= days[:, 0]) & (days[:, 0] <= days[:, 1]) & (days[:, 1] <= LAST)).all()
    assert (card_days(times, [None] * len(exprs)) >= -1).all()


def test_cards_that_say_such_times_get_their_days_and_their_resolved_time() -> None:
    turns = [Turn(0, "user", "My family came to this valley 7000 years ago, or so the story goes."),
             Turn(1, "assistant", "Pottery from 10,000 BC was dug up near the river."),
             Turn(2, "user", "The rock formed 5,000,000 days ago. Also 10,000,000 days ago is a long time."),
             Turn(3, "user", "I moved here 1.5 years ago, in 2000 BC terms nothing.")]
    cards = extract_llm_free(turns)
    assert [c.time for c in cards] == ["7000 years ago", None, "5,000,000 days ago", None]
    for sd in EDGE_DATES:
        own = [sd.toordinal()] * 2
        year = sd.year - 7000  # a year before year 1 covers no day: the card keeps its session's date
        first = [date(year, 1, 1).toordinal(), date(year, 12, 31).toordinal()] if year >= 1 else own
        assert card_days([c.time for c in cards], [sd] * len(cards)).tolist() == [first, own, own, own]
        when = datetime.combine(sd, datetime.min.time())
        assert [resolve_time(c.time, when) for c in cards] == [
            str(year) if year >= 1 else f"7000 years ago (before {sd.day} {when:%B} {sd.year})", None,
            f"5,000,000 days ago (before {sd.day} {when:%B} {sd.year})", None]


@pytest.mark.parametrize("text, now, want", [
    ("7000 years ago", NOW, None),
    ("6000 years ago", NOW, None),
    ("10,000,000 days ago", NOW, None),
    ("5,000,000 days ago", NOW, None),
    ("in 10,000 bc", NOW, None),
    ("in 2000 BC", NOW, None),
    ("year 0", NOW, None),
    ("the 99th century", NOW, None),
    ("1.5 years ago", NOW, None),
    ("10,000 days ago", NOW, (NOW.toordinal() - 10_001, NOW.toordinal() - 9_999)),
    ("2000 years ago", NOW, (date(23, 1, 1).toordinal(), date(23, 12, 31).toordinal())),
    ("the past 7000 years", NOW, (FIRST, NOW.toordinal())),
    ("before 7000 years ago", NOW, None),
    ("yesterday", date.min, None),
    ("before yesterday", date(1, 1, 2), None),
    ("last month", date(1, 1, 15), None),
    ("last month", date.max, (date(9999, 11, 1).toordinal(), date(9999, 11, 30).toordinal())),
    ("this month", date.max, (date(9999, 12, 1).toordinal(), LAST)),
    ("in june", date(1, 3, 1), None),
    ("after today", date.max, None),
    ("since today", date.max, (LAST, LAST)),
    ("before " * 3000 + "2022", NOW, None),
])
def test_times_out_of_range_name_no_day(text, now, want) -> None:
    assert time_interval(text, now) == want


@pytest.mark.parametrize("time, when, want", [
    ("7000 years ago", datetime(2023, 5, 8), "7000 years ago (before 8 May 2023)"),
    ("2000 years ago", datetime(2023, 5, 8), "23"),
    ("5,000,000 days ago", datetime(2023, 5, 8), "5,000,000 days ago (before 8 May 2023)"),
    ("10,000 days ago", datetime(2023, 5, 8), "21 December 1995"),
    ("yesterday", datetime.min, "yesterday (said on 1 January 1)"),
    ("tomorrow", datetime.max, "tomorrow (said on 31 December 9999)"),
    ("next year", datetime.max, "next year (said on 31 December 9999)"),
    ("last year", datetime.min, "last year (said on 1 January 1)"),
])
def test_resolved_times_out_of_range_say_the_expression_and_the_date(time, when, want) -> None:
    assert resolve_time(time, when) == want


def test_numbers_are_read_whole() -> None:
    assert find_time("it was 10,000,000 days ago") == "10,000,000 days ago"
    assert find_time("about 1.5 years ago") is None
    assert find_time("we met in 2000 BC") is None and find_time("we met in 2000, before") == "in 2000"
