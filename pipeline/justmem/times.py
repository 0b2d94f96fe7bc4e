"""JustMem time expressions: found in card and question text, resolved against a date.

A card's ``time`` is the first time expression of its text (:func:`find_time`: "yesterday", "last week",
"two weeks ago", "2022"), lower-cased; null means the session's date. :func:`resolve_time` turns it into a
date or a phrase against the session date of the history being read ("yesterday" on 8 May 2023 -> "7 May
2023"); :func:`time_interval` turns a card's time or a question's time constraint into the days it covers
(read by retrieval).

Any number and any date resolve without error: an interval is clipped to the days ``datetime.date`` holds
(1 January of year 1 to 31 December 9999) and is None when nothing of it is left ("7000 years ago",
"10,000,000 days ago"), and a date that cannot be computed ("tomorrow" on 31 December 9999) is told as the
expression and the session date, as for any expression it cannot resolve. A year followed by "BC" is no year
of ours ("in 2000 BC" names no date), and a number is read whole ("10,000 years ago", not "000 years ago";
"1.5 years ago" names no date rather than five years).
"""

from __future__ import annotations

import calendar
import re
from datetime import MAXYEAR, MINYEAR, date, datetime, timedelta

_MONTHS = ("january|february|march|april|may|june|july|august|september|october|november|december")
_WEEKDAYS = "monday|tuesday|wednesday|thursday|friday|saturday|sunday"
# a count: digits (with thousands commas) that do not continue a number ("1.5", "10,000": never "5", "000")
_NUM = (r"(?:(?<!\d[.,])(?:\d{1,3}(?:,\d{3})+|\d+)"
        r"|a|an|one|two|three|four|five|six|seven|eight|nine|ten|a few|few|couple of|a couple of)")
# a year of the era the patterns mean, not a count: not one followed by "BC"/"BCE"/"B.C." or by a unit ("2000 years")
_NOT_BC = r"(?!\s*(?:bce?\b|b\.\s?c\.)|\s+(?:day|week|month|year)s?\b)"
#: time expressions, most specific first (the first match is the card's ``time``)
_TIME_RE = re.compile(
    rf"\b(?:{_NUM}\s+(?:days?|weeks?|months?|years?)\s+ago"
    rf"|(?:last|next|this)\s+(?:night|week|weekend|month|year|summer|winter|spring|fall|autumn|{_WEEKDAYS})"
    rf"|yesterday|today|tonight|tomorrow|this\s+(?:morning|afternoon|evening)"
    rf"|(?:in|since|during|back\s+in)\s+(?:19|20)\d\d{_NOT_BC}"
    rf"|(?:{_MONTHS})(?:\s+\d{{1,2}})?(?:,?\s+(?:19|20)\d\d{_NOT_BC})?"
    rf"|recently|the other day)\b",
    re.IGNORECASE)


def find_time(text: str) -> str | None:
    """The first time expression of ``text``, lower-cased with single spaces (None: none)."""
    m = _TIME_RE.search(text)
    return " ".join(m.group(0).lower().split()) if m else None


_WORDNUM = {"a": 1, "an": 1, "one": 1, "two": 2, "three": 3, "four": 4, "five": 5, "six": 6, "seven": 7,
            "eight": 8, "nine": 9, "ten": 10, "a few": 3, "few": 3, "couple of": 2, "a couple of": 2}
#: Most digits of a count read as its value: 10^9 days is past ``date``'s range in every unit, and Python
#: refuses to convert a string of more than 4,300 digits.
_COUNT_DIGITS = 9


def count(word: str) -> int:
    """The number a count of ``_NUM`` says ("3", "10,000", "a few"); a number of more than ``_COUNT_DIGITS``
    digits counts as 10^9 (a time that far back is out of range in every unit)."""
    digits = word.replace(",", "")
    if digits.isdecimal():
        return int(digits) if len(digits) <= _COUNT_DIGITS else 10 ** _COUNT_DIGITS
    return _WORDNUM.get(word, 0)


def fmt_date(d: datetime) -> str:
    """``8 May 2023`` (LoCoMo's answers spell dates this way)."""
    return f"{d.day} {d:%B %Y}"


def _shifted(d: datetime, days: int) -> str | None:
    """``fmt_date`` of ``d`` moved by ``days``, None past the range of ``datetime``."""
    try:
        return fmt_date(d + timedelta(days=days))
    except OverflowError:
        return None


