"""Synthetic LongMemEval-format histories with planted facts and known evidence.

Each question gets a haystack of ``sessions_per_history`` sessions: one evidence session (single-session
question) or two (multi-session question: a count split over two sessions, "3 courses on Coursera" +
"2 on edX" -> "how many courses in total?" -> 5), the rest templated chit-chat distractors. A share
``reuse_share`` of the distractors is drawn from a pool shared by all histories, as LongMemEval-S/M
haystacks share sessions, so ingest's deduplication has something to do. The user turn that states a
fact carries ``has_answer: true`` (the other turns of an evidence session ``false``, distractors none),
and evidence session ids start with ``answer_`` as in LongMemEval.

Deterministic: every question and every pool session has its own ``random.Random`` seeded from a string
(Python's str seeding is stable across runs and platforms), so the same arguments give the same bytes.
The file is written one question at a time, so its size is not bounded by memory (1 GB is fine).
"""

from __future__ import annotations

import json
import logging
import random
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from memgas.pipeline.errors import MemgasError

log = logging.getLogger(__name__)

#: Bounds of the arguments. One history is built in memory before it is written, and the shared pool's
#: sessions are cached: 10^6 utterances per history measured 0.8 GB RSS for one question (the pool's cache
#: can grow to ~4x one history over many questions), where `--turns 1000000000` ran out of memory.
#: Questions are written one at a time: only the disk bounds them.
SYNTH_MAX_QUESTIONS = 100_000_000
SYNTH_MAX_SESSIONS = 1_000_000
SYNTH_MAX_TURNS = 10_000
SYNTH_MAX_UTTERANCES = 1_000_000
#: pool ids are written with 6 digits at least; a pool past this adds nothing a test needs
SYNTH_MAX_POOL = 100_000_000

DATE_FMT = "%Y/%m/%d (%a) %H:%M"  # LongMemEval's date format
_BASE_DATE = datetime(2023, 1, 2, 9, 0)

_TOPICS = [
    "sourdough baking", "marathon training", "indoor plants", "jazz piano", "budget travel in Portugal",
    "home espresso", "learning Japanese", "birdwatching", "3D printing", "woodworking", "rock climbing",
    "vegetable gardening", "chess openings", "watercolor painting", "retro video games", "camping gear",
    "personal finance", "meal prepping", "board game nights", "podcast editing", "aquarium care",
    "urban cycling", "photography lighting", "knitting patterns", "stargazing", "home workouts",
    "fermenting kimchi", "thrift shopping", "language exchange", "bullet journaling", "kayaking",
    "houseplant propagation", "smart home setup", "film photography", "yoga for beginners", "tea tasting",
]
_OPENERS = [
    "Hey, quick question.", "I've been thinking about something lately.", "Hope you can help me out.",
    "Random thought for today.", "So here's my situation.", "Can I pick your brain?", "Okay, new topic!",
    "I need some advice.", "Something came up this week.", "Just curious about this.",
]
_ASKS = [
    "What would you recommend for {topic}?", "Any tips to get better at {topic}?",
    "How do people usually start with {topic}?", "Is {topic} worth the time for a beginner?",
    "What are common mistakes with {topic}?", "How much should I budget for {topic}?",
    "Can you suggest a weekly plan for {topic}?", "What gear do I need for {topic}?",
]
_DETAILS = [
    "I have about {n} hours a week for it.", "My friend {name} got me interested.",
    "I tried it {n} times last month.", "I live in a small apartment, so space is tight.",
    "I'm on a budget of around ${n}0.", "I read a {adj} article about it yesterday.",
    "It reminds me of something {name} told me.", "The weather here has been {adj} lately.",
]
_REPLIES = [
    "Great question! For {topic}, start small and be consistent.",
    "Happy to help with {topic}. Here are a few ideas.",
    "{topic} is a {adj} choice. Many beginners enjoy it.",
    "Sure! People new to {topic} often focus on the basics first.",
    "That sounds {adj}. Let me break {topic} down for you.",
]
_TIPS = [
    "set a fixed time each week", "track your progress in a notebook", "join a local group",
    "watch a couple of tutorials", "invest in one good tool first", "ask an experienced friend",
    "keep sessions short at first", "review what worked every Sunday", "try a {n}-day challenge",
    "read reviews before buying", "start with the cheapest option", "focus on one skill at a time",
]
_NAMES = ["Alex", "Sam", "Priya", "Jordan", "Mei", "Luca", "Fatima", "Noah", "Ines", "Kenji", "Olga", "Tariq"]
_ADJS = ["fascinating", "surprising", "rainy", "sunny", "calm", "hectic", "detailed", "short", "long", "odd"]

