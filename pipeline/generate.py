"""Multi-granularity generation: a summary and a keyword list per unique session (DESIGN.md §3.1).

Cache key: ``(session text_hash, kind, model, prompt_version)`` in the ``generations`` table, shared by all
histories, so a LongMemEval session that appears in 500 haystacks is summarised once, and a re-run
generates nothing. The key a config writes under is the generate stage's (``jobs/keys.py``:
``prompt_version@cache_key``, the cache key hashing every setting that can change an output).

Generators (``GenerationConfig.generator``):

* ``llm``: the LLM; an unusable output is stored with ``error`` set and an empty ``output``.
* ``llm+fallback``: the LLM; an unusable output is replaced by the LLM-free output, ``fallback`` names
  the LLM-free generator and why (rows stay under the LLM's key so lookups are uniform).
* ``llm-free``: tf-idf keyphrases and a tf-idf/MMR extractive summary, no LLM and no encoder pass
  (model = ``llm-free/tfidf``; see :mod:`memgas.pipeline.llm_free`).

``summary_source: dataset`` uses ``sessions.dataset_summary`` (LoCoMo's GPT summaries) where present
(a declared field of the stage, so these rows never share a key with generated ones).

Every derived text (summary output, keywords output, and the hybrid "summary keywords session" text) is
added to ``texts`` by hash, so the encoding stage can embed it like any other text.
"""

from __future__ import annotations

import hashlib
import logging
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from memgas.pipeline.accounting import TokenLedger
from memgas.pipeline.config import GenerationConfig
from memgas.pipeline.hashing import text_hash
from memgas.pipeline.justmem.structured import parse_json_object, strip_code_fences
from memgas.pipeline.llm_calls import generate_batch
from memgas.pipeline.llm_free import LLM_FREE_NAME, LLMFreeGenerator
from memgas.pipeline.models.base import LLM, GenerationResult, SamplingParams
from memgas.pipeline.prompts import (
    PROMPT_SETS,
    USER_ASSISTANT,
    USER_USER,
    PromptSet,
    subject_phrase,
    dialogue_kind_for,
    get_prompt_set,
)
from memgas.pipeline.schema import GENERATIONS, TEXTS

log = logging.getLogger(__name__)

#: Prompts per ``llm.generate`` call: big enough for the backend's own batching, small enough for progress.
CHUNK = 64
#: Tokens kept free in the context beside the session (template + chat template + safety margin).
_TEMPLATE_MARGIN = 64

# --------------------------------------------------------------------------------------------------
# Keys and helpers
# --------------------------------------------------------------------------------------------------


def slug(s: str) -> str:
    return re.sub(r"[^A-Za-z0-9.+-]+", "-", s).strip("-")[:60] or "x"


def digest(items: Sequence[str]) -> str:
    h = hashlib.blake2b(digest_size=8)
    for it in items:
        h.update(it.encode("utf-8", "surrogatepass"))
        h.update(b"\0")
    return h.hexdigest()


def hybrid_text(summary: str, keywords: str, session: str) -> str:
    """The hybrid baseline's single text (DESIGN.md §3.7): "summary keywords session"."""
    return f"{summary} {keywords} {session}"


# --------------------------------------------------------------------------------------------------
# Output cleaning and validation
# --------------------------------------------------------------------------------------------------

_ECHO_PREFIX_RE = re.compile(
    r"^\s*(?:(?:your\s+answer|answer|summary|keywords?|key\s*words|json|output)\s*[:：]\s*)+", re.IGNORECASE
)
_BULLET_RE = re.compile(r"^\s*(?:[-*•·‣▪◦>]+|\(?\d{1,3}[.)])\s*")
_SPEAKER_LINE_RE = re.compile(r"^\s*\[?[^\]\n:]{1,40}\]?:\s+\S")
# Lines that start a re-echo of the prompt: cut the output there.
_PROMPT_ECHO_MARKERS = ("Below is an ", "<dialogue>", "</dialogue>", "Your answer:")

