"""Index after an append does only the new rows, and gives what a fresh index of the same data gives.

Property (issue 18): ``ingest A, index, ingest B --append, index, answer`` has the same edges and rankings,
byte for byte, as ``ingest A, ingest B --append, index, answer`` (one build over everything). Run through
the CLI in-process, with the real LLM-free generator and MiniLM encoder, no Ray.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from memgas.pipeline.bank import Bank

REPO = Path(__file__).resolve().parents[2]

TOPICS = [
    ("hiking", ["trail", "boots", "summit", "map", "rain", "lake"]),
    ("cooking", ["pasta", "garlic", "oven", "recipe", "basil", "soup"]),
    ("work", ["meeting", "deadline", "manager", "report", "laptop", "office"]),
    ("music", ["guitar", "concert", "piano", "song", "band", "lesson"]),
    ("travel", ["flight", "hotel", "passport", "Lisbon", "train", "museum"]),
]

CONFIG = ["--set", "retrieval.methods=[session,memgas,memgas-no-gmm]", "--set", "reading.enabled=false",
          "--set", "evaluation.ks=[1,3,5]", "--set", "ray.shard_size=1"]


def _session(h: int, s: int) -> dict:
    """Session ``s`` of history ``h``: turns about one topic, words picked by a fixed rule (no RNG)."""
    name, words = TOPICS[(h * 3 + s * 7) % len(TOPICS)]
    turns = []
    for t in range(4):
        w1, w2 = words[(s + t) % len(words)], words[(s * 2 + t * 3 + h) % len(words)]
        role = "user" if t % 2 == 0 else "assistant"
        turns.append({"role": role, "content": f"Session {s}: about {name}, the {w1} and the {w2} ({h}.{s}.{t})."})
    return {"session_id": f"h{h}s{s}", "date": f"2024-{1 + s // 28:02d}-{1 + s % 28:02d} 10:00", "turns": turns}


def _question(h: int, s: int) -> dict:
    name, words = TOPICS[(h * 3 + s * 7) % len(TOPICS)]
    return {"query_id": f"h{h}:q{s}", "question": f"What did I say about the {words[s % len(words)]} and {name}?",
            "answer": words[s % len(words)], "question_date": "2025-01-01", "question_type": "single-session-user",
            "evidence_session_ids": [f"h{h}s{s}"]}


def _file(path: Path, spans: dict[int, range], questions: dict[int, list[int]]) -> Path:
    records = [{"history_id": f"h{h}", "speakers": ["user", "assistant"], "sessions": [_session(h, s) for s in r],
                "questions": [_question(h, s) for s in questions.get(h, [])]} for h, r in spans.items()]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    d = tmp_path_factory.mktemp("append_data")
    # A: two histories past min_prior_nodes (20 nodes = 5 sessions); B: more sessions of both, a new history
    a = _file(d / "a.jsonl", {0: range(0, 9), 1: range(0, 7)}, {0: [2, 6], 1: [3]})
    b = _file(d / "b.jsonl", {0: range(9, 13), 1: range(7, 10), 2: range(0, 8)}, {0: [11], 1: [8], 2: [1, 6]})
    return a, b


def _config(path: Path) -> list[str]:
    return ["--config", str(REPO / "configs" / "demo.yaml"), "--no-ray", *CONFIG]


def _edges(bank: Path) -> list[tuple]:
    t = Bank(bank).read("edges")
    return sorted(zip(*(t[c].to_pylist() for c in ("history_id", "mode", "src", "dst", "similarity"))))


def _segments(bank: Path) -> list[tuple]:
    t = Bank(bank).read("edge_segments")
    return sorted(zip(*(t[c].to_pylist() for c in ("history_id", "first_session", "end_session"))))


def _rankings(run: Path) -> tuple[list[dict], dict]:
    results = Bank(run / "results")
    rows = results.read("rankings").to_pylist()
    rows.sort(key=lambda r: (r["method"], r["query_id"], r["rank"]))
    return rows, json.loads((run / "metrics.json").read_text())["retrieval"]


@pytest.mark.slow
def test_index_after_append_equals_a_fresh_index_byte_for_byte(tmp_path: Path, files: tuple[Path, Path],
                                                               cli: Callable) -> None:
    a, b = files
    grown, fresh = tmp_path / "grown", tmp_path / "fresh"
    # grown: index A, append B, index again (only B's rows are computed)
    cli("ingest", str(a), "--format", "jsonl", "--out", str(grown))
    cli("index", str(grown), *_config(grown))
    before = _edges(grown)
    assert _segments(grown) == [("h0", 0, 9), ("h1", 0, 7)]
    cli("ingest", str(b), "--format", "jsonl", "--append", "--out", str(grown))
    cli("index", str(grown), *_config(grown))
    assert _segments(grown) == [("h0", 0, 9), ("h0", 9, 13), ("h1", 0, 7), ("h1", 7, 10), ("h2", 0, 8)]
    after = _edges(grown)
    assert set(before) <= set(after), "an append changed edges of old rows"
    # fresh: A and B ingested, one index over everything
    cli("ingest", str(a), "--format", "jsonl", "--out", str(fresh))
    cli("ingest", str(b), "--format", "jsonl", "--append", "--out", str(fresh))
    cli("index", str(fresh), *_config(fresh))
    assert _segments(fresh) == [("h0", 0, 13), ("h1", 0, 10), ("h2", 0, 8)]
    assert after == _edges(fresh)
    assert len({e[0] for e in after if e[2] >= 4 * 9}) >= 2, "the appended rows made no edges: nothing tested"
    cli("answer", str(grown), *_config(grown), "--out", str(tmp_path / "run_grown"))
    cli("answer", str(fresh), *_config(fresh), "--out", str(tmp_path / "run_fresh"))
    assert _rankings(tmp_path / "run_grown") == _rankings(tmp_path / "run_fresh")


@pytest.mark.slow
@pytest.mark.parametrize("table", ["edges", "edge_segments"])
def test_a_deleted_part_is_recomputed_alone(tmp_path: Path, files: tuple[Path, Path], cli: Callable,
                                            table: str) -> None:
    """Index twice with an append between, then delete the newest part of either table: the next index
    recomputes exactly that unit's rows (the old segments stay), and the edges are those of before."""
    a, b = files
    bank = tmp_path / "bank"
    cli("ingest", str(a), "--format", "jsonl", "--out", str(bank))
    cli("index", str(bank), *_config(bank))
    old_parts = set(Bank(bank).parts("edges"))
    written = {p: (bank / "edges" / f"{p}.parquet").stat().st_mtime_ns for p in old_parts}
    cli("ingest", str(b), "--format", "jsonl", "--append", "--out", str(bank))
    cli("index", str(bank), *_config(bank))
    want = _edges(bank)
    new_parts = sorted(set(Bank(bank).parts("edges")) - old_parts)
    assert new_parts and old_parts <= set(Bank(bank).parts("edges"))
    (bank / table / f"{new_parts[0]}.parquet").unlink()
    out = cli("index", str(bank), *_config(bank))
    assert "associate" in out.stderr + out.stdout
    assert _edges(bank) == want
    assert old_parts <= set(Bank(bank).parts("edges"))
    assert set(Bank(bank).parts("edges")) == set(Bank(bank).parts("edge_segments"))
    assert {p: (bank / "edges" / f"{p}.parquet").stat().st_mtime_ns for p in old_parts} == written, \
        "the old segments were computed again"