def _year_name(year: int) -> str | None:
    return str(year) if MINYEAR <= year <= MAXYEAR else None


def resolve_time(time: str | None, session_date: datetime | None) -> str | None:
    """A card's relative ``time`` against its session's date, as the reader should see it: a date
    ("yesterday" -> "7 May 2023"), a phrase anchored to the date ("last week" -> "the week before 8 May
    2023"), a year ("last year" -> "2022"), or the expression itself when it cannot be resolved (nor can a
    date outside ``datetime``'s range: "7000 years ago"). None when the card has no time of its own (its date
    is the session's)."""
    if not time:
        return None
    if session_date is None:
        return time
    t, d = time.lower().strip(), session_date
    said = f"{time} (said on {fmt_date(d)})"
    if t in ("yesterday", "last night"):
        return _shifted(d, -1) or said
    if t in ("today", "tonight", "this morning", "this afternoon", "this evening"):
        return fmt_date(d)
    if t == "tomorrow":
        return _shifted(d, 1) or said
    if t == "last year":
        return _year_name(d.year - 1) or said
    if t == "next year":
        return _year_name(d.year + 1) or said
    if t == "this year":
        return str(d.year)
    m = re.fullmatch(r"(last|next)\s+(\w+)", t)
    if m:
        return f"the {m.group(2)} {'before' if m.group(1) == 'last' else 'after'} {fmt_date(d)}"
    m = re.fullmatch(rf"({_NUM})\s+(day|week|month|year)s?\s+ago", t)
    if m:
        n = count(m.group(1))
        unit = m.group(2)
        before = f"{time} (before {fmt_date(d)})"
        if unit == "day" and n:
            return _shifted(d, -n) or before
        if unit == "year" and n:
            return _year_name(d.year - n) or before
        return before
    return said


#: an interval of days (``date.toordinal()``), both ends included
DayInterval = tuple[int, int]
_MONTH_NO = {m: i + 1 for i, m in enumerate(_MONTHS.split("|"))}
_WEEKDAY_NO = {d: i for i, d in enumerate(_WEEKDAYS.split("|"))}
_YEAR = rf"((?:19|20)\d\d){_NOT_BC}"
_MDY_RE = re.compile(rf"\b({_MONTHS})\s+(\d{{1,2}})(?:st|nd|rd|th)?,?\s+{_YEAR}\b")
_DMY_RE = re.compile(rf"\b(\d{{1,2}})(?:st|nd|rd|th)?\s+(?:of\s+)?({_MONTHS}),?\s+{_YEAR}\b")
_MY_RE = re.compile(rf"\b({_MONTHS}),?\s+{_YEAR}\b")
# a bare "may" is mostly the verb: a month name alone counts except "may"
_M_RE = re.compile(rf"\b({_MONTHS.replace('may|', '')})\b")
_Y_RE = re.compile(rf"\b{_YEAR}\b")
_AGO_RE = re.compile(rf"\b({_NUM})\s+(day|week|month|year)s?\s+ago\b")
_PAST_RE = re.compile(rf"\b(?:past|last)\s+({_NUM})\s+(day|week|month|year)s\b")
_LAST_WEEKDAY_RE = re.compile(rf"\blast\s+({_WEEKDAYS})\b")
_OPEN_RE = re.compile(r"(before|after|since|until)\s+")
#: days each unit spans, and the slack either side of "N units ago" (people round)
_UNIT_DAYS = {"day": 1, "week": 7, "month": 30, "year": 365}
_AGO_SLACK = {"day": 1, "week": 3, "month": 15, "year": 0}
#: "recently" and "the other day": the last month and the last week before now
_RECENT_DAYS, _OTHER_DAY_DAYS = 31, 7
#: every day ``date`` holds
_OPEN = (date.min.toordinal(), date.max.toordinal())


def _clip(iv: DayInterval | None) -> DayInterval | None:
    """``iv`` within the days ``date`` holds; None when none of it is."""
    if iv is None:
        return None
    lo, hi = max(iv[0], _OPEN[0]), min(iv[1], _OPEN[1])
    return (lo, hi) if lo <= hi else None


def _month(year: int, month: int) -> DayInterval | None:
    if not MINYEAR <= year <= MAXYEAR:
        return None
    return date(year, month, 1).toordinal(), date(year, month, calendar.monthrange(year, month)[1]).toordinal()


