"""LoCoMo loader: counts against the verified numbers, evidence parsing, captions, summaries."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from memgas.pipeline.data import locomo
from memgas.pipeline.data.common import Warnings

REPO = Path(__file__).resolve().parents[3]
LOCOMO = REPO.parent / "shared" / "data" / "locomo" / "locomo10.json"
SAMPLE = REPO / "data" / "sample" / "locomo_sample.json"


def _load(path: Path) -> tuple[list, Warnings]:
    w = Warnings(str(path))
    return list(locomo.load(path, w)), w


def test_full_counts() -> None:
    if not LOCOMO.exists():
        pytest.skip(f"LoCoMo data not found at {LOCOMO}")
    recs, w = _load(LOCOMO)
    assert len(recs) == 10
    assert sum(len(r.sessions) for r in recs) == 272
    assert sum(len(r.turns) for r in recs) == 5882
    assert sum(len(r.pairs) for r in recs) == 3011
    queries = [q for r in recs for q in r.queries]
    assert len(queries) == 1986
    assert Counter(q["category"] for q in queries) == {1: 282, 2: 321, 3: 96, 4: 841, 5: 446}
    assert Counter(q["question_type"] for q in queries)["adversarial"] == 446
    # the file's known defects are reported, not fatal: 2 dialog ids that do not exist, one bare "D"
    assert w.counts == {"missing_evidence": 2, "unparseable_evidence": 1}
    assert all(s["date"] is not None for r in recs for s in r.sessions)


def test_sample_details() -> None:
    recs, w = _load(SAMPLE)
    assert [r.history_id for r in recs] == ["conv-26", "conv-30"]
    r = recs[0]
    assert r.speakers == ["Caroline", "Melanie"]
    s0 = r.sessions[0]
    assert s0["session_id"] == "session_1" and s0["date_raw"] == "1:56 pm on 8 May, 2023"
    assert s0["date"].isoformat() == "2023-05-08T13:56:00"
    assert s0["dataset_summary"] and "Caroline" in s0["dataset_summary"]
    assert r.texts[s0["text_hash"]].startswith("[Caroline]: Hey Mel! Good to see you!")
    # blip_caption appended the way the MemGAS authors render it
    raw = json.loads(SAMPLE.read_text())[0]["conversation"]
    dialog = next(d for n in range(1, 20) for d in raw[f"session_{n}"] if "blip_caption" in d)
    turn = next(t for t in r.turns if t["dia_id"] == dialog["dia_id"])
    assert turn["content"] == dialog["text"] + "\n The image Caption: " + dialog["blip_caption"]
    q0 = r.queries[0]
    assert q0["query_id"] == "conv-26:q0" and q0["evidence_session_ids"] == ["session_1"]
    assert q0["evidence_turn_ids"] == ["session_1:1"]  # D1:3 is the 3rd utterance -> pair 1
    # utterance-level evidence: D1:3 is turn_index 2 of session_1, the utterance with that dia_id
    assert q0["evidence_utterance_ids"] == ["session_1:2"]
    by_dia = {t["dia_id"]: t["turn_index"] for t in r.turns if t["session_hash"] == s0["text_hash"]}
    assert by_dia["D1:3"] == 2
    assert q0["question_type"] == "temporal" and q0["category"] == 2
    assert any(q["answer"] == "2022" for q in r.queries)  # int answers become strings
    adv = [q for q in r.queries if q["category"] == 5]
    assert adv and all(q["answer"] for q in adv)  # from adversarial_answer


def test_parse_evidence_variants() -> None:
    assert locomo.parse_evidence("D3:5") == ([(3, 5)], "")
    assert locomo.parse_evidence("D8:6; D9:17") == ([(8, 6), (9, 17)], "")
    assert locomo.parse_evidence("D9:1 D4:4 D4:6") == ([(9, 1), (4, 4), (4, 6)], "")
    assert locomo.parse_evidence("D:11:26") == ([(11, 26)], "")
    assert locomo.parse_evidence("D") == ([], "D")