# single-session facts: (statement, question, answer choices)
_FACTS = [
    ("By the way, I adopted a dog last week and named him {v}.", "What is the name of the dog I adopted?",
     ["Biscuit", "Pepper", "Mochi", "Rocket", "Waffles", "Juniper", "Ziggy", "Nacho"]),
    ("Oh, and I finally picked a color for my new car: {v}.", "What color did I pick for my new car?",
     ["teal", "burgundy", "silver", "matte black", "forest green", "pearl white"]),
    ("Also, my sister just moved to {v} for work.", "Which city did my sister move to?",
     ["Lisbon", "Osaka", "Nairobi", "Denver", "Tallinn", "Montreal", "Perth"]),
    ("I signed up for {v} lessons on Thursday evenings.", "What lessons did I sign up for on Thursday evenings?",
     ["cello", "salsa", "pottery", "fencing", "improv", "swimming"]),
    ("My new favorite coffee shop is called {v}.", "What is the name of my new favorite coffee shop?",
     ["The Daily Grind", "Bean There", "Brew Haven", "Cup & Compass", "Latte Lane"]),
]
# multi-session count facts: (first statement, second statement, question)
_COUNTS = [
    ("I've completed {a} courses on Coursera so far.", "I also finished {b} courses on edX this year.",
     "How many online courses have I completed in total?"),
    ("I read {a} fiction books this spring.", "Separately, I got through {b} non-fiction books.",
     "How many books did I read in total?"),
    ("I bought {a} succulents at the market.", "Then I picked up {b} ferns at the garden center.",
     "How many plants did I buy in total?"),
    ("I ran {a} races in the first half of the year.", "I ran another {b} races after the summer.",
     "How many races did I run in total?"),
]


def _fill(r: random.Random, template: str, topic: str) -> str:
    return template.format(topic=topic, n=r.randint(2, 99), name=r.choice(_NAMES), adj=r.choice(_ADJS))


def _chitchat(r: random.Random, n_turns: int) -> list[dict[str, Any]]:
    """Templated user/assistant chit-chat on one topic; random slots make every session's text differ."""
    topic = r.choice(_TOPICS)
    turns: list[dict[str, Any]] = []
    for i in range(n_turns):
        if i % 2 == 0:
            parts = [r.choice(_OPENERS), _fill(r, r.choice(_DETAILS), topic), _fill(r, r.choice(_ASKS), topic)]
            turns.append({"role": "user", "content": " ".join(parts)})
        else:
            tips = r.sample(_TIPS, 3)
            body = "; ".join(_fill(r, t, topic) for t in tips)
            turns.append({"role": "assistant", "content": f"{_fill(r, r.choice(_REPLIES), topic)} You could {body}."})
    return turns


def _plant(r: random.Random, n_turns: int, statement: str) -> list[dict[str, Any]]:
    """A chit-chat session whose one user turn also states ``statement`` (marked has_answer)."""
    turns = _chitchat(r, n_turns)
    users = [i for i in range(len(turns)) if turns[i]["role"] == "user"]
    at = r.choice(users)
    for i, t in enumerate(turns):
        t["has_answer"] = i == at
    turns[at]["content"] = f"{turns[at]['content']} {statement}"
    return turns


