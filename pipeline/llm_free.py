"""LLM-free summaries and keywords, for bulk indexing where LLM calls cost too much (and as the fallback
when a small LLM's output is unusable, DESIGN.md §5). No transformer pass: the generate stage stays
independent of the encoder and costs milliseconds per session.

Term weights (both outputs): a word's weight in a session is ``(1 + log tf) * idf_bg(word)``, where
``idf_bg = max(ZIPF_CEIL - zipf(word), IDF_FLOOR)`` comes from the ``wordfreq`` English frequency list
(a fixed background corpus shipped with the package): "pottery" (Zipf 3.7) outweighs "really" (6.0);
names and rare words (not in the list) get the full ``ZIPF_CEIL``. Stopwords (scikit-learn's English
list + dialogue chit-chat) and the session's own speaker labels are ignored.

Why a fixed background list, not statistics over the corpus being indexed: the generator runs on units
of ~32 sessions in parallel workers and its outputs are cached per session text. Anything computed over
a unit or a run would make a session's keywords depend on which sessions it was batched with, so a
resumed or re-sharded run would not be byte-identical, and the same LongMemEval session (shared by many
haystacks) could get different outputs. Per-session statistics + one fixed list have neither problem.

* keywords (``keyword_method="tfidf"``, default): candidate phrases are runs of 1-3 consecutive
  non-stopword words inside a clause; a phrase scores ``(1 + log tf(phrase)) * sum idf_bg(words)``
  (longer specific phrases beat their parts when they recur); the top ``top_keywords`` are kept, skipping
  a phrase whose words are all covered by better ones. ``"yake"``: the previous YAKE extractor (pure
  Python, far slower), kept for comparison.
* summary (``summary_method="tfidf"``, default): extractive. Sentences are TF-IDF vectors (weights
  above); the session centroid is their sum; sentences are picked greedily by cosine to the centroid
  minus ``mmr`` x their largest cosine to the sentences already picked (maximal marginal relevance: cover
  more of the session instead of repeating one topic), sentences of >= 8 words first, until
  ``summary_sentences`` or ``max_summary_chars``; output in the original order. ``"centroid"``: the
  previous method (sentence embeddings by the encoder, closest to their mean; needs an encoder);
  ``"lead"``: the first sentences.

Sizes: 12 sentences / 1,200 characters and 30 keyphrases fill MiniLM's 256-token window; measured on
LoCoMo (docs/benchmarks.md, "CPU settings"), longer extracts retrieve better, and tf-idf beats YAKE
keywords and encoder-centroid summaries of the same size, at a small fraction of their cost.

Deterministic: no randomness, ties break by sentence / phrase order of first appearance.
"""

from __future__ import annotations

import logging
import math
import re
from collections import Counter
from functools import lru_cache

import numpy as np

from memgas.pipeline.models.base import Encoder

log = logging.getLogger(__name__)

#: Recorded as ``generations.model`` when the generator is "llm-free", and in ``fallback`` otherwise.
LLM_FREE_NAME = "llm-free/tfidf"
#: Bump when the algorithm or its defaults change (part of the generation cache key).
LLM_FREE_VERSION = "llm-free-v3"

SUMMARY_METHODS = ("tfidf", "centroid", "lead")
KEYWORD_METHODS = ("tfidf", "yake")

#: Zipf values run ~1 (rare) to ~7.7 ("the"); idf_bg = ZIPF_CEIL - zipf, at least IDF_FLOOR.
ZIPF_CEIL = 7.0
IDF_FLOOR = 0.1

