"""Multi-granularity generation: a summary and a keyword list per unique session (DESIGN.md §3.1).

Cache key: ``(session text_hash, kind, model, prompt_version)`` in the ``generations`` table, shared by all
histories, so a LongMemEval session that appears in 500 haystacks is summarised once, and a re-run
generates nothing. :func:`generation_key` gives the ``(model, prompt_version)`` a config writes under;
the granularity stage must read with the same key.

Generators (``GenerationConfig.generator``):

* ``llm``: the LLM; an unusable output is stored with ``error`` set and an empty ``output``.
* ``llm+fallback``: the LLM; an unusable output is replaced by the LLM-free output, ``fallback`` names
  the LLM-free generator and why (rows stay under the LLM's key so lookups are uniform).
* ``llm-free``: YAKE + centroid sentences, no LLM (model = ``llm-free/yake+centroid``).

``summary_source: dataset`` uses ``sessions.dataset_summary`` (LoCoMo's GPT summaries) where present; the
prompt version then gets a ``+dsum`` suffix so these rows never mix with generated ones. Single-call JSON
mode adds ``+json``.

Every derived text (summary output, keywords output, and the hybrid "summary keywords session" text) is
added to ``texts`` by hash, so the encoding stage can embed it like any other text.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from memgas.pipeline.accounting import TokenLedger
from memgas.pipeline.bank import Bank
from memgas.pipeline.config import GenerationConfig
from memgas.pipeline.errors import BankError
from memgas.pipeline.hashing import text_hash
from memgas.pipeline.llm_free import LLM_FREE_NAME, LLM_FREE_VERSION, LLMFreeGenerator
from memgas.pipeline.models.base import LLM, ChatPrompt, Encoder, GenerationResult, SamplingParams
from memgas.pipeline.prompts import (
    PROMPT_SETS,
    USER_ASSISTANT,
    USER_USER,
    PromptSet,
    _subject,
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


def generation_key(cfg: GenerationConfig, llm: LLM | None) -> tuple[str, str]:
    """``(model, prompt_version)`` under which ``cfg`` stores (and the nodes stage reads) generations."""
    if cfg.generator == "llm-free":
        model, version = LLM_FREE_NAME, LLM_FREE_VERSION
    else:
        if llm is None:
            raise ValueError(f"generation.generator={cfg.generator!r} needs an LLM")
        model, version = llm.name, get_prompt_set(cfg.prompt_version).version
        if cfg.single_call:
            version += "+json"
    if cfg.summary_source == "dataset":
        version += "+dsum"
    return model, version


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
_FENCE_RE = re.compile(r"^\s*```[a-zA-Z]*\s*|\s*```\s*$")
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
    text = _FENCE_RE.sub("", raw or "").strip()
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
                    texts.append(instr.format(subject=_subject(kind)))
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

    Tolerates code fences, text around the object and keywords given as one string. Raises ValueError.
    """
    text = _FENCE_RE.sub("", raw or "").strip()
    start = text.find("{")
    if start < 0:
        raise ValueError("no JSON object")
    obj: Any = None
    dec = json.JSONDecoder()
    # try every '{' from the first: the model may prefix prose containing braces
    for m in re.finditer(r"\{", text[start:]):
        try:
            obj, _ = dec.raw_decode(text[start + m.start() :])
            if isinstance(obj, dict):
                break
        except json.JSONDecodeError:
            continue
    if not isinstance(obj, dict):
        raise ValueError("no parseable JSON object")
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


def _call(
    llm: LLM, prompts: list[ChatPrompt], params: SamplingParams, ledger: TokenLedger | None, stage: str
) -> list[GenerationResult]:
    out: list[GenerationResult] = []
    for i in range(0, len(prompts), CHUNK):
        chunk = prompts[i : i + CHUNK]
        t0 = time.perf_counter()
        try:
            res = llm.generate(chunk, params)
        except Exception as exc:  # a backend that raises must not sink the whole stage: record per item
            log.error("LLM batch of %d prompts failed: %s", len(chunk), exc)
            res = [GenerationResult(error=f"llm: {type(exc).__name__}: {exc}") for _ in chunk]
        if len(res) != len(chunk):
            log.error("LLM returned %d results for %d prompts", len(res), len(chunk))
            res = [GenerationResult(error="llm: result count mismatch") for _ in chunk]
        if ledger is not None:
            ledger.record(stage, res, time.perf_counter() - t0)
        out.extend(res)
        log.info("generation: %d/%d prompts", min(i + CHUNK, len(prompts)), len(prompts))
    return out