# Keyword items that are markup or delimiters (``<<user-user dialogue>>``, ``<|im_end|>``, ``{...}``, ``[x]``).
_KEYWORD_MARKUP_RE = re.compile(r"[<>{}\[\]|\\`]|&[a-z]+;")
# Single-word items that only echo the prompt's cues.
_KEYWORD_CUE_WORDS = frozenset(
    {"your answer", "answer", "keywords", "keyword", "key words", "summary", "dialogue", "json", "output",
     "none", "n/a", "semicolon", "semicolons"}
)
_NON_ALNUM_RE = re.compile(r"[\W_]+", re.UNICODE)
_prompt_wording_cache: tuple[str, ...] | None = None

MAX_SUMMARY_CHARS = 2000
MAX_KEYWORDS = 20
MAX_KEYWORD_WORDS = 6
MAX_KEYWORD_CHARS = 60


def strip_echo(raw: str) -> str:
    """Remove code fences, leading cues ("Your answer:", "Summary:") and anything after a prompt echo."""
    text = strip_code_fences(raw or "")
    text = _ECHO_PREFIX_RE.sub("", text).strip()
    for marker in _PROMPT_ECHO_MARKERS:
        i = text.find(marker)
        if i >= 0:
            text = text[:i].strip()
    return text.strip().strip('"').strip()


def _letter_ratio(text: str) -> float:
    chars = [c for c in text if not c.isspace()]
    if not chars:
        return 0.0
    return sum(c.isalpha() for c in chars) / len(chars)


def _norm_ws(text: str) -> str:
    return " ".join(text.split())


def clean_summary(raw: str, session_text: str = "") -> tuple[str, str | None]:
    """``(summary, None)`` when usable, else ``("", reason)``."""
    text = _norm_ws(strip_echo(raw))
    if not text:
        return "", "empty"
    if text.lower().rstrip(".:") in {"your answer", "answer", "summary", "none", "n/a"}:
        return "", "echo of the answer cue"
    if len(text) < 12:
        return "", "too short"
    if _letter_ratio(text) < 0.5:
        return "", "garbage (few letters)"
    words = text.split()
    if len(words) >= 20 and len(set(w.lower() for w in words)) / len(words) < 0.25:
        return "", "garbage (repetitive)"
    lines = [ln for ln in (raw or "").strip().splitlines() if ln.strip()]
    if len(lines) >= 2 and sum(bool(_SPEAKER_LINE_RE.match(ln)) for ln in lines) / len(lines) > 0.5:
        return "", "continues the dialogue"
    probe = _norm_ws(session_text)
    if len(text) >= 40 and probe and text[:200] in probe:
        return "", "echo of the dialogue"
    if len(text) > MAX_SUMMARY_CHARS:
        text = text[:MAX_SUMMARY_CHARS].rsplit(" ", 1)[0]
    return text, None


def _norm_words(text: str) -> str:
    """Lower-case words only (punctuation and markup become spaces), padded with spaces for phrase search."""
    return f" {' '.join(_NON_ALNUM_RE.sub(' ', text.lower()).split())} "


def _prompt_wording() -> tuple[str, ...]:
    """Every generation instruction and cue (both dialogue kinds), as ``_norm_words`` strings."""
    global _prompt_wording_cache
    if _prompt_wording_cache is None:
        texts: list[str] = []
        for ps in PROMPT_SETS.values():
            for instr in (ps.summary_instruction, ps.keywords_instruction, ps.joint_instruction):
                for kind in (USER_ASSISTANT, USER_USER):
                    texts.append(instr.format(subject=subject_phrase(kind)))
            texts += [ps.summary_cue, ps.keywords_cue, ps.joint_cue]
        _prompt_wording_cache = tuple(_norm_words(t) for t in texts)
    return _prompt_wording_cache


def is_prompt_echo_keyword(item: str) -> bool:
    """True for a keyword that is markup/a delimiter or only repeats the prompt's wording
    ("<<user-user dialogue>>", "Your answer:", "dialogue memory", "most relevant keywords")."""
    if _KEYWORD_MARKUP_RE.search(item):
        return True
    words = _norm_words(item)
    if not words.strip():
        return True
    if words.strip() in _KEYWORD_CUE_WORDS:
        return True
    # a phrase of two or more words lifted from an instruction or cue
    return len(words.split()) >= 2 and any(words in w for w in _prompt_wording())


