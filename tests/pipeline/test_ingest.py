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
from memgas.pipeline.ingest import INGEST_TABLES, detect_format, ingest, is_current
from tests.conftest import SAMPLE_COUNTS

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
    assert {k: s[k] for k in SAMPLE_COUNTS} == SAMPLE_COUNTS
    bank = Bank(tmp_path / "b")
    assert {n: bank.count(n) for n in SAMPLE_COUNTS} == SAMPLE_COUNTS
    assert bank.count("turns") == s["turns"] and bank.count("pairs") == s["pairs"]
    texts = bank.read("texts")
    # every stored text is keyed by its own hash; every session and pair text is present once
    assert texts.column("text_hash").to_pylist() == [text_hash(t) for t in texts.column("text").to_pylist()]
    assert len(set(texts.column("text_hash").to_pylist())) == texts.num_rows
    hashes = set(texts.column("text_hash").to_pylist())
    assert set(bank.read("sessions").column("text_hash").to_pylist()) <= hashes
    assert set(bank.read("pairs").column("text_hash").to_pylist()) <= hashes
    ds = bank.manifest["datasets"][0]
    assert ds["format"] == "locomo" and ds["sha256"] == file_sha256(LOCOMO) and ds["counts"]["queries"] == SAMPLE_COUNTS["queries"]


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


# -- re-ingest never destroys a bank ------------------------------------------------------------------------------
def _visible(bank_dir: Path) -> dict[str, list]:
    """Every visible table's rows (as sorted tuples), by table."""
    bank = Bank(bank_dir)
    out = {}
    for name in bank.tables():
        t = bank.read(name)
        out[name] = sorted(map(repr, zip(*(t.column(c).to_pylist() for c in t.column_names))))
    return out


def _with_caches(bank_dir: Path) -> None:
    """What index leaves beside the ingest: a generation, a derived text (compacted), an embedding."""
    import pyarrow as pa

    from memgas.pipeline.schema import schema_for

    bank = Bank(bank_dir)
    h = bank.read("sessions", ["text_hash"]).column("text_hash")[0].as_py()
    gen = {f.name: None for f in schema_for("generations")}
    gen.update(text_hash=h, kind="summary", model="m", prompt_version="v", output="a summary")
    bank.write_part("generations", "gen-00000", pa.Table.from_pylist([gen], schema=schema_for("generations")))
    bank.write_part("texts", "derived-m-v", pa.table({"text_hash": [text_hash("a summary")], "text": ["a summary"]}))
    bank.write("texts", bank.read("texts"))  # compaction as the index stage does it
    row = {f.name: None for f in schema_for("embeddings", 2)}
    row.update(text_hash=h, encoder="e", vector=[0.5, 0.25], truncated=False)
    bank.write_part("embeddings", "enc-00000", pa.Table.from_pylist([row], schema=schema_for("embeddings", 2)))


CACHES = ("generations", "embeddings")