def generate_for_sessions(
    items: Sequence[tuple],
    llm: LLM | None,
    cfg: GenerationConfig,
    encoder: Encoder | None = None,
    *,
    kinds: Sequence[str] = ("summary", "keywords"),
    ledger: TokenLedger | None = None,
    llm_free: LLMFreeGenerator | None = None,
) -> pa.Table:
    """Summaries and/or keywords for ``items`` = ``(text_hash, text, dialogue_kind[, dataset_summary])``.

    Returns a ``GENERATIONS`` table with one row per (item, kind), in item order. Never raises for a bad
    item: LLM errors and unusable outputs are recorded per row (``error`` / ``fallback``).
    """
    model, version = generation_key(cfg, llm)
    its = [
        _Item(t[0], t[1] or "", dialogue_kind_for(t[2] if len(t) > 2 else None), t[3] if len(t) > 3 else None)
        for t in items
    ]
    kinds = [k for k in ("summary", "keywords") if k in kinds]
    stage = "generation"
    use_llm = cfg.generator != "llm-free"
    need_free = cfg.generator in ("llm-free", "llm+fallback")
    free = llm_free or (LLMFreeGenerator(encoder) if need_free else None)

    # dataset summaries replace the summary generation where present
    from_dataset = {
        i
        for i, it in enumerate(its)
        if cfg.summary_source == "dataset" and it.dataset_summary and it.dataset_summary.strip()
    }

    outputs: dict[tuple[int, str], dict[str, Any]] = {}
    for i in from_dataset:
        if "summary" in kinds:
            outputs[(i, "summary")] = _row(its[i], "summary", model, version, _norm_ws(its[i].dataset_summary or ""),
                                           its[i].dataset_summary, None, None, None)

    if use_llm:
        assert llm is not None
        pset: PromptSet = get_prompt_set(cfg.prompt_version)
        max_new = max(cfg.summary_max_tokens, cfg.keywords_max_tokens)
        if cfg.single_call:
            max_new = cfg.summary_max_tokens + cfg.keywords_max_tokens
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

        # which (item, kind) go to the LLM; empty sessions never do (nothing to summarise)
        jobs: list[tuple[int, str]] = []
        for i, it in enumerate(its):
            if not it.text.strip():
                for k in kinds:
                    if (i, k) not in outputs:
                        outputs[(i, k)] = _row(it, k, model, version, "", None, None, None, "empty session text")
                continue
            if cfg.single_call:
                if any((i, k) not in outputs for k in kinds):
                    jobs.append((i, "joint"))
            else:
                jobs.extend((i, k) for k in kinds if (i, k) not in outputs)

        prompts = [getattr(pset, k)(its[i].llm_text, its[i].dialogue_kind) for i, k in jobs]
        # one call per kind so each gets its own max_tokens
        results: dict[tuple[int, str], GenerationResult] = {}
        for kind, max_tokens in (
            ("summary", cfg.summary_max_tokens),
            ("keywords", cfg.keywords_max_tokens),
            ("joint", cfg.summary_max_tokens + cfg.keywords_max_tokens),
        ):
            idx = [j for j, (_, k) in enumerate(jobs) if k == kind]
            if not idx:
                continue
            res = _call(llm, [prompts[j] for j in idx], SamplingParams(max_tokens=max_tokens), ledger, stage)
            for j, r in zip(idx, res):
                results[jobs[j]] = r

        for (i, kind), r in results.items():
            it = its[i]
            if kind == "joint":
                if r.error is not None:
                    parsed: dict[str, tuple[str, str | None]] = {k: ("", f"llm: {r.error}") for k in kinds}
                else:
                    try:
                        s_raw, k_raw = parse_joint(r.text)
                        parsed = {"summary": clean_summary(s_raw, it.text), "keywords": clean_keywords(k_raw)}
                    except ValueError as exc:
                        parsed = {k: ("", f"unusable: JSON: {exc}") for k in kinds}
                for k in kinds:
                    if (i, k) in outputs:
                        continue
                    out, why = parsed[k]
                    if why is not None and not why.startswith(("llm:", "unusable:")):
                        why = f"unusable: {why}"
                    outputs[(i, k)] = _row(it, k, model, version, out, r.text, r, None, why)
                continue
            if r.error is not None:
                out, why = "", f"llm: {r.error}"
            elif kind == "summary":
                out, why = clean_summary(r.text, it.text)
                why = None if why is None else f"unusable: {why}"
            else:
                out, why = clean_keywords(r.text)
                why = None if why is None else f"unusable: {why}"
            outputs[(i, kind)] = _row(it, kind, model, version, out, r.text, r, None, why)

    # LLM-free: everything (llm-free), or the failed rows (llm+fallback)
    if free is not None:
        todo: dict[str, list[int]] = {k: [] for k in kinds}
        for i, it in enumerate(its):
            for k in kinds:
                row = outputs.get((i, k))
                if row is None or (cfg.generator == "llm+fallback" and row["error"] is not None):
                    todo[k].append(i)
        if any(todo.values()):
            t0 = time.perf_counter()
            sums = free.summaries([its[i].text for i in todo.get("summary", [])]) if todo.get("summary") else []
            kws = free.keywords([its[i].text for i in todo.get("keywords", [])]) if todo.get("keywords") else []
            for k, vals in (("summary", sums), ("keywords", kws)):
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
                    ledger.count(stage, "fallback", sum(len(v) for v in todo.values()))

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