def split_keywords(raw: str) -> list[str]:
    """Split a keyword answer on ';' (the asked separator), else newlines, else commas; clean each item."""
    text = strip_echo(raw)
    if ";" in text:
        items = text.split(";")
    elif "\n" in text.strip():
        items = text.splitlines()
    else:
        items = text.split(",")
    out: list[str] = []
    seen: set[str] = set()
    for it in items:
        it = _BULLET_RE.sub("", it)
        it = _ECHO_PREFIX_RE.sub("", it)
        it = _norm_ws(it).strip(" \t\"'`.,:;!?()[]{}").strip("*_~").lstrip("#").strip().lower()
        if not it or it in seen:
            continue
        if is_prompt_echo_keyword(it):
            continue
        if len(it) > MAX_KEYWORD_CHARS or len(it.split()) > MAX_KEYWORD_WORDS:
            continue
        if _letter_ratio(it) < 0.5:
            continue
        seen.add(it)
        out.append(it)
        if len(out) >= MAX_KEYWORDS:
            break
    return out


def clean_keywords(raw: str) -> tuple[str, str | None]:
    """``("a; b; c", None)`` when usable, else ``("", reason)``."""
    if not strip_echo(raw):
        return "", "empty"
    items = split_keywords(raw)
    if not items:
        return "", "no usable keyword"
    return "; ".join(items), None


def parse_joint(raw: str) -> tuple[str, str]:
    """Robustly parse ``{"summary": ..., "keywords": [...]}`` from a model's answer.

    Tolerates code fences, text around the object and keywords given as one string; bounded like every LLM
    reply (size, depth, linear time: justmem/structured.py). Raises ValueError.
    """
    obj = parse_json_object(raw)
    lower = {str(k).lower(): v for k, v in obj.items()}
    summary = lower.get("summary", "")
    kws = lower.get("keywords", lower.get("keyword", ""))
    if isinstance(kws, list):
        kws = "; ".join(str(k) for k in kws)
    return str(summary or ""), str(kws or "")


# --------------------------------------------------------------------------------------------------
# Generation over items
# --------------------------------------------------------------------------------------------------


@dataclass
class _Item:
    text_hash: str
    text: str
    dialogue_kind: str
    dataset_summary: str | None = None
    llm_text: str = ""
    truncated: bool = False


def _truncate_for(llm: LLM, text: str, max_tokens: int) -> tuple[str, bool]:
    """Keep the head of ``text`` within ``max_tokens`` tokens of ``llm``'s tokenizer (by char ratio, rechecked)."""
    if not text:
        return text, False
    n = llm.count_tokens(text)
    if n <= max_tokens:
        return text, False
    cut = text
    for _ in range(6):
        keep = int(len(cut) * max_tokens / max(n, 1) * 0.97)
        cut = cut[: max(keep, 0)]
        n = llm.count_tokens(cut)
        if n <= max_tokens:
            break
    return cut, True


def _row(
    it: _Item,
    kind: str,
    model: str,
    version: str,
    output: str,
    raw: str | None,
    res: GenerationResult | None,
    fallback: str | None,
    error: str | None,
) -> dict[str, Any]:
    return {
        "text_hash": it.text_hash,
        "kind": kind,
        "model": model,
        "prompt_version": version,
        "output": output,
        "raw_output": raw,
        "prompt_tokens": res.prompt_tokens if res else None,
        "completion_tokens": res.completion_tokens if res else None,
        "input_truncated": it.truncated,
        "fallback": fallback,
        "error": error,
    }


def _from_dataset(its: Sequence[_Item], kinds: Sequence[str], model: str, version: str) -> dict[tuple[int, str], dict]:
    """``summary_source: dataset``: the dataset's own summaries (LoCoMo's GPT summaries) where present."""
    if "summary" not in kinds:
        return {}
    return {(i, "summary"): _row(it, "summary", model, version, _norm_ws(it.dataset_summary or ""), it.dataset_summary,
                                 None, None, None)
            for i, it in enumerate(its) if it.dataset_summary and it.dataset_summary.strip()}