@pytest.mark.slow
def test_a_reordering_append_recomputes_from_the_inserted_session(tmp_path: Path, files: tuple[Path, Path],
                                                                  cli: Callable) -> None:
    """A session dated inside h0's history (``--allow-reorder``) shifts every later position: h0's stored
    segment is stale and h0 is associated again from session 0, h1's segment stays, and the edges equal
    one build over the reordered data."""
    a, _ = files
    early = _session(0, 20)
    early.update(session_id="h0early", date="2024-01-03 12:00")  # between h0s1 and h0s2
    b = tmp_path / "b.jsonl"
    b.write_text(json.dumps({"history_id": "h0", "speakers": ["user", "assistant"], "sessions": [early],
                             "questions": []}) + "\n")
    grown, fresh = tmp_path / "grown", tmp_path / "fresh"
    cli("ingest", str(a), "--format", "jsonl", "--out", str(grown))
    cli("index", str(grown), *_config(grown))
    cli("ingest", str(b), "--format", "jsonl", "--append", "--allow-reorder", "--out", str(grown))
    cli("index", str(grown), *_config(grown))
    assert _segments(grown) == [("h0", 0, 10), ("h1", 0, 7)]
    cli("ingest", str(a), "--format", "jsonl", "--out", str(fresh))
    cli("ingest", str(b), "--format", "jsonl", "--append", "--allow-reorder", "--out", str(fresh))
    cli("index", str(fresh), *_config(fresh))
    assert _edges(grown) == _edges(fresh)


@pytest.mark.slow
def test_one_history_cut_into_several_units_gives_the_same_edges(tmp_path: Path, files: tuple[Path, Path],
                                                                 cli: Callable, monkeypatch: pytest.MonkeyPatch) -> None:
    """A history whose new rows are more causal work than one unit holds is associated as several units
    (one Ray task each in a cluster): the segments are its row blocks, and the edges equal one unit's."""
    from memgas.pipeline.association import segments

    a, b = files
    one, cut = tmp_path / "one", tmp_path / "cut"
    for bank in (one, cut):
        cli("ingest", str(a), "--format", "jsonl", "--out", str(bank))
        cli("ingest", str(b), "--format", "jsonl", "--append", "--out", str(bank))
    cli("index", str(one), *_config(one))
    monkeypatch.setattr(segments, "UNIT_WORK", segments.causal_work(0, 13) // 3)
    monkeypatch.setattr(segments, "TILE_SESSIONS", 1)
    cli("index", str(cut), *_config(cut))
    h0 = [s for s in _segments(cut) if s[0] == "h0"]
    assert len(h0) == 3 and h0[0][1] == 0 and h0[-1][2] == 13, h0
    assert _edges(cut) == _edges(one)