# "[Caroline]: ", "user: ", "assistant: " at the start of a line: a speaker label, not content.
_SPEAKER_RE = re.compile(r"^\s*\[?[^\]\n:]{1,40}\]?:\s+", re.MULTILINE)
_LABEL_RE = re.compile(r"^\s*\[?([^\]\n:]{1,40})\]?:\s+", re.MULTILINE)
_CHITCHAT = {
    "hey", "hi", "hello", "wow", "thanks", "thank", "yeah", "yes", "yep", "ok", "okay", "oh", "cool", "great",
    "awesome", "good", "nice", "glad", "sure", "really", "totally", "haha", "lol", "amazing", "sounds",
    "user", "assistant", "just", "like", "know", "think", "lot", "things", "thing", "definitely", "feel",
    "love", "make", "let", "going", "want", "got", "did", "does", "doing", "don", "didn", "ll", "ve", "re",
    "im", "it's", "i'm", "that's", "you're", "i've", "i'll", "can't", "don't", "didn't", "let's", "what's",
}
# Sentence ends: . ! ? (and CJK 。！？) followed by space or end. Simple on purpose: deterministic, no model.
_SENT_RE = re.compile(r"(?<=[.!?。！？])\s+")
# Words: letters/digits with inner apostrophes or hyphens ("mother's", "self-care"); any script.
_WORD_RE = re.compile(r"[^\W_]+(?:['’-][^\W_]+)*", re.UNICODE)
# Clause breaks for keyphrase candidates: punctuation that ends a phrase.
_CLAUSE_RE = re.compile(r"[.,;:!?()\[\]{}\"“”…—–/\n|]+")


def strip_speakers(text: str) -> str:
    return _SPEAKER_RE.sub("", text)


def split_units(text: str, *, min_chars: int = 12, max_units: int = 256) -> list[str]:
    """Sentences of a session, the speaker label kept on the first sentence of each line.

    Very short fragments ("Ok!", "Thanks.") are merged into the previous sentence so they never get
    picked on their own. More than ``max_units`` sentences are grouped into ``max_units`` consecutive
    windows (bounded cost for huge sessions).
    """
    units: list[str] = []
    for line in text.splitlines():
        line = line.strip()
        if not line:
            continue
        for sent in _SENT_RE.split(line):
            sent = sent.strip()
            if not sent:
                continue
            if units and len(sent) < min_chars:
                units[-1] = f"{units[-1]} {sent}"
            else:
                units.append(sent)
    if len(units) > max_units:
        bounds = np.linspace(0, len(units), max_units + 1).astype(int)
        units = [" ".join(units[a:b]) for a, b in zip(bounds[:-1], bounds[1:]) if b > a]
    return units


@lru_cache(maxsize=1)
def _stopwords() -> frozenset[str]:
    from sklearn.feature_extraction.text import ENGLISH_STOP_WORDS  # noqa: PLC0415

    return frozenset(ENGLISH_STOP_WORDS) | frozenset(_CHITCHAT)


@lru_cache(maxsize=1)
def _zipf_table() -> dict[str, float]:
    """word -> Zipf frequency from wordfreq's English list (loaded once per process)."""
    from wordfreq import get_frequency_dict  # noqa: PLC0415

    freqs = get_frequency_dict("en", wordlist="large")
    return {w: math.log10(f) + 9.0 for w, f in freqs.items() if f > 0}


def _idf(word: str, table: dict[str, float]) -> float:
    z = table.get(word)
    if z is None and ("’" in word or "'" in word):
        z = table.get(word.replace("’", "'"))
    return max(ZIPF_CEIL - (z if z is not None else 0.0), IDF_FLOOR)


def _words(text: str) -> list[str]:
    """Lower-case words; a possessive "'s" is dropped ("painting's" -> "painting")."""
    out = []
    for w in _WORD_RE.findall(text.lower()):
        w = w.replace("’", "'")
        if w.endswith("'s"):
            w = w[:-2]
        out.append(w)
    return out


def _is_stop(w: str, stop: frozenset[str] | set[str]) -> bool:
    """Stopwords, and contractions of them ("i'd", "we're", "don't")."""
    return w in stop or ("'" in w and w.split("'", 1)[0] in stop)


def _speakers(text: str) -> set[str]:
    """Lower-cased words of the session's speaker labels (in every session of a history: not content)."""
    out: set[str] = set()
    for m in _LABEL_RE.finditer(text):
        out.update(_words(m.group(1)))
    return out