def _llm_jobs(its: Sequence[_Item], kinds: Sequence[str], cfg: GenerationConfig, outputs: dict, model: str,
              version: str) -> list[tuple[int, str]]:
    """Which (item, kind) go to the LLM ("joint" for single-call JSON mode); empty sessions never do."""
    jobs: list[tuple[int, str]] = []
    for i, it in enumerate(its):
        if not it.text.strip():
            for k in kinds:
                outputs.setdefault((i, k), _row(it, k, model, version, "", None, None, None, "empty session text"))
            continue
        if cfg.single_call:
            if any((i, k) not in outputs for k in kinds):
                jobs.append((i, "joint"))
        else:
            jobs.extend((i, k) for k in kinds if (i, k) not in outputs)
    return jobs


def _parse_llm_output(it: _Item, kind: str, r: GenerationResult, kinds: Sequence[str]) -> dict[str, tuple[str, str | None]]:
    """{kind: (cleaned output, why unusable or None)} for one LLM result (one kind, or all in JSON mode)."""
    if r.error is not None:
        return {k: ("", f"llm: {r.error}") for k in (kinds if kind == "joint" else [kind])}
    if kind == "joint":
        try:
            s_raw, k_raw = parse_joint(r.text)
        except ValueError as exc:
            return {k: ("", f"unusable: JSON: {exc}") for k in kinds}
        parsed = {"summary": clean_summary(s_raw, it.text), "keywords": clean_keywords(k_raw)}
    else:
        parsed = {kind: clean_summary(r.text, it.text) if kind == "summary" else clean_keywords(r.text)}
    return {k: (out, None if why is None else f"unusable: {why}") for k, (out, why) in parsed.items() if k in kinds}


def _llm_outputs(its: list[_Item], kinds: Sequence[str], llm: LLM, cfg: GenerationConfig, outputs: dict, model: str,
                 version: str, ledger: TokenLedger | None, temperature: float, seed: int) -> None:
    """Summaries/keywords by the LLM, truncating each session to the prompt budget; fills ``outputs``."""
    stage = "generation"
    pset: PromptSet = get_prompt_set(cfg.prompt_version)
    max_new = cfg.summary_max_tokens + cfg.keywords_max_tokens if cfg.single_call else max(
        cfg.summary_max_tokens, cfg.keywords_max_tokens)
    budget = min(cfg.max_input_tokens, llm.context_tokens - max_new - _TEMPLATE_MARGIN
                 - llm.count_tokens(pset.overhead("joint" if cfg.single_call else "summary")))
    budget = max(budget, 16)
    for it in its:
        it.llm_text, it.truncated = _truncate_for(llm, it.text, budget)
    n_trunc = sum(it.truncated for it in its)
    if n_trunc:
        log.warning("generation: %d of %d session texts truncated to %d tokens", n_trunc, len(its), budget)
        if ledger is not None:
            ledger.count(stage, "input_truncated", n_trunc)
    jobs = _llm_jobs(its, kinds, cfg, outputs, model, version)
    # one call per kind so each gets its own max_tokens
    for kind, max_tokens in (("summary", cfg.summary_max_tokens), ("keywords", cfg.keywords_max_tokens),
                             ("joint", cfg.summary_max_tokens + cfg.keywords_max_tokens)):
        idx = [i for i, k in jobs if k == kind]
        if not idx:
            continue
        prompts = [getattr(pset, kind)(its[i].llm_text, its[i].dialogue_kind) for i in idx]
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed)
        for i, r in zip(idx, generate_batch(llm, prompts, params, ledger, stage, chunk=CHUNK)):
            for k, (out, why) in _parse_llm_output(its[i], kind, r, kinds).items():
                outputs.setdefault((i, k), _row(its[i], k, model, version, out, r.text, r, None, why))


