"""Bad input: every case is a one-line DataError or a counted warning, never a traceback or a crash."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest

from memgas.pipeline.bank import Bank
from memgas.pipeline.errors import DataError
from memgas.pipeline.ingest import ingest


def q(qid: str = "q1", **over: Any) -> dict[str, Any]:
    item = {
        "question_id": qid,
        "question_type": "single-session-user",
        "question": "What is my dog's name?",
        "answer": "Rex",
        "question_date": "2023/05/20 (Sat) 02:21",
        "haystack_session_ids": ["s1", "answer_s2"],
        "haystack_dates": ["2023/05/18 (Thu) 10:00", "2023/05/19 (Fri) 11:00"],
        "haystack_sessions": [
            [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi"}],
            [{"role": "user", "content": "My dog is Rex.", "has_answer": True}, {"role": "assistant", "content": "Cute!", "has_answer": False}],
        ],
        "answer_session_ids": ["answer_s2"],
    }
    item.update(over)
    return item


def write(tmp_path: Path, data: Any, name: str = "in.json") -> Path:
    p = tmp_path / name
    p.write_bytes(data if isinstance(data, bytes) else json.dumps(data).encode())
    return p


def run(tmp_path: Path, path: Path, fmt: str = "longmemeval", **kw: Any) -> dict[str, Any]:
    return ingest(path, fmt, tmp_path / "bank", progress=False, **kw)


def one_line_error(tmp_path: Path, path: Path, fmt: str = "longmemeval", **kw: Any) -> str:
    with pytest.raises(DataError) as exc:
        run(tmp_path, path, fmt, **kw)
    msg = str(exc.value)
    assert "\n" not in msg and str(path) in msg
    return msg


def test_good_baseline(tmp_path: Path) -> None:
    s = run(tmp_path, write(tmp_path, [q()]))
    assert s["histories"] == 1 and s["sessions"] == 2 and s["warnings"] == {}


def test_truncated_json(tmp_path: Path) -> None:
    raw = json.dumps([q("a"), q("b")]).encode()
    msg = one_line_error(tmp_path, write(tmp_path, raw[: len(raw) - 40]))
    assert "truncated" in msg
    # a failed first ingest leaves nothing behind: no bank directory at all
    assert not (tmp_path / "bank").exists()


def test_malformed_json(tmp_path: Path) -> None:
    raw = json.dumps([q("a"), q("b")]).replace('"question": "What', '"question" "What', 1).encode()
    assert "JSON" in one_line_error(tmp_path, write(tmp_path, raw))


@pytest.mark.parametrize("data,expect", [({"question_id": "x"}, "found an object"), (b"", "empty file"), (b"42", "JSON array")])
def test_wrong_top_level(tmp_path: Path, data: Any, expect: str) -> None:
    assert expect in one_line_error(tmp_path, write(tmp_path, data))


def test_item_not_object(tmp_path: Path) -> None:
    assert "record 1" in one_line_error(tmp_path, write(tmp_path, [q(), "oops"]))


def test_missing_field(tmp_path: Path) -> None:
    item = q()
    del item["question"]
    msg = one_line_error(tmp_path, write(tmp_path, [item]))
    assert "record 0 (id=q1)" in msg and "'question'" in msg and "missing" in msg


def test_wrong_types(tmp_path: Path) -> None:
    msg = one_line_error(tmp_path, write(tmp_path, [q(haystack_sessions="nope")]))
    assert "'haystack_sessions'" in msg and "expected array" in msg
    bad_turn = q()
    bad_turn["haystack_sessions"][0][1]["content"] = 5
    msg = one_line_error(tmp_path, write(tmp_path, [bad_turn]))
    assert "haystack_sessions[0][1].content" in msg and "expected string" in msg
    msg = one_line_error(tmp_path, write(tmp_path, [q(haystack_dates=["x"])]))
    assert "same length" in msg


def test_empty_session_warns_and_skips(tmp_path: Path) -> None:
    item = q(haystack_sessions=[[], q()["haystack_sessions"][1]])
    s = run(tmp_path, write(tmp_path, [item]))
    assert s["sessions"] == 1 and s["warnings"]["empty_session"]["count"] == 1
    msg = one_line_error(tmp_path, write(tmp_path, [item]), strict=True)
    assert "strict" in msg and "no turns" in msg


def test_a_session_of_blank_turns_warns_and_skips(tmp_path: Path) -> None:
    """Turns whose content is only whitespace leave nothing to embed: the session was kept as an empty
    text and ranked without a word; now it is an empty session (warned, skipped; strict: an error)."""
    blank = [{"role": "user", "content": "  "}, {"role": "assistant", "content": "\n"}]
    item = q(haystack_sessions=[blank, q()["haystack_sessions"][1]])
    s = run(tmp_path, write(tmp_path, [item]))
    assert s["sessions"] == 1 and s["warnings"]["empty_session"]["count"] == 1
    msg = one_line_error(tmp_path, write(tmp_path, [item]), strict=True)
    assert "strict" in msg and "only blank turns" in msg


def test_empty_history_warns_and_skips(tmp_path: Path) -> None:
    empty = q("e", haystack_session_ids=[], haystack_dates=[], haystack_sessions=[], answer_session_ids=[])
    s = run(tmp_path, write(tmp_path, [empty, q("ok")]))
    assert s["histories"] == 1 and s["warnings"]["empty_history"]["count"] == 1
    one_line_error(tmp_path, write(tmp_path, [empty]), strict=True)


def test_duplicate_question_ids(tmp_path: Path) -> None:
    assert "duplicate history id 'q1'" in one_line_error(tmp_path, write(tmp_path, [q(), q()]))


def test_duplicate_session_ids(tmp_path: Path) -> None:
    msg = one_line_error(tmp_path, write(tmp_path, [q(haystack_session_ids=["s1", "s1"])]))
    assert "duplicate session id 's1'" in msg


def test_unparseable_dates_warn_once(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    items = [q(f"q{i}", haystack_dates=["someday", "later"]) for i in range(3)]
    with caplog.at_level(logging.WARNING):
        s = run(tmp_path, write(tmp_path, items))
    assert s["warnings"]["unparseable_date"]["count"] == 6
    date_logs = [r for r in caplog.records if "does not parse" in r.getMessage()]
    assert len(date_logs) == 1
    sessions = Bank(tmp_path / "bank").read("sessions")
    assert sessions.column("date_raw").to_pylist()[0] == "someday" and sessions.column("date").null_count == 6


def test_non_utf8_json(tmp_path: Path) -> None:
    raw = json.dumps([q()]).encode()
    at = raw.index(b"hello")
    bad = raw[:at] + b"\xff\xfe" + raw[at:]
    msg = one_line_error(tmp_path, write(tmp_path, bad))
    assert "UTF-8" in msg and f"byte offset {at}" in msg


def test_non_utf8_jsonl(tmp_path: Path) -> None:
    line1 = json.dumps({"history_id": "a", "sessions": [{"session_id": "s", "turns": [{"role": "u", "content": "x"}]}]}).encode() + b"\n"
    line2 = b'{"history_id": "b\xc3(", "sessions": []}\n'
    msg = one_line_error(tmp_path, write(tmp_path, line1 + line2, "h.jsonl"), "jsonl")
    assert "UTF-8" in msg and f"byte offset {len(line1) + 17}" in msg and "line 2" in msg


def test_jsonl_truncated_line(tmp_path: Path) -> None:
    msg = one_line_error(tmp_path, write(tmp_path, b'{"history_id": "a", "sessions": [', "h.jsonl"), "jsonl")
    assert "line 1" in msg and "JSON" in msg


def test_missing_evidence_session(tmp_path: Path) -> None:
    s = run(tmp_path, write(tmp_path, [q(answer_session_ids=["answer_s2", "ghost"])]))
    w = s["warnings"]["missing_evidence"]
    assert w["count"] == 1 and "ghost" in w["examples"][0]
    ev = Bank(tmp_path / "bank").read("queries").column("evidence_session_ids").to_pylist()
    assert ev == [["answer_s2"]]
    one_line_error(tmp_path, write(tmp_path, [q(answer_session_ids=["ghost"])]), strict=True)


def test_locomo_missing_evidence(tmp_path: Path) -> None:
    conv = {
        "sample_id": "c1",
        "conversation": {
            "speaker_a": "A", "speaker_b": "B", "session_1_date_time": "1:56 pm on 8 May, 2023",
            "session_1": [{"speaker": "A", "dia_id": "D1:1", "text": "hi"}, {"speaker": "B", "dia_id": "D1:2", "text": "yo"}],
        },
        "qa": [{"question": "?", "answer": "x", "evidence": ["D1:2", "D9:1", "D1:7", "junk"], "category": 4}],
    }
    s = run(tmp_path, write(tmp_path, [conv]), "locomo")
    assert s["warnings"]["missing_evidence"]["count"] == 2 and s["warnings"]["unparseable_evidence"]["count"] == 1
    qrow = Bank(tmp_path / "bank").read("queries").to_pylist()[0]
    assert qrow["evidence_session_ids"] == ["session_1"] and qrow["evidence_turn_ids"] == ["session_1:0"]


def test_ten_mb_turn(tmp_path: Path) -> None:
    big = "word " * (2 * 1024 * 1024)  # 10 MiB of text in one utterance
    item = q()
    item["haystack_sessions"][0][0]["content"] = big
    s = run(tmp_path, write(tmp_path, [item]))
    assert s["turns"] == 4
    turns = Bank(tmp_path / "bank").read("turns")
    assert max(len(c) for c in turns.column("content").to_pylist()) == len(big)


def test_duplicate_key_in_an_object(tmp_path: Path) -> None:
    raw = json.dumps([q("a")]).replace('"answer": "Rex"', '"answer": "Rex", "answer": "Max"', 1)
    msg = one_line_error(tmp_path, write(tmp_path, raw.encode()))
    assert "duplicate key 'answer'" in msg and "record 0" in msg


@pytest.mark.parametrize("fmt", ["longmemeval", "jsonl"])
def test_nesting_bomb_fails_fast_with_bounded_memory(tmp_path: Path, fmt: str) -> None:
    import resource
    import time

    body = "[" * 100_000 + "]" * 100_000
    data = body if fmt == "longmemeval" else '{"history_id": ' + body + "}\n"
    path = write(tmp_path, data.encode(), "deep." + ("json" if fmt == "longmemeval" else "jsonl"))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    msg = one_line_error(tmp_path, path, fmt)
    assert time.perf_counter() - t0 < 1.0
    assert "nested" in msg
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 200_000  # KiB: well under 200 MB
