"""LLM-free generator: tf-idf keyphrases and tf-idf/MMR extractive summaries (YAKE and encoder-centroid
kept as options), deterministic and independent of how sessions are batched."""

from __future__ import annotations

import pytest

from memgas.pipeline.llm_free import LLMFreeGenerator, split_units, strip_speakers

SESSION = (
    "Caroline: I went to an LGBTQ support group yesterday and it was so powerful.\n"
    "Melanie: Wow, that sounds great! I painted a lake sunrise last year.\n"
    "Caroline: Ok!\n"
    "Caroline: I want to study counseling and work in mental health.\n"
    "Melanie: Counseling would suit you. Painting helps me relax after work with the kids.\n"
)


def test_split_units_merges_fragments_and_bounds_count() -> None:
    units = split_units(SESSION)
    assert all(len(u) >= 12 for u in units)
    assert any("Ok!" in u for u in units)  # merged into the previous sentence, never alone
    assert len(split_units("A sentence here. " * 2000, max_units=50)) <= 50
    assert strip_speakers("[Caroline]: hi\nuser: yo") == "hi\nyo"


def test_keywords_without_encoder_are_deterministic_and_clean() -> None:
    g = LLMFreeGenerator(None, top_keywords=6)
    k1 = g.keywords([SESSION, "", "   "])
    assert k1 == g.keywords([SESSION, "", "   "])
    kws = k1[0].split("; ")
    assert 1 <= len(kws) <= 6 and all(k == k.lower() and k.strip() for k in kws)
    assert k1[1] == "" and k1[2] == ""
    assert g.summaries([""]) == [""]
    lead = LLMFreeGenerator(None, summary_method="lead").summaries([SESSION])[0]
    assert lead.startswith("Caroline: I went to an LGBTQ")


def test_tfidf_keywords_content_not_chitchat() -> None:
    g = LLMFreeGenerator(None)
    assert g.NEEDS_ENCODER is False and g.encoder is None
    kws = g.keywords_list(SESSION)
    assert "lgbtq support group" in kws  # a recurring specific phrase
    flat = " ".join(kws).split()
    assert not {"wow", "ok", "caroline", "melanie", "i'm", "that"} & set(flat)  # chit-chat, speakers, stopwords
    assert len(set(kws)) == len(kws)


def test_outputs_do_not_depend_on_batching() -> None:
    """Per-session statistics + a fixed background list: a session's outputs are the same alone or in any
    batch, so units of any size and resumed runs give byte-identical generations."""
    other = "user: I need a recipe for sourdough bread.\nassistant: Start with an active starter and flour."
    g = LLMFreeGenerator(None)
    batch = [SESSION, other, SESSION.upper()]
    assert g.summaries(batch) == [g.summaries([t])[0] for t in batch]
    assert g.keywords(batch) == [g.keywords([t])[0] for t in batch]
    assert LLMFreeGenerator(None).keywords(batch[::-1])[::-1] == g.keywords(batch)


def test_tfidf_summary_order_cap_and_content() -> None:
    g = LLMFreeGenerator(None, summary_sentences=2, max_summary_chars=150)
    s1 = g.summaries([SESSION, "Only one sentence here, short."])
    assert s1 == g.summaries([SESSION, "Only one sentence here, short."])
    assert s1[0] and len(s1[0]) <= 150
    picked = [u for u in split_units(SESSION) if u[:20] in s1[0]]
    assert len(picked) >= 1
    assert [SESSION.index(u) for u in picked] == sorted(SESSION.index(u) for u in picked)  # original order
    assert "Ok!" not in s1[0].split()  # fragments are never picked alone
    assert s1[1] == "Only one sentence here, short."
    # MMR: with a redundancy penalty the two picks differ in content more than without
    long = LLMFreeGenerator(None, summary_sentences=3, max_summary_chars=2000)
    assert len(long.summaries([SESSION])[0]) > len(s1[0])


def test_methods_validated_and_named() -> None:
    with pytest.raises(ValueError):
        LLMFreeGenerator(None, summary_method="nope")
    with pytest.raises(ValueError):
        LLMFreeGenerator(None, keyword_method="nope")
    y = LLMFreeGenerator(None, keyword_method="yake")
    assert y.name == "llm-free/yake+tfidf"
    kws = y.keywords([SESSION])[0].split("; ")
    assert 1 <= len(kws) <= 30 and all(k == k.lower() for k in kws)


def test_keywords_non_english_and_emoji() -> None:
    g = LLMFreeGenerator(None)
    out = g.keywords(["user: Je suis allé à Paris 🎉 avec mon chien.\nassistant: 東京は大きい都市です。 Très bien!"])[0]
    assert out and "\ufffd" not in out


@pytest.mark.slow
def test_centroid_summary_keeps_order_and_cap(encoder) -> None:
    g = LLMFreeGenerator(encoder, summary_method="centroid", summary_sentences=2, max_summary_chars=150)
    s1 = g.summaries([SESSION, "Only one sentence here, short."])
    assert s1 == g.summaries([SESSION, "Only one sentence here, short."])  # deterministic
    assert len(s1[0]) <= 150 and s1[0]
    picked = [u for u in split_units(SESSION) if u[:20] in s1[0]]
    assert [SESSION.index(u) for u in picked] == sorted(SESSION.index(u) for u in picked)  # original order
    assert s1[1] == "Only one sentence here, short."