def _llm_free_outputs(its: list[_Item], kinds: Sequence[str], cfg: GenerationConfig, free: LLMFreeGenerator,
                      outputs: dict, model: str, version: str, ledger: TokenLedger | None) -> None:
    """LLM-free outputs for everything missing (llm-free) or every failed LLM row (llm+fallback)."""
    todo: dict[str, list[int]] = {k: [] for k in kinds}
    for i in range(len(its)):
        for k in kinds:
            row = outputs.get((i, k))
            if row is None or (cfg.generator == "llm+fallback" and row["error"] is not None):
                todo[k].append(i)
    if not any(todo.values()):
        return
    t0 = time.perf_counter()
    made = {"summary": free.summaries([its[i].text for i in todo.get("summary", [])]) if todo.get("summary") else [],
            "keywords": free.keywords([its[i].text for i in todo.get("keywords", [])]) if todo.get("keywords") else []}
    for k, vals in made.items():
        for i, val in zip(todo.get(k, []), vals):
            prev = outputs.get((i, k))
            err = None if val.strip() else "llm-free: empty output"
            if prev is None:  # llm-free generator
                outputs[(i, k)] = _row(its[i], k, model, version, val, None, None, None, err)
            else:  # fallback: keep the LLM's raw output and tokens for inspection
                prev.update(output=val, fallback=f"{LLM_FREE_NAME} ({prev['error']})", error=err)
    if ledger is not None:
        ledger.stage("generation-llm-free").wall_s += time.perf_counter() - t0
        ledger.count("generation-llm-free", "items", sum(len(v) for v in todo.values()))
        if cfg.generator == "llm+fallback":
            ledger.count("generation", "fallback", sum(len(v) for v in todo.values()))


def generate_for_sessions(
    items: Sequence[tuple],
    llm: LLM | None,
    cfg: GenerationConfig,
    *,
    key: tuple[str, str],
    kinds: Sequence[str] = ("summary", "keywords"),
    ledger: TokenLedger | None = None,
    llm_free: LLMFreeGenerator | None = None,
    temperature: float = 0.0,
    seed: int = 0,
) -> pa.Table:
    """Summaries and/or keywords for ``items`` = ``(text_hash, text, dialogue_kind[, dataset_summary])``,
    written under ``key`` = (model, prompt_version) (the generate stage's key, jobs/keys.py).

    Returns a ``GENERATIONS`` table with one row per (item, kind), in item order. Never raises for a bad
    item: LLM errors and unusable outputs are recorded per row (``error`` / ``fallback``).
    """
    model, version = key
    its = [_Item(t[0], t[1] or "", dialogue_kind_for(t[2] if len(t) > 2 else None), t[3] if len(t) > 3 else None)
           for t in items]
    kinds = [k for k in ("summary", "keywords") if k in kinds]
    outputs = _from_dataset(its, kinds, model, version) if cfg.summary_source == "dataset" else {}
    if cfg.generator != "llm-free":
        if llm is None:
            raise ValueError(f"generation.generator={cfg.generator!r} needs an LLM")
        _llm_outputs(its, kinds, llm, cfg, outputs, model, version, ledger, temperature, seed)
    if cfg.generator in ("llm-free", "llm+fallback"):
        _llm_free_outputs(its, kinds, cfg, llm_free or LLMFreeGenerator(None), outputs, model, version, ledger)
    rows = [outputs[(i, k)] for i in range(len(its)) for k in kinds if (i, k) in outputs]
    return pa.Table.from_pylist(rows, schema=GENERATIONS)


def derived_texts(generations: pa.Table, session_texts: dict[str, str] | None = None) -> pa.Table:
    """``TEXTS`` rows for every generation output and, where a session has both kinds, the hybrid text."""
    rows: dict[str, str] = {}
    by_session: dict[str, dict[str, str]] = {}
    for h, kind, out in zip(
        generations.column("text_hash").to_pylist(),
        generations.column("kind").to_pylist(),
        generations.column("output").to_pylist(),
    ):
        out = out or ""
        rows.setdefault(text_hash(out), out)
        by_session.setdefault(h, {})[kind] = out
    if session_texts is not None:
        for h, kinds in by_session.items():
            if "summary" in kinds and "keywords" in kinds and h in session_texts:
                hyb = hybrid_text(kinds["summary"], kinds["keywords"], session_texts[h])
                rows.setdefault(text_hash(hyb), hyb)
    ordered = sorted(rows.items())  # deterministic Parquet bytes
    return pa.Table.from_pylist([{"text_hash": h, "text": t} for h, t in ordered], schema=TEXTS)