class _Pool:
    """Shared distractor sessions, generated on demand from their index (same text in every history)."""

    #: pool sessions kept generated (a session is a function of its index: the cache only saves time, and a
    #: bound keeps a LongMemEval-M-sized pool of tens of thousands of sessions out of memory)
    CACHE = 8192

    def __init__(self, seed: int, size: int, n_turns: int) -> None:
        self.seed, self.size, self.n_turns = seed, size, n_turns
        self._cache: dict[int, list[dict[str, Any]]] = {}

    def get(self, k: int) -> tuple[str, list[dict[str, Any]]]:
        if k not in self._cache:
            if len(self._cache) >= self.CACHE:
                self._cache.clear()
            self._cache[k] = _chitchat(random.Random(f"memgas-synth:{self.seed}:pool:{k}"), self.n_turns)
        return f"pool_{k:06d}", self._cache[k]


def _question(i: int, *, seed: int, pool: _Pool, sessions: int, n_turns: int, reuse_share: float, multi_share: float) -> dict[str, Any]:
    r = random.Random(f"memgas-synth:{seed}:q:{i}")
    qid = f"synth_{i:06d}"
    multi = r.random() < multi_share and sessions >= 2
    if multi:
        first, second, question = r.choice(_COUNTS)
        a, b = r.randint(2, 9), r.randint(2, 9)
        statements = [first.format(a=a), second.format(b=b)]
        answer: Any = a + b
        qtype = "multi-session"
    else:
        statement, question, choices = r.choice(_FACTS)
        value = r.choice(choices)
        statements = [statement.format(v=value)]
        answer = value
        qtype = "single-session-user"
    n_ev = len(statements)
    ev_positions = sorted(r.sample(range(sessions), n_ev))
    ids: list[str] = []
    haystack: list[list[dict[str, Any]]] = []
    answer_ids: list[str] = []
    ev_k = 0
    for pos in range(sessions):
        if ev_k < n_ev and pos == ev_positions[ev_k]:
            sid = f"answer_{qid}_{ev_k + 1}"
            haystack.append(_plant(r, n_turns, statements[ev_k]))
            answer_ids.append(sid)
            ev_k += 1
        elif r.random() < reuse_share:
            sid, turns = pool.get(r.randrange(pool.size))
            if sid in ids:  # the same pool session twice in one haystack: use a fresh one instead
                sid, turns = f"{qid}_u{pos}", _chitchat(r, n_turns)
            haystack.append(turns)
        else:
            sid = f"{qid}_u{pos}"
            haystack.append(_chitchat(r, n_turns))
        ids.append(sid)
    # time-sorted dates, a few hours to a few days apart; the question comes after the last session
    start = _BASE_DATE + timedelta(days=r.randint(0, 300))
    dates: list[str] = []
    t = start
    for _ in range(sessions):
        t += timedelta(minutes=r.randint(180, 4 * 24 * 60))
        dates.append(t.strftime(DATE_FMT))
    qdate = (t + timedelta(days=r.randint(1, 30))).strftime(DATE_FMT)
    return {
        "question_id": qid,
        "question_type": qtype,
        "question": question,
        "answer": answer,
        "question_date": qdate,
        "haystack_session_ids": ids,
        "haystack_dates": dates,
        "haystack_sessions": haystack,
        "answer_session_ids": answer_ids,
    }


#: ``memgas synth``'s defaults (a small file for tests and demos)
CLI_DEFAULTS: dict[str, Any] = dict(questions=20, sessions_per_history=40, turns_per_session=6, reuse_share=0.5,
                                    multi_session_share=0.3, pool_size=None)