def _year(year: int) -> DayInterval | None:
    if not MINYEAR <= year <= MAXYEAR:
        return None
    return date(year, 1, 1).toordinal(), date(year, 12, 31).toordinal()


def _absolute(t: str, now: date | None) -> DayInterval | None:
    for rx, order in ((_MDY_RE, "mdy"), (_DMY_RE, "dmy")):
        m = rx.search(t)
        if m:
            a, b, y = m.groups()
            mon, day = (a, b) if order == "mdy" else (b, a)
            try:
                d = date(int(y), _MONTH_NO[mon], int(day)).toordinal()
            except ValueError:
                continue
            return d, d
    m = _MY_RE.search(t)
    if m:
        return _month(int(m.group(2)), _MONTH_NO[m.group(1)])
    m = _Y_RE.search(t)
    if m:
        return _year(int(m.group(1)))
    m = _M_RE.search(t)
    if m and now is not None:  # a month without a year: its latest occurrence up to now
        mon = _MONTH_NO[m.group(1)]
        return _month(now.year if mon <= now.month else now.year - 1, mon)
    return None


def _relative(t: str, now: date) -> DayInterval | None:
    """Relative to ``now``, as plain day arithmetic: the result may lie outside ``date``'s range
    (:func:`time_interval` clips it)."""
    n0 = now.toordinal()
    if re.search(r"\b(?:yesterday|last night)\b", t):
        return n0 - 1, n0 - 1
    if re.search(r"\b(?:today|tonight|this (?:morning|afternoon|evening))\b", t):
        return n0, n0
    m = _AGO_RE.search(t)
    if m:
        n, unit = count(m.group(1)), m.group(2)
        if unit == "year":
            return _year(now.year - n)
        mid = n0 - n * _UNIT_DAYS[unit]
        return mid - _AGO_SLACK[unit], mid + _AGO_SLACK[unit]
    m = _PAST_RE.search(t)
    if m:
        return n0 - count(m.group(1)) * _UNIT_DAYS[m.group(2)], n0
    m = _LAST_WEEKDAY_RE.search(t)
    if m:
        back = (now.weekday() - _WEEKDAY_NO[m.group(1)] - 1) % 7 + 1  # strictly before today
        return n0 - back, n0 - back
    if re.search(r"\blast week(?:end)?\b", t):
        return n0 - 14, n0 - 1
    if re.search(r"\bthis week\b", t):
        return n0 - 7, n0
    if re.search(r"\blast month\b", t):
        return _month(now.year, now.month - 1) if now.month > 1 else _month(now.year - 1, 12)
    if re.search(r"\bthis month\b", t):
        return _month(now.year, now.month)
    if re.search(r"\blast year\b", t):
        return _year(now.year - 1)
    if re.search(r"\bthis year\b", t):
        return _year(now.year)
    if re.search(r"\brecent(?:ly)?\b", t):
        return n0 - _RECENT_DAYS, n0
    if re.search(r"\bthe other day\b", t):
        return n0 - _OTHER_DAY_DAYS, n0
    return None


def time_interval(text: str, now: date | datetime | None) -> DayInterval | None:
    """The days a time expression covers, or None when it names no date: explicit dates, months and years
    ("October 13, 2023", "13 October 2023", "July 2023", "in June", "2022"), and, when ``now`` is known
    (the question's date, or the session date for a card's own time), relative ones ("yesterday",
    "last Saturday", "two weeks ago", "last month", "recently", "in the past three months"). "before /
    after / since / until <date>" open the interval on one side ("before today": every day before now).
    A month without a year is its latest occurrence up to ``now``. Always within ``date``'s range, or None
    (module docstring)."""
    t = " ".join(text.lower().split())
    if isinstance(now, datetime):
        now = now.date()
    ops: list[str] = []  # "before after X" applies "after" first; a loop, as any number may be stacked
    pos = 0
    while (m := _OPEN_RE.match(t, pos)) and m.end() < len(t):
        ops.append(m.group(1))
        pos = m.end()
    t = t[pos:]
    got = _absolute(t, now)
    if got is None and now is not None:
        got = _relative(t, now)
    got = _clip(got)
    for op in reversed(ops):
        if got is None:
            return None
        lo, hi = got
        got = _clip((_OPEN[0], lo - 1) if op in ("before", "until") else ((hi + 1 if op == "after" else lo), _OPEN[1]))
    return got
