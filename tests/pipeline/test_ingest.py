"""ingest(): bundled sample round trip, idempotent re-ingest, chunking, limit, format detection."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

import pyarrow.compute as pc
import pytest

from memgas.pipeline.bank import Bank
from memgas.pipeline.errors import DataError
from memgas.pipeline.hashing import file_sha256, text_hash
from memgas.pipeline.ingest import INGEST_TABLES, detect_format, ingest

REPO = Path(__file__).resolve().parents[2]
SAMPLE = REPO / "data" / "sample"
LOCOMO = SAMPLE / "locomo_sample.json"
LME = SAMPLE / "longmemeval_s_sample3.json"


def _parquet_digest(bank_dir: Path) -> dict[str, str]:
    """sha256 of every visible part, by table and part name with the ingest slot masked (ingest-a-/-b-)."""
    bank = Bank(bank_dir)
    out = {}
    for name in bank.tables():
        for part in bank.parts(name):
            key = f"{name}/{re.sub(r'^ingest-[ab]-', 'ingest-X-', part)}"
            out[key] = hashlib.sha256((bank_dir / name / f"{part}.parquet").read_bytes()).hexdigest()
    return out


def test_roundtrip_locomo_sample(tmp_path: Path) -> None:
    s = ingest(LOCOMO, "locomo", tmp_path / "b", progress=False)
    assert (s["histories"], s["sessions"], s["queries"]) == (2, 38, 304)
    bank = Bank(tmp_path / "b")
    assert {n: bank.count(n) for n in ("histories", "sessions", "queries")} == {"histories": 2, "sessions": 38, "queries": 304}
    assert bank.count("turns") == s["turns"] and bank.count("pairs") == s["pairs"]
    texts = bank.read("texts")
    # every stored text is keyed by its own hash; every session and pair text is present once
    assert texts.column("text_hash").to_pylist() == [text_hash(t) for t in texts.column("text").to_pylist()]
    assert len(set(texts.column("text_hash").to_pylist())) == texts.num_rows
    hashes = set(texts.column("text_hash").to_pylist())
    assert set(bank.read("sessions").column("text_hash").to_pylist()) <= hashes
    assert set(bank.read("pairs").column("text_hash").to_pylist()) <= hashes
    ds = bank.manifest["datasets"][0]
    assert ds["format"] == "locomo" and ds["sha256"] == file_sha256(LOCOMO) and ds["counts"]["queries"] == 304


def test_reingest_is_idempotent(tmp_path: Path) -> None:
    b = tmp_path / "b"
    s1 = ingest(LME, "longmemeval", b, progress=False, chunk_histories=1)
    d1 = _parquet_digest(b)
    rows1 = {n: Bank(b).count(n) for n in INGEST_TABLES}
    s2 = ingest(LME, "longmemeval", b, progress=False, chunk_histories=1)
    assert _parquet_digest(b) == d1
    assert {n: Bank(b).count(n) for n in INGEST_TABLES} == rows1
    assert {k: s1[k] for k in rows1 if k in s1} == {k: s2[k] for k in rows1 if k in s2}
    assert s1["parts"] == 3
    # replacing with a smaller dataset leaves none of the old parts behind
    ingest(LME, "longmemeval", b, progress=False, limit=1)
    assert Bank(b).count("histories") == 1 and Bank(b).parts("histories") == ["ingest-a-00000"]
    # and no file of the replaced ingests is left on disk
    assert sorted(f.name for f in (b / "histories").glob("*.parquet")) == ["ingest-a-00000.parquet"]


def test_chunking_does_not_change_content(tmp_path: Path) -> None:
    one = ingest(LME, "longmemeval", tmp_path / "one", progress=False)
    many = ingest(LME, "longmemeval", tmp_path / "many", progress=False, chunk_histories=1)
    for name in INGEST_TABLES:
        a = Bank(tmp_path / "one").read(name)
        b = Bank(tmp_path / "many").read(name)
        assert a.equals(b), name
    assert one["parts"] == 1 and many["parts"] == 3


def test_lme_sample_bank(tmp_path: Path) -> None:
    ingest(LME, "auto", tmp_path / "b", progress=False)
    q = Bank(tmp_path / "b").read("queries").to_pylist()
    assert [x["question_type"] for x in q] == ["multi-session", "temporal-reasoning", "knowledge-update"]
    assert [x["is_abstention"] for x in q] == [False, False, True]
    assert all(x["evidence_session_ids"] for x in q)
    assert all(x["evidence_turn_ids"] for x in q if not x["is_abstention"])
    turns = Bank(tmp_path / "b").read("turns")
    assert pc.sum(turns.column("has_answer")).as_py() >= 3


def test_detect_format(tmp_path: Path) -> None:
    assert detect_format(LOCOMO) == "locomo" and detect_format(LME) == "longmemeval"
    (tmp_path / "x.jsonl").write_text("{}\n")
    assert detect_format(tmp_path / "x.jsonl") == "jsonl"
    with pytest.raises(DataError):
        ingest(tmp_path / "missing.json", "auto", tmp_path / "b", progress=False)
    with pytest.raises(DataError, match="unknown format"):
        ingest(LOCOMO, "csv", tmp_path / "b", progress=False)