#: Published splits' shapes (``memgas synth --shape NAME``; docs/data.md says how each number was derived).
#: m = LongMemEval-M: 500 questions, 500 sessions a history (the official sampler draws 500 filler sessions
#: per question, each uniformly from shared pools, plus 1-6 evidence sessions: 1.9 per question in the oracle
#: file, so 90% of the questions here have two), ~10 utterances a session (10.3 in the LongMemEval-S sample),
#: every distractor drawn from one shared pool, whose size makes 82% of the references repeat a session seen
#: before (~45k unique sessions in 250k references), the share derived from LongMemEval-S's measured reuse.
SHAPES: dict[str, dict[str, Any]] = {
    "m": dict(questions=500, sessions_per_history=500, turns_per_session=10, reuse_share=1.0,
              multi_session_share=0.9, pool_size=43_000),
}


def synth(
    out_path: str | Path,
    *,
    questions: int = 100,
    sessions_per_history: int = 40,
    turns_per_session: int = 10,
    reuse_share: float = 0.5,
    multi_session_share: float = 0.3,
    seed: int = 0,
    pool_size: int | None = None,
) -> Path:
    """Write a LongMemEval-format JSON file of ``questions`` synthetic histories; returns its path.
    ``pool_size``: sessions in the shared distractor pool (None: four haystacks' worth)."""
    if questions < 0 or sessions_per_history < 1 or turns_per_session < 1:
        raise MemgasError("questions >= 0, sessions_per_history >= 1 and turns_per_session >= 1 are required")
    if questions > SYNTH_MAX_QUESTIONS or sessions_per_history > SYNTH_MAX_SESSIONS or turns_per_session > SYNTH_MAX_TURNS:
        raise MemgasError(f"at most {SYNTH_MAX_QUESTIONS:,} questions, {SYNTH_MAX_SESSIONS:,} sessions per history and "
                          f"{SYNTH_MAX_TURNS:,} turns per session")
    if sessions_per_history * turns_per_session > SYNTH_MAX_UTTERANCES:
        raise MemgasError(f"--sessions {sessions_per_history:,} x --turns {turns_per_session:,} = "
                          f"{sessions_per_history * turns_per_session:,} utterances per history; at most "
                          f"{SYNTH_MAX_UTTERANCES:,} (one history is built in memory): use fewer sessions or turns")
    if not (0.0 <= reuse_share <= 1.0 and 0.0 <= multi_session_share <= 1.0):
        raise MemgasError("reuse_share and multi_session_share must lie in [0, 1]")
    if pool_size is not None and not 1 <= pool_size <= SYNTH_MAX_POOL:
        raise MemgasError(f"pool_size must lie in [1, {SYNTH_MAX_POOL:,}]")
    out = Path(out_path)
    if out.is_dir():
        raise MemgasError(f"{out}: is a directory; give the path of the .json file to write")
    for parent in (out.parent, *out.parent.parents):
        if parent.exists():
            if not parent.is_dir():
                raise MemgasError(f"{out}: {parent} is a file, not a directory")
            break
    out.parent.mkdir(parents=True, exist_ok=True)
    # a pool a few times one haystack: sessions recur across histories but rarely within one
    pool = _Pool(seed, pool_size or max(4 * sessions_per_history, 16), turns_per_session)
    tmp = out.with_name(f".{out.name}.tmp")
    try:  # written beside and renamed: an interrupted or failed write (a full disk) leaves no half file
        with open(tmp, "w", encoding="utf-8", newline="\n") as f:
            f.write("[")
            for i in range(questions):
                q = _question(
                    i, seed=seed, pool=pool, sessions=sessions_per_history, n_turns=turns_per_session,
                    reuse_share=reuse_share, multi_share=multi_session_share,
                )
                f.write(",\n" if i else "\n")
                f.write(json.dumps(q, ensure_ascii=False))
            f.write("\n]\n")
        tmp.replace(out)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    log.info("wrote %d synthetic questions to %s (%d bytes)", questions, out, out.stat().st_size)
    return out
