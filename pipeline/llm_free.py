"""LLM-free summaries and keywords, for bulk indexing where LLM calls cost too much (and as the fallback
when a small LLM's output is unusable, DESIGN.md §5).

* keywords: YAKE (unsupervised, statistical keyphrase extraction; the maintained ``yake`` package), the
  top-N keyphrases joined by ``"; "`` (the same format as the cleaned LLM keywords).
* summary: extractive and centroid-based: split the session into sentences, embed them with the
  encoder, keep the ``k`` sentences closest (cosine) to the session centroid, in their original order,
  capped at ``max_chars``. Without an encoder the first ``k`` sentences are kept (lead-k).

Deterministic: YAKE is deterministic, the encoder runs at inference, ties break by sentence order.
"""

from __future__ import annotations

import logging
import re

import numpy as np

from memgas.pipeline.models.base import Encoder

log = logging.getLogger(__name__)

#: Recorded as ``generations.model`` when the generator is "llm-free", and in ``fallback`` otherwise.
LLM_FREE_NAME = "llm-free/yake+centroid"
#: Bump when the algorithm or its defaults change (part of the generation cache key).
LLM_FREE_VERSION = "llm-free-v1"

# "[Caroline]: ", "user: ", "assistant: " at the start of a line: a speaker label, not content.
_SPEAKER_RE = re.compile(r"^\s*\[?[^\]\n:]{1,40}\]?:\s+", re.MULTILINE)
# Sentence ends: . ! ? (and CJK 。！？) followed by space or end. Simple on purpose: deterministic, no model.
_LABEL_RE = re.compile(r"^\s*\[?([^\]\n:]{1,40})\]?:\s+", re.MULTILINE)
_CHITCHAT = {
    "hey", "hi", "hello", "wow", "thanks", "thank", "yeah", "yes", "yep", "ok", "okay", "oh", "cool", "great",
    "awesome", "good", "nice", "glad", "sure", "really", "totally", "haha", "lol", "amazing", "sounds",
    "user", "assistant",
}
_SENT_RE = re.compile(r"(?<=[.!?。！？])\s+")


def strip_speakers(text: str) -> str:
    return _SPEAKER_RE.sub("", text)


def split_units(text: str, *, min_chars: int = 12, max_units: int = 256) -> list[str]:
    """Sentences of a session, the speaker label kept on the first sentence of each line.

    Very short fragments ("Ok!", "Thanks.") are merged into the previous sentence so they never get
    picked on their own. More than ``max_units`` sentences are grouped into ``max_units`` consecutive
    windows (bounded encoder cost for huge sessions).
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


class LLMFreeGenerator:
    """Keywords by YAKE, summaries by centroid sentence selection."""

    name = LLM_FREE_NAME
    version = LLM_FREE_VERSION

    def __init__(
        self,
        encoder: Encoder | None = None,
        *,
        top_keywords: int = 10,
        max_ngram: int = 3,
        summary_sentences: int = 3,
        max_summary_chars: int = 600,
        max_yake_chars: int = 20000,
        language: str = "en",
    ) -> None:
        import yake  # imported here: only this generator needs it

        self.encoder = encoder
        self.top_keywords = top_keywords
        self.summary_sentences = summary_sentences
        self.max_summary_chars = max_summary_chars
        # YAKE is pure Python and linear in the text; 20k chars (~5k tokens) keeps it < 0.5 s a session.
        self.max_yake_chars = max_yake_chars
        self._yake_mod = yake
        self._yake_args = dict(lan=language, n=max_ngram, top=top_keywords, dedup_lim=0.7)
        base = yake.KeywordExtractor(lan=language)
        # chit-chat words YAKE otherwise ranks high in dialogue ("hey", "wow", "thanks")
        self._stopwords = set(base.stopword_set) | _CHITCHAT
        self._yake = yake.KeywordExtractor(**self._yake_args, stopwords=self._stopwords)

    # -- keywords -----------------------------------------------------------------------------------
    def keywords_list(self, text: str) -> list[str]:
        body = strip_speakers(text)[: self.max_yake_chars]
        if not body.strip():
            return []
        # the speakers' own names are in every session of a history: not discriminative keywords
        speakers = {m.group(1).strip().lower() for m in _LABEL_RE.finditer(text[: self.max_yake_chars])}
        extractor = self._yake
        if speakers - self._stopwords:
            extractor = self._yake_mod.KeywordExtractor(**self._yake_args, stopwords=self._stopwords | speakers)
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

    def keywords(self, texts: list[str]) -> list[str]:
        return ["; ".join(self.keywords_list(t)) for t in texts]

    # -- summaries ----------------------------------------------------------------------------------
    def summaries(self, texts: list[str]) -> list[str]:
        """One extractive summary per text; all sentences of the batch are embedded in one call."""
        units = [split_units(t) for t in texts]
        if self.encoder is None:
            return [self._join(u, list(range(min(len(u), self.summary_sentences)))) for u in units]
        flat = [s for u in units for s in u]
        vecs = (
            np.asarray(self.encoder.encode(flat), dtype=np.float32)
            if flat
            else np.zeros((0, 1), np.float32)
        )
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
        norms = np.linalg.norm(v, axis=1, keepdims=True)
        vn = v / np.maximum(norms, 1e-12)
        centroid = vn.mean(axis=0)
        centroid /= max(float(np.linalg.norm(centroid)), 1e-12)
        scores = vn @ centroid
        # short chit-chat ("Thanks, Melanie!") sits near the centroid of a chatty session but says nothing:
        # rank sentences of >= 8 words first when there are enough of them
        long_ = np.array([len(u.split()) >= 8 for u in units])
        if long_.sum() >= self.summary_sentences:
            scores = np.where(long_, scores, scores - 10.0)
        # stable: equal scores keep the earlier sentence
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