# --------------------------------------------------------------------------------------------------
# Bank stage
# --------------------------------------------------------------------------------------------------


def _read_texts(bank: Bank, hashes: Sequence[str]) -> dict[str, str]:
    if not hashes:
        return {}
    t = bank.read("texts", ["text_hash", "text"], filter=pc.field("text_hash").isin(list(hashes)))
    return dict(zip(t.column("text_hash").to_pylist(), t.column("text").to_pylist()))


def run_generation(
    bank: Bank,
    llm: LLM | None,
    encoder: Encoder | None,
    cfg: GenerationConfig,
    *,
    dataset_kind: str,
    ledger: TokenLedger | None = None,
    retry_llm_errors: bool = True,
) -> dict[str, Any]:
    """Generate what is missing in ``generations`` for every unique session of the bank; write one part.

    ``dataset_kind``: a dataset name or dialogue kind ("locomo" -> user-user prompts). Rows whose
    ``error`` came from the LLM backend (``llm: ...``: timeouts, HTTP errors) are retried when
    ``retry_llm_errors``; unusable outputs are deterministic and are not retried.
    Returns stats (also suitable for the manifest).
    """
    t0 = time.perf_counter()
    model, version = generation_key(cfg, llm)
    sessions = bank.read("sessions", ["history_id", "session_id", "text_hash", "dataset_summary"])
    dsum: dict[str, str | None] = {}
    for h, s in zip(sessions.column("text_hash").to_pylist(), sessions.column("dataset_summary").to_pylist()):
        if h not in dsum or (dsum[h] is None and s):
            dsum[h] = s
    unique = sorted(dsum)

    have: dict[str, set[str]] = {}
    if bank.exists("generations"):
        g = bank.read(
            "generations",
            ["text_hash", "kind", "error"],
            filter=(pc.field("model") == model) & (pc.field("prompt_version") == version),
        )
        for h, k, e in zip(g.column("text_hash").to_pylist(), g.column("kind").to_pylist(), g.column("error").to_pylist()):
            if retry_llm_errors and e is not None and e.startswith("llm:"):
                continue
            have.setdefault(h, set()).add(k)
    missing = {h: [k for k in ("summary", "keywords") if k not in have.get(h, set())] for h in unique}
    missing = {h: ks for h, ks in missing.items() if ks}
    stats: dict[str, Any] = {
        "model": model,
        "prompt_version": version,
        "generator": cfg.generator,
        "sessions": len(unique),
        "cached": len(unique) - len(missing),
        "generated": 0,
    }
    if not missing:
        log.info("generation: all %d sessions cached for %s / %s", len(unique), model, version)
        stats["wall_s"] = round(time.perf_counter() - t0, 3)
        return stats

    texts = _read_texts(bank, list(missing))
    absent = [h for h in missing if h not in texts]
    if absent:
        sid = sessions.filter(pc.field("text_hash") == absent[0])
        where = f"history {sid['history_id'][0]} session {sid['session_id'][0]}" if sid.num_rows else absent[0]
        raise BankError(
            f"{bank.path}: {len(absent)} session texts missing from table 'texts' (first: {where}, "
            f"text_hash {absent[0]}); re-run `memgas ingest`"
        )
    dk = dialogue_kind_for(dataset_kind)
    tables: list[pa.Table] = []
    # group by the kinds still missing so a half-cached session only regenerates what it lacks
    groups: dict[tuple[str, ...], list[str]] = {}
    for h, ks in missing.items():
        groups.setdefault(tuple(ks), []).append(h)
    for ks, hs in sorted(groups.items()):
        items = [(h, texts[h], dk, dsum.get(h)) for h in hs]
        tables.append(generate_for_sessions(items, llm, cfg, encoder, kinds=ks, ledger=ledger))
    gen = pa.concat_tables(tables)
    keys = sorted(f"{h}:{k}" for h, ks in missing.items() for k in ks)
    part = f"gen-{slug(model)}-{slug(version)}-{digest(keys)}"
    bank.write_part("generations", part, gen, info={"model": model, "prompt_version": version})

    # derived texts: outputs of the new rows + hybrids of every touched session (both kinds now present)
    touched = sorted(missing)
    both = bank.read(
        "generations",
        ["text_hash", "kind", "output"],
        filter=(pc.field("model") == model) & (pc.field("prompt_version") == version) & pc.field("text_hash").isin(touched),
    )
    derived = derived_texts(both, texts)
    bank.write_part("texts", f"derived-{slug(model)}-{slug(version)}-{digest(keys)}", derived)

    err = gen.column("error").to_pylist()
    fb = gen.column("fallback").to_pylist()
    stats.update(
        generated=len(missing),
        rows=gen.num_rows,
        errors=sum(e is not None for e in err),
        fallbacks=sum(f is not None for f in fb),
        input_truncated=sum(bool(x) for x in gen.column("input_truncated").to_pylist()),
        derived_texts=derived.num_rows,
        part=part,
        wall_s=round(time.perf_counter() - t0, 3),
    )
    log.info("generation: %s", stats)
    return stats
