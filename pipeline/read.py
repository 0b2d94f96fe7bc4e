"""Reading stage: filter the retrieved sessions, then answer (DESIGN.md §3.6).

Per query: the top-K retrieved sessions (with dates, summaries and keywords) go through the authors'
filter prompt once, then the answer prompt gets the filtered text once (the authors' code pastes it once
per retrieved session; we do not). Both steps are batched across queries.

Token budget: each prompt + its ``max_tokens`` must fit ``min(cfg.context_tokens, llm.context_tokens)``.
When the context does not fit, the lowest-ranked sessions are dropped first; if the top session alone
does not fit, its text is cut (head kept). Cuts are logged and counted (``context_cut`` in the ledger).

Failures never sink the batch: a filter error/empty output falls back to the unfiltered context (noted in
``error``), an answer error or empty answer is recorded in ``error`` with an empty hypothesis.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, Protocol

import pyarrow as pa

from memgas.pipeline.accounting import TokenLedger
from memgas.pipeline.config import ReadingConfig
from memgas.pipeline.llm_calls import generate_batch
from memgas.pipeline.models.base import LLM, SamplingParams
from memgas.pipeline.prompts import answer_prompt, filter_prompt, session_block
from memgas.pipeline.schema import ANSWERS

log = logging.getLogger(__name__)

#: Tokens reserved for the chat template and tokenizer differences.
MARGIN = 32
#: Output budget of the filter step: it copies original tokens, so it needs more room than an answer.
DEFAULT_FILTER_MAX_TOKENS = 512

#: Most characters of an answer per token of ``max_new_tokens``: no tokenizer's token is this long, so a longer
#: reply comes from a backend that ignored max_tokens (a looping model behind a server that does not cap it). It is
#: cut, and noted, before it is stored: the judge and the QA metrics read it (ROUGE took 25 s on one 3.6 MB answer).
ANSWER_CHARS_PER_TOKEN = 16

# the authors' get_answer(): cut the answer where the model starts a new speaker/question
_CUT_MARKERS = ("\n[human]:", "\nQuestion:", "\nQ:", "\nHistory Dialogs:")
_STRIP_PREFIXES = ("Answer:", "[bot]:", "Assistant:")


def clean_answer(text: str) -> str:
    ans = (text or "").strip()
    for m in _CUT_MARKERS:
        if m in ans:
            ans = ans.split(m)[0]
    # prefixes skipped by position, one copy at the end (slicing after each one is quadratic on a looping
    # "Answer: Answer: ..." reply)
    pos, changed = 0, True
    while changed:
        changed = False
        for p in _STRIP_PREFIXES:
            if ans.startswith(p, pos):
                pos += len(p)
                while pos < len(ans) and ans[pos].isspace():
                    pos += 1
                changed = True
    return ans[pos:].strip()


def usable(text: str) -> bool:
    t = text.strip()
    if not t:
        return False
    chars = [c for c in t if not c.isspace()]
    # digits count: "42" or "2023-05-08" are fine answers
    return sum(c.isalnum() for c in chars) / len(chars) >= 0.4


def _cut_head(llm: LLM, text: str, max_tokens: int) -> str:
    if max_tokens <= 0:
        return ""
    n = llm.count_tokens(text)
    while n > max_tokens and text:
        text = text[: max(int(len(text) * max_tokens / n * 0.95), 0)]
        n = llm.count_tokens(text)
    return text


def build_context(
    llm: LLM,
    sessions: Sequence[dict[str, Any]],
    *,
    top_k: int,
    budget: int,
    multigran: bool,
) -> tuple[str, int, bool]:
    """The retrieved-sessions text within ``budget`` tokens: ``(text, sessions kept, cut?)``. A session's
    ``cards`` (memgas-cards: its cards' lines) are part of its block, dropped and cut with it."""
    chosen = list(sessions[:top_k])
    blocks = [
        session_block(
            s.get("date"),
            s.get("text") or "",
            (s.get("summary") or "") if multigran else None,
            (s.get("keywords") or "") if multigran else None,
            s.get("cards"),  # memgas-cards' reader: the lines of the cards that ranked the session
        )
        for s in chosen
    ]
    cut = False
    while blocks:
        text = "".join(blocks)
        if llm.count_tokens(text) <= budget:
            return text, len(blocks), cut
        cut = True
        if len(blocks) == 1:
            return _cut_head(llm, text, budget), 1, True
        blocks.pop()  # lowest-ranked first
    return "", 0, cut


class TokenCounter(Protocol):
    """What fitting a context needs of the reader: its window and its token count (an :class:`LLM` is one;
    the evaluation passes a counter without a model, jobs/evaluate_run.py: ``reader_evidence``)."""

    context_tokens: int

    def count_tokens(self, text: str) -> int: ...


def reading_context(llm: TokenCounter, q: dict[str, Any], cfg: ReadingConfig, *,
                    filter_max_tokens: int = DEFAULT_FILTER_MAX_TOKENS) -> tuple[str, int, bool]:
    """The context of the reader's first step for query ``q`` (the filter's when ``cfg.filter``, else the
    answer's): its top-K sessions within the window left by that step's template and output budget, as
    :func:`build_context` returns it ``(text, sessions kept, cut?)``."""
    window = min(cfg.context_tokens, llm.context_tokens)
    tmpl = (filter_prompt if cfg.filter else answer_prompt)("", q["question"], q.get("question_date"))
    max_new = filter_max_tokens if cfg.filter else cfg.max_new_tokens
    budget = window - max_new - MARGIN - llm.count_tokens(tmpl[0]["content"])
    return build_context(llm, q.get("sessions") or [], top_k=cfg.top_k, budget=budget, multigran=cfg.filter)


#: What precedes a session's text in its block (:func:`memgas.pipeline.prompts.session_block`).
_CONTENT_HEAD = "Session Content:\n"


def context_turn_keys(sessions: Sequence[dict[str, Any]], text: str, kept: int,
                      turn_lengths: Sequence[Sequence[int]]) -> list[tuple[str, int]]:
    """The utterances ``(session_id, turn_index)`` in a context :func:`build_context` returned (``text``,
    ``kept``): every turn of the first ``kept`` sessions, except when the top session alone was cut at its
    head, then the turns whose whole line is in the kept text. ``turn_lengths[i]``: the characters of each
    rendered utterance of ``sessions[i]`` (``[role]: content``; a session text is those lines joined by
    newlines, pipeline/data/common.py)."""
    keys: list[tuple[str, int]] = []
    for i, s in enumerate(sessions[:kept]):
        lengths, body = list(turn_lengths[i]), s.get("text") or ""
        if sum(lengths) + max(len(lengths) - 1, 0) != len(body):
            raise ValueError(f"session {s.get('session_id')!r}: its turns do not render to its text "
                             f"({sum(lengths) + max(len(lengths) - 1, 0)} characters, the text has {len(body)})")
        # the text starts after the block's header (memgas-cards: and its cards' lines): searched from there, a
        # card that quotes the head is not taken for it
        start = len(session_block(s.get("date"), "", cards=s.get("cards"))) - len(_CONTENT_HEAD) - 1
        head = text.find(_CONTENT_HEAD, start) if kept == 1 else 0
        if head < 0:  # cut inside the session's header: none of its turns is there
            break
        end = head + len(_CONTENT_HEAD) if kept == 1 else 0
        for t, n in enumerate(lengths):
            end += n + (1 if t else 0)
            if kept == 1 and end > len(text):
                break  # a head cut: the rest of the session is not in the context
            keys.append((str(s.get("session_id")), t))
    return keys


#: Prefix of ``answers.error`` when the answer LLM call failed in the backend (retryable, not scored).
ANSWER_FAILED = "answer failed:"


def is_failed_answer(error: Any) -> bool:
    """An answer whose LLM call failed after the client's retries: kept out of QA metrics, retried next run.
    (``error`` may come from pandas, where a missing value is NaN.)"""
    return isinstance(error, str) and ANSWER_FAILED in error


def reading_payloads(bank: Any, rankings: pa.Table, query_ids: Sequence[str], *,
                     generation_key: tuple[str, str] | None) -> list[dict[str, Any]]:
    """Inputs of the reading step: per query (in ``query_ids`` order) its ranked sessions (``rankings`` holds
    the top-K of one method) with date, text, summary and keywords (generations under ``generation_key``; None:
    without summaries and keywords)."""
    import pyarrow.compute as pc

    queries = bank.read("queries", ["query_id", "history_id", "question", "question_date_raw"],
                        filter=pc.field("query_id").isin(list(query_ids))).to_pandas().set_index("query_id")
    rk = rankings.to_pandas()
    rk = rk[rk["query_id"].isin(query_ids)].sort_values(["query_id", "rank"])
    top = {q: g["session_id"].tolist() for q, g in rk.groupby("query_id")}
    hids = sorted(set(queries["history_id"]))
    # only the ranked sessions of the histories: a history has hundreds, a query reads its top K (a row tuple
    # per session of every history, and their texts and generations, were most of the evaluate report's time)
    ranked = sorted({sid for ids in top.values() for sid in ids})
    sessions = bank.read("sessions", ["history_id", "session_id", "date_raw", "text_hash"],
                         filter=pc.field("history_id").isin(hids) & pc.field("session_id").isin(ranked)).to_pandas()
    hashes = sorted(set(sessions["text_hash"]))
    gen: dict[tuple[str, str], Any] = {}
    if generation_key is not None:  # None: a caller that does not read the generations (no summaries)
        model, version = generation_key
        gens = bank.read("generations", ["text_hash", "kind", "output"],
                         filter=(pc.field("model") == model) & (pc.field("prompt_version") == version)
                         & pc.field("text_hash").isin(hashes)).to_pandas()
        gen = {(h, k): o for h, k, o in gens.itertuples(index=False)}
    texts = bank.read("texts", ["text_hash", "text"], filter=pc.field("text_hash").isin(hashes)).to_pandas()
    text = dict(zip(texts["text_hash"], texts["text"]))
    info = {(r.history_id, r.session_id): r for r in sessions.itertuples(index=False)}
    payload = []
    for qid in query_ids:
        q = queries.loc[qid]
        sess = []
        for sid in top.get(qid, []):
            s = info[(q.history_id, sid)]
            sess.append({"session_id": sid, "date": s.date_raw, "text": text.get(s.text_hash, ""),
                         "summary": gen.get((s.text_hash, "summary"), ""),
                         "keywords": gen.get((s.text_hash, "keywords"), "")})
        payload.append({"query_id": qid, "question": q.question, "question_date": q.question_date_raw, "sessions": sess})
    return payload


def read_and_answer(
    queries: Sequence[dict[str, Any]],
    llm: LLM,
    cfg: ReadingConfig,
    method: str,
    *,
    ledger: TokenLedger | None = None,
    filter_max_tokens: int = DEFAULT_FILTER_MAX_TOKENS,
    temperature: float = 0.0,
    seed: int = 0,
) -> pa.Table:
    """Answer ``queries``: dicts with ``query_id``, ``question``, ``question_date`` and ``sessions`` = the
    retrieved sessions in rank order, each ``{session_id, date, text, summary, keywords}``.

    Returns an ``ANSWERS`` table (one row per query, input order).
    """
    reader = _Reader(llm, cfg, ledger, filter_max_tokens, temperature, seed)
    rows = [_answer_row(method, q, cfg.top_k) for q in queries]
    errors: list[list[str]] = [[] for _ in queries]
    contexts = reader.contexts(queries, errors)
    answer_ctx = reader.filter(queries, contexts, rows, errors) if cfg.filter else list(contexts)
    n_fail = reader.answer(queries, answer_ctx, rows, errors)
    for row, errs in zip(rows, errors):
        row["error"] = "; ".join(errs) if errs else None
    if ledger is not None:
        ledger.count("reading-answer", "context_cut", reader.n_cut)
        ledger.count("reading-answer", "unanswered", n_fail)
    log.info("reading: %d queries answered, %d failed, %d contexts cut", len(queries) - n_fail, n_fail, reader.n_cut)
    return pa.Table.from_pylist(rows, schema=ANSWERS)


def _answer_row(method: str, q: dict[str, Any], top_k: int) -> dict[str, Any]:
    return {"method": method, "query_id": str(q["query_id"]),
            "retrieved_session_ids": [str(s.get("session_id")) for s in (q.get("sessions") or [])[:top_k]],
            "filtered_context": None, "hypothesis": None, "prompt_tokens": 0, "completion_tokens": 0, "error": None}


class _Reader:
    """The three reading steps over a batch of queries: fit contexts, filter (optional), answer."""

    def __init__(self, llm: LLM, cfg: ReadingConfig, ledger: TokenLedger | None, filter_max_tokens: int,
                 temperature: float, seed: int) -> None:
        self.llm, self.cfg, self.ledger = llm, cfg, ledger
        self.filter_max_tokens, self.temperature, self.seed = filter_max_tokens, temperature, seed
        self.window = min(cfg.context_tokens, llm.context_tokens)
        self.n_cut = 0

    def _budget(self, template_prompt: list, max_new: int) -> int:
        return self.window - max_new - MARGIN - self.llm.count_tokens(template_prompt[0]["content"])

    def _params(self, max_tokens: int) -> SamplingParams:
        return SamplingParams(max_tokens=max_tokens, temperature=self.temperature, seed=self.seed)

    def contexts(self, queries: Sequence[dict[str, Any]], errors: list[list[str]]) -> list[str]:
        """Per query, its sessions fitted to the window (with summaries/keywords for the filter step)."""
        out = []
        for i, q in enumerate(queries):
            text, kept, cut = reading_context(self.llm, q, self.cfg, filter_max_tokens=self.filter_max_tokens)
            if cut:
                self.n_cut += 1
                log.info("reading: query %s context cut to %d sessions to fit %d tokens", q["query_id"], kept,
                         self.window)
                errors[i].append(f"context cut to {kept} session(s)")  # noted, not a failure
            out.append(text)
        return out

    def filter(self, queries: Sequence[dict[str, Any]], contexts: list[str], rows: list[dict], errors: list[list[str]]) -> list[str]:
        """The filter prompt, batched; a failed or unusable filter output falls back to the unfiltered context."""
        prompts = [filter_prompt(contexts[i], q["question"], q.get("question_date")) for i, q in enumerate(queries)]
        out = list(contexts)
        res = generate_batch(self.llm, prompts, self._params(self.filter_max_tokens), self.ledger, "reading-filter")
        for i, r in enumerate(res):
            rows[i]["prompt_tokens"] += r.prompt_tokens
            rows[i]["completion_tokens"] += r.completion_tokens
            text = clean_answer(r.text) if r.error is None else ""
            if r.error is not None:
                errors[i].append(f"filter failed ({r.error}); unfiltered context used")
            elif not usable(text):
                errors[i].append("filter output unusable; unfiltered context used")
            else:
                out[i] = text
        return out

    def answer(self, queries: Sequence[dict[str, Any]], contexts: list[str], rows: list[dict], errors: list[list[str]]) -> int:
        """The answer prompt, batched (context re-fitted: its template differs); returns failed answers."""
        cfg, prompts = self.cfg, []
        for i, q in enumerate(queries):
            budget = self._budget(answer_prompt("", q["question"], q.get("question_date")), cfg.max_new_tokens)
            if self.llm.count_tokens(contexts[i]) > budget:
                contexts[i] = _cut_head(self.llm, contexts[i], budget)
                self.n_cut += 1
                errors[i].append("answer context cut")
            rows[i]["filtered_context"] = contexts[i]
            prompts.append(answer_prompt(contexts[i], q["question"], q.get("question_date")))
        n_fail = 0
        for i, r in enumerate(generate_batch(self.llm, prompts, self._params(cfg.max_new_tokens), self.ledger,
                                             "reading-answer")):
            rows[i]["prompt_tokens"] += r.prompt_tokens
            rows[i]["completion_tokens"] += r.completion_tokens
            rows[i]["hypothesis"] = ""
            if r.error is not None:
                errors[i].append(f"{ANSWER_FAILED} {r.error}")
                n_fail += 1
                continue
            text, limit = r.text, ANSWER_CHARS_PER_TOKEN * cfg.max_new_tokens
            if len(text) > limit:
                errors[i].append(f"answer cut to {limit} characters (the backend returned {len(text)} for "
                                 f"max_new_tokens {cfg.max_new_tokens})")  # noted, not a failure
                text = text[:limit]
            ans = clean_answer(text)
            if usable(ans):
                rows[i]["hypothesis"] = ans
            else:
                errors[i].append(f"answer unusable: {r.text[:80]!r}")
                n_fail += 1
        return n_fail