class LLMFreeGenerator:
    """Keywords and extractive summaries without an LLM (and, by default, without an encoder)."""

    name = LLM_FREE_NAME
    version = LLM_FREE_VERSION
    #: The default methods need no encoder (jobs read this to skip loading one for the generate stage).
    NEEDS_ENCODER = False

    def __init__(
        self,
        encoder: Encoder | None = None,
        *,
        summary_method: str = "tfidf",
        keyword_method: str = "tfidf",
        top_keywords: int = 30,
        max_ngram: int = 3,
        summary_sentences: int = 12,
        max_summary_chars: int = 1200,
        mmr: float = 0.5,
        max_yake_chars: int = 20000,
        language: str = "en",
    ) -> None:
        if summary_method not in SUMMARY_METHODS:
            raise ValueError(f"summary_method={summary_method!r}: expected one of {SUMMARY_METHODS}")
        if keyword_method not in KEYWORD_METHODS:
            raise ValueError(f"keyword_method={keyword_method!r}: expected one of {KEYWORD_METHODS}")
        self.encoder = encoder
        self.summary_method = summary_method
        self.keyword_method = keyword_method
        self.top_keywords = top_keywords
        self.max_ngram = max_ngram
        self.summary_sentences = summary_sentences
        self.max_summary_chars = max_summary_chars
        self.mmr = mmr
        if (summary_method, keyword_method) != ("tfidf", "tfidf"):
            self.name = f"llm-free/{keyword_method}+{summary_method}"
        # YAKE is pure Python and linear in the text; 20k chars (~5k tokens) bounds its time per session.
        self.max_yake_chars = max_yake_chars
        self._yake = None
        if keyword_method == "yake":
            import yake  # noqa: PLC0415  (only the comparison method needs it)

            self._yake_mod = yake
            self._yake_args = dict(lan=language, n=max_ngram, top=top_keywords, dedup_lim=0.7)
            base = yake.KeywordExtractor(lan=language)
            # chit-chat words YAKE otherwise ranks high in dialogue ("hey", "wow", "thanks")
            self._yake_stop = set(base.stopword_set) | _CHITCHAT
            self._yake = yake.KeywordExtractor(**self._yake_args, stopwords=self._yake_stop)

    # -- keywords -----------------------------------------------------------------------------------
    def keywords_list(self, text: str) -> list[str]:
        if self.keyword_method == "yake":
            return self._yake_keywords(text)
        return self._tfidf_keywords(text)

    def keywords(self, texts: list[str]) -> list[str]:
        return ["; ".join(self.keywords_list(t)) for t in texts]

    def _tfidf_keywords(self, text: str) -> list[str]:
        body = strip_speakers(text)
        if not body.strip():
            return []
        stop = _stopwords() | _speakers(text)
        table = _zipf_table()
        counts: Counter[tuple[str, ...]] = Counter()
        first: dict[tuple[str, ...], int] = {}
        for clause in _CLAUSE_RE.split(body):
            run: list[str] = []
            for w in [*_words(clause), ""]:  # "" flushes the last run
                if w and not _is_stop(w, stop) and (not w.isdigit() or len(w) == 4):  # digits only as years
                    run.append(w)
                    continue
                for n in range(1, self.max_ngram + 1):
                    for i in range(len(run) - n + 1):
                        g = tuple(run[i : i + n])
                        counts[g] += 1
                        first.setdefault(g, len(first))
                run = []
        if not counts:
            return []
        idf: dict[str, float] = {}
        scored = []
        for g, tf in counts.items():
            s = 0.0
            for w in g:
                v = idf.get(w)
                if v is None:
                    v = idf[w] = _idf(w, table)
                s += v
            scored.append((-(1.0 + math.log(tf)) * s, first[g], g))
        scored.sort()
        out: list[str] = []
        covered: set[str] = set()
        for _s, _i, g in scored:
            if len(out) >= self.top_keywords:
                break
            if set(g) <= covered:
                continue
            covered.update(g)
            out.append(" ".join(g))
        return out

    def _yake_keywords(self, text: str) -> list[str]:
        body = strip_speakers(text)[: self.max_yake_chars]
        if not body.strip():
            return []
        # the speakers' own names are in every session of a history: not discriminative keywords
        speakers = {m.group(1).strip().lower() for m in _LABEL_RE.finditer(text[: self.max_yake_chars])}
        extractor = self._yake
        if speakers - self._yake_stop:
            extractor = self._yake_mod.KeywordExtractor(**self._yake_args, stopwords=self._yake_stop | speakers)
        try:
            pairs = extractor.extract_keywords(body)
        except Exception as exc:  # YAKE can fail on exotic input; a session without keywords is not fatal
            log.warning("YAKE failed on a %d-char text: %s", len(body), exc)
            return []
        out: list[str] = []
        seen: set[str] = set()
        for phrase, _score in pairs:
            p = " ".join(str(phrase).split()).lower()
            if p and p not in seen:
                seen.add(p)
                out.append(p)
        return out

    # -- summaries ----------------------------------------------------------------------------------
    def summaries(self, texts: list[str]) -> list[str]:
        """One extractive summary per text."""
        units = [split_units(t) for t in texts]
        if self.summary_method == "centroid" and self.encoder is not None:
            return self._centroid_summaries(units)
        if self.summary_method == "lead" or self.summary_method == "centroid":  # centroid without encoder: lead
            return [self._join(u, list(range(min(len(u), self.summary_sentences)))) for u in units]
        return [self._join(u, self._tfidf_pick(u, t)) for u, t in zip(units, texts)]

    def _tfidf_pick(self, units: list[str], text: str) -> list[int]:
        n = len(units)
        if n <= 1:
            return list(range(n))
        stop = _stopwords() | _speakers(text)
        table = _zipf_table()
        vocab: dict[str, int] = {}
        rows, cols, vals = [], [], []
        idf: list[float] = []
        for i, u in enumerate(units):
            tf = Counter(w for w in _words(strip_speakers(u)) if not _is_stop(w, stop))
            for w, c in tf.items():
                j = vocab.get(w)
                if j is None:
                    j = vocab[w] = len(vocab)
                    idf.append(_idf(w, table))
                rows.append(i)
                cols.append(j)
                vals.append((1.0 + math.log(c)) * idf[j])
        if not vocab:
            return list(range(min(n, self.summary_sentences)))
        X = np.zeros((n, len(vocab)))
        X[rows, cols] = vals
        norms = np.linalg.norm(X, axis=1)
        Xn = X / np.maximum(norms, 1e-12)[:, None]
        centroid = X.sum(axis=0)
        centroid /= max(float(np.linalg.norm(centroid)), 1e-12)
        rel = Xn @ centroid
        # chit-chat ("Thanks, Melanie!") says nothing: sentences of >= 8 words first when there are enough
        long_ = np.array([len(u.split()) >= 8 for u in units])
        if long_.sum() >= self.summary_sentences:
            rel = np.where(long_, rel, rel - 10.0)
        rel = np.where(norms > 0, rel, rel - 20.0)
        picked: list[int] = []
        max_sim = np.zeros(n)
        avail = np.ones(n, bool)
        chars = 0
        while len(picked) < self.summary_sentences and avail.any() and chars < self.max_summary_chars:
            score = np.where(avail, rel - self.mmr * max_sim, -np.inf)
            i = int(np.argmax(score))  # first maximum: ties keep the earlier sentence
            picked.append(i)
            avail[i] = False
            chars += len(units[i]) + 1
            max_sim = np.maximum(max_sim, Xn @ Xn[i])
        return sorted(picked)

    def _centroid_summaries(self, units: list[list[str]]) -> list[str]:
        """The previous method: all sentences of the batch embedded in one encoder call."""
        flat = [s for u in units for s in u]
        vecs = np.asarray(self.encoder.encode(flat), dtype=np.float32) if flat else np.zeros((0, 1), np.float32)
        out: list[str] = []
        start = 0
        for u in units:
            v = vecs[start : start + len(u)]
            start += len(u)
            out.append(self._join(u, self._central(v, u)))
        return out

    def _central(self, v: np.ndarray, units: list[str]) -> list[int]:
        n = v.shape[0]
        if n <= self.summary_sentences:
            return list(range(n))
        vn = v / np.maximum(np.linalg.norm(v, axis=1, keepdims=True), 1e-12)
        centroid = vn.mean(axis=0)
        centroid /= max(float(np.linalg.norm(centroid)), 1e-12)
        scores = vn @ centroid
        long_ = np.array([len(u.split()) >= 8 for u in units])
        if long_.sum() >= self.summary_sentences:
            scores = np.where(long_, scores, scores - 10.0)
        order = np.argsort(-scores, kind="stable")[: self.summary_sentences]
        return sorted(int(i) for i in order)

    def _join(self, units: list[str], picked: list[int]) -> str:
        parts: list[str] = []
        total = 0
        for i in picked:
            s = units[i]
            room = self.max_summary_chars - total - (1 if parts else 0)
            if room <= 0:
                break
            if len(s) > room:
                s = s[:room].rsplit(" ", 1)[0] if " " in s[:room] else s[:room]
            parts.append(s)
            total += len(s) + 1
        return " ".join(parts)