def test_bad_file_leaves_the_old_bank_and_its_caches(tmp_path: Path) -> None:
    b = tmp_path / "b"
    ingest(LME, "longmemeval", b, progress=False, chunk_histories=1)
    _with_caches(b)
    before = _visible(b)
    bad = tmp_path / "bad.json"
    raw = LOCOMO.read_bytes()
    bad.write_bytes(raw[: len(raw) // 2])  # truncated in the second conversation: one chunk was staged
    with pytest.raises(DataError, match="truncated"):
        ingest(bad, "locomo", b, progress=False, chunk_histories=1)
    assert _visible(b) == before
    assert not list(b.glob("*/ingest-b-*")) and not list(b.glob("*/_done/ingest-b-*"))


def test_reingest_keeps_caches_and_derived_texts(tmp_path: Path) -> None:
    b = tmp_path / "b"
    ingest(LME, "longmemeval", b, progress=False)
    _with_caches(b)
    caches = {n: _visible(b)[n] for n in CACHES}
    ingest(LOCOMO, "locomo", b, progress=False)
    bank = Bank(b)
    assert {n: _visible(b)[n] for n in CACHES} == caches
    hashes = set(bank.read("texts").column("text_hash").to_pylist())
    assert text_hash("a summary") in hashes  # the derived text survived
    fresh = tmp_path / "fresh"
    ingest(LOCOMO, "locomo", fresh, progress=False)
    for name in ("histories", "sessions", "turns", "pairs", "queries"):
        assert bank.read(name).equals(Bank(fresh).read(name)), name
    # the old file's ingested texts are gone; the new file's are all there
    assert set(Bank(fresh).read("texts").column("text_hash").to_pylist()) <= hashes
    assert len(hashes) == Bank(fresh).count("texts") + 1


def test_keyboard_interrupt_leaves_the_bank_unchanged(tmp_path: Path, monkeypatch) -> None:
    import memgas.pipeline.ingest as ing

    b = tmp_path / "b"
    ingest(LME, "longmemeval", b, progress=False)
    before = _visible(b)
    real = ing.loader

    def interrupted(fmt):
        def load(*a, **kw):
            for i, rec in enumerate(real(fmt)(*a, **kw)):
                if i == 1:
                    raise KeyboardInterrupt
                yield rec
        return load

    monkeypatch.setattr(ing, "loader", interrupted)
    with pytest.raises(ing.IngestInterrupted, match="unchanged"):
        ingest(LOCOMO, "locomo", b, progress=False, chunk_histories=1)
    assert _visible(b) == before and not list(b.glob("*/ingest-b-*"))
    # into a new directory: nothing is left
    with pytest.raises(ing.IngestInterrupted):
        ingest(LOCOMO, "locomo", tmp_path / "new", progress=False, chunk_histories=1)
    assert not (tmp_path / "new").exists()


def test_legacy_bank_is_read_and_replaced(tmp_path: Path) -> None:
    """A bank written before ingest commits (parts ingest-00000, no manifest record) still reads, and a
    re-ingest replaces it the new way."""
    import json

    b = tmp_path / "b"
    ingest(LME, "longmemeval", b, progress=False, chunk_histories=2)
    want = _visible(b)
    m = json.loads((b / "manifest.json").read_text())
    del m["ingest"]
    (b / "manifest.json").write_text(json.dumps(m))
    for f in list(b.glob("*/ingest-a-*")) + list(b.glob("*/_done/ingest-a-*")):
        f.rename(f.with_name(f.name.replace("ingest-a-", "ingest-")))
    assert Bank(b).parts("sessions") == ["ingest-00000", "ingest-00001"]
    assert _visible(b) == want
    ingest(LOCOMO, "locomo", b, progress=False)
    assert Bank(b).parts("sessions") == ["ingest-a-00000"] and not list(b.glob("*/ingest-0*"))
    assert Bank(b).count("histories") == 2


@pytest.mark.parametrize("limit", [-1, 1.5, True])
def test_bad_limit(tmp_path: Path, limit) -> None:
    from memgas.pipeline.errors import MemgasError

    with pytest.raises(MemgasError, match="limit"):
        ingest(LME, "longmemeval", tmp_path / "b", progress=False, limit=limit)
    assert not (tmp_path / "b").exists()


def test_out_that_is_not_a_bank(tmp_path: Path) -> None:
    from memgas.pipeline.errors import BankError

    (tmp_path / "file").write_text("x")
    with pytest.raises(BankError, match="not a directory"):
        ingest(LME, "longmemeval", tmp_path / "file", progress=False)
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / "notes.txt").write_text("mine")
    with pytest.raises(BankError, match="not a memory bank"):
        ingest(LME, "longmemeval", tmp_path / "home", progress=False)
    assert sorted(p.name for p in (tmp_path / "home").iterdir()) == ["notes.txt"]


# -- the same with a real `memgas ingest` killed (SIGKILL) or failing (ENOSPC) at named points ------------------
def _memgas(*args: str, fault: str | None = None, timeout: float = 300):
    import os
    import subprocess
    import sys

    env = {**os.environ, "TQDM_DISABLE": "1"}
    if fault:
        env["MEMGAS_FAULT"] = fault
    exe = Path(sys.executable).with_name("memgas")
    return subprocess.run([str(exe), *args], env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("fault, rc", [
    ("kill@ingest:after-part", -9),
    ("kill@ingest:after-part#2", -9),
    ("kill@ingest:before-commit", -9),
    ("kill@bank:manifest:before-rename", -9),
    ("enospc@bank:write-part:before-rename", 3),
    ("enospc@bank:manifest:before-rename", 3),
])
def test_killed_reingest_keeps_the_old_dataset(tmp_path: Path, fault: str, rc: int) -> None:
    b = tmp_path / "b"
    ingest(LME, "longmemeval", b, progress=False)
    _with_caches(b)
    before = _visible(b)
    # 1,100 small synthetic questions: three staged parts (500 histories each) before the commit
    from memgas.pipeline.data.synth import synth

    small = synth(tmp_path / "s.json", questions=1100, sessions_per_history=3, turns_per_session=2)
    proc = _memgas("ingest", str(small), "--out", str(b), fault=fault)
    assert proc.returncode == rc, proc.stderr[-2000:]
    if rc == 3:
        assert proc.stderr.count("\n") == 1 and "No space left on device" in proc.stderr
    assert _visible(b) == before  # readable, and exactly the old dataset with its caches
    assert is_current(b, LME, "longmemeval")
    # the next ingest recovers: the new dataset, nothing of the killed attempt left behind
    assert _memgas("ingest", str(small), "--out", str(b), "-q").returncode == 0
    fresh = tmp_path / "fresh"
    ingest(small, "longmemeval", fresh, progress=False)
    for name in ("histories", "sessions", "turns", "pairs", "queries"):
        assert Bank(b).read(name).equals(Bank(fresh).read(name)), name
    assert {n: _visible(b)[n] for n in CACHES} == {n: before[n] for n in CACHES}
    committed = Bank(b).ingest_parts()
    assert {p.stem for p in b.glob("*/ingest-*.parquet")} == committed


def test_kill_after_the_commit_holds_the_new_dataset(tmp_path: Path) -> None:
    b = tmp_path / "b"
    ingest(LME, "longmemeval", b, progress=False)
    proc = _memgas("ingest", str(LOCOMO), "--out", str(b), fault="kill@ingest:after-commit")
    assert proc.returncode == -9
    assert is_current(b, LOCOMO, "locomo") and Bank(b).count("histories") == 2
    assert list(b.glob("histories/ingest-a-*"))  # the old parts are still on disk, invisible
    assert _memgas("ingest", str(LME), "--out", str(b), "-q").returncode == 0
    assert is_current(b, LME, "longmemeval") and not list(b.glob("histories/ingest-b-*"))


def test_first_ingest_killed_leaves_an_empty_bank_that_is_not_trusted(tmp_path: Path) -> None:
    b = tmp_path / "b"
    assert _memgas("ingest", str(LME), "--out", str(b), fault="kill@ingest:before-commit").returncode == -9
    assert Bank(b).count("histories") == 0 and not Bank(b).exists("sessions")
    assert not is_current(b, LME, "longmemeval")
    assert _memgas("ingest", str(LME), "--out", str(b)).returncode == 0
    assert is_current(b, LME, "longmemeval")


def test_sigint_during_ingest_says_the_bank_is_unchanged(tmp_path: Path) -> None:
    import os
    import signal
    import subprocess
    import sys
    import time

    from memgas.pipeline.data.synth import synth

    b = tmp_path / "b"
    ingest(LME, "longmemeval", b, progress=False)
    before = _visible(b)
    big = synth(tmp_path / "big.json", questions=9000, sessions_per_history=8, turns_per_session=4)  # long enough to interrupt
    exe = Path(sys.executable).with_name("memgas")
    proc = subprocess.Popen([str(exe), "ingest", str(big), "--out", str(b)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "TQDM_DISABLE": "1"},
                            # as from a shell: a child inherits an ignored SIGINT (earlier in-process Ray
                            # tests leave the pytest process ignoring it), and Python then never raises
                            # KeyboardInterrupt, so the interrupt this test sends would be lost
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None and not list(b.glob("histories/_done/ingest-b-*")):
        time.sleep(0.02)
    assert proc.poll() is None, "ingest finished before it could be interrupted"
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130
    assert "before the new data was committed" in err and "unchanged" in err and "completed units are kept" not in err
    assert _visible(b) == before and not list(b.glob("*/ingest-b-*"))
